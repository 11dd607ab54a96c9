"""Trace readers, transforms, burst windows and the gamma arrival generator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from workload.traces import (
    TraceRequest,
    detect_format,
    find_burst_window,
    load_trace,
    synthetic_gamma,
    transform,
)

FIXTURE_TRACES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "traces"

AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:50.9951690,12,3
2023-11-16 18:16:01.0000000,879,55
"""

BURSTGPT_CSV = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,Conversation log
10.5,ChatGPT,30,7,37,API log
"""

MOONCAKE_LINES = [
    {"timestamp": 1500, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1]},
    {"timestamp": 0, "input_length": 7322, "output_length": 490, "hash_ids": [0, 2]},
    {"timestamp": 3000, "input_length": 10, "output_length": 3},
]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def reqs(*arrivals: float, inp: int = 10, out: int = 5) -> list[TraceRequest]:
    return [TraceRequest(a, inp, out) for a in arrivals]


# ---- readers ---------------------------------------------------------------------------------------

def test_azure_reader_parses_7_digit_fractions(tmp_path: Path) -> None:
    path = write(tmp_path, "azure.csv", AZURE_CSV)
    trace = load_trace(path)
    assert detect_format(path) == "azure"
    assert [r.arrival_s for r in trace] == pytest.approx([0.0, 4.314579, 4.314579, 14.31941], abs=1e-9)
    assert [(r.input_tokens, r.output_tokens) for r in trace] == [(374, 44), (396, 109), (12, 3), (879, 55)]


def test_mooncake_reader_ms_sorted_and_keeps_hash_ids(tmp_path: Path) -> None:
    path = write(tmp_path, "trace.jsonl", "\n".join(json.dumps(x) for x in MOONCAKE_LINES) + "\n\n")
    trace = load_trace(path)
    assert trace == [TraceRequest(0.0, 7322, 490, (0, 2)), TraceRequest(1.5, 6758, 500, (0, 1)),
                     TraceRequest(3.0, 10, 3)]
    assert transform(trace, length_scale=0.5)[0].block_ids == (0, 2)  # scaling keeps the shared blocks
    bad = write(tmp_path, "bad.jsonl", json.dumps({**MOONCAKE_LINES[0], "hash_ids": ["a"]}) + "\n")
    with pytest.raises(ValueError, match="hash_ids"):
        load_trace(bad)


def test_shared_block_prompts_share_exactly_the_shared_ids(smollm) -> None:
    from workload.items import PromptBuilder, default_text_path

    builder = PromptBuilder(smollm.tokenizer, default_text_path().read_text(encoding="utf-8"))
    a = builder.shared_blocks_prompt((0, 1, 2), 16, None)
    b = builder.shared_blocks_prompt((0, 1, 5), 16, None)
    assert len(a) == len(b) == 48 and a[:32] == b[:32] and a[32:] != b[32:]
    assert builder.shared_blocks_prompt((0, 1, 2), 16, 40) == a[:40]      # capped


def test_burstgpt_reader_skips_failures_and_rebases(tmp_path: Path) -> None:
    path = write(tmp_path, "burst.csv", BURSTGPT_CSV)
    assert detect_format(path) == "burstgpt"
    trace = load_trace(path)
    # The 45 s row has Response tokens == 0 (a failure) and is dropped; arrivals start at 0.
    assert trace == [TraceRequest(0.0, 472, 18), TraceRequest(5.5, 30, 7), TraceRequest(113.0, 417, 276)]
    assert load_trace(path, fmt="burstgpt") == trace


def test_real_azure_conv_trace_excerpt() -> None:
    """The committed excerpt of the Azure conv trace (tests/fixtures/README.md): real rows, read as the full trace."""
    trace = load_trace(FIXTURE_TRACES / "azure_conv_burst.csv")
    assert len(trace) == 741
    assert trace[0] == TraceRequest(0.0, 4084, 67) and trace[-1] == TraceRequest(pytest.approx(91.860108), 393, 95)
    arrivals = np.array([r.arrival_s for r in trace])
    assert np.all(np.diff(arrivals) >= 0)
    assert np.median([r.input_tokens for r in trace]) == 428 and np.median([r.output_tokens for r in trace]) == 92
    # it holds the full trace's busiest 72 s (1634.75 s after the full trace's first row, 1624.87 s the excerpt's)
    start, end = find_burst_window(trace, 72.0)
    assert (start, end) == (pytest.approx(9.885604), pytest.approx(81.885604))
    assert len(transform(trace, (start, end))) == 616


def test_real_mooncake_trace_excerpt() -> None:
    """The committed Mooncake excerpt: 200 requests from 600 s on whose hash_ids share real prefixes."""
    trace = load_trace(FIXTURE_TRACES / "mooncake_conversation_600s.jsonl")
    assert len(trace) == 200 and trace[0].arrival_s == 0.0 and trace[-1].arrival_s == pytest.approx(53.999)
    assert trace[0] == TraceRequest(0.0, 904, 370, (0, 34850))
    assert all(r.block_ids and r.block_ids[0] == 0 for r in trace)  # every request starts with the system block
    later = {b for r in trace for b in r.block_ids[1:]}
    shared = [r for i, r in enumerate(trace) if set(r.block_ids[1:]) & {b for q in trace[:i] for b in q.block_ids[1:]}]
    assert len(later) == 4478 and len(shared) == 5  # beyond the system block, 5 requests reuse an earlier one's blocks


@pytest.mark.parametrize(
    ("name", "text", "fmt", "match"),
    [
        ("a.csv", AZURE_CSV, "parquet", "unknown trace format"),
        ("a.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,3\n", "azure", "missing columns.*GeneratedTokens"),
        ("a.csv", "foo,bar\n1,2\n", "auto", "cannot detect trace format"),
        ("a.csv", "", "auto", "empty file"),
        ("a.csv", "", "azure", "empty file"),
        ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "auto", "no requests"),
        ("a.jsonl", "", "auto", "no requests"),
        ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,-3,4\n", "auto",
         "ContextTokens is negative"),
        ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n", "auto", "cannot parse timestamp"),
        ("a.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": -1}\n', "auto",
         "output_length is negative"),
        ("a.jsonl", '{"timestamp": 0, "input_length": 5}\n', "auto", r"a.jsonl:1: missing keys \['output_length'\]"),
        ("a.jsonl", "{not json\n", "auto", "invalid JSON"),
        ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,M,x,2,3,API log\n",
         "auto", "Request tokens is not a number"),
        ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,M,5,0,5,API log\n",
         "auto", "no requests"),
    ],
)
def test_reader_errors(tmp_path: Path, name: str, text: str, fmt: str, match: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ValueError, match=match):
        load_trace(path, fmt=fmt)


# ---- transform -------------------------------------------------------------------------------------

def test_window_selects_half_open_and_rebases_to_window_start() -> None:
    trace = reqs(0.0, 1.0, 2.5, 3.0, 4.0)
    out = transform(trace, window=(1.0, 3.0))
    assert [r.arrival_s for r in out] == [0.0, 1.5]  # 1.0 and 2.5 kept; 3.0 excluded
    out = transform(trace, window=(0.5, 3.5))
    assert [r.arrival_s for r in out] == pytest.approx([0.5, 2.0, 2.5])


def test_time_scale_stretches_inter_arrivals() -> None:
    trace = reqs(0.0, 1.0, 3.0)
    slow = transform(trace, time_scale=2.0)  # twice as slow
    assert [r.arrival_s for r in slow] == [0.0, 2.0, 6.0]
    fast = transform(trace, window=(1.0, 10.0), time_scale=0.5)
    assert [r.arrival_s for r in fast] == [0.0, 1.0]


def test_length_scale_then_caps_then_min_tokens() -> None:
    trace = [TraceRequest(0.0, 1000, 129), TraceRequest(1.0, 3, 1), TraceRequest(2.0, 25, 15)]
    out = transform(trace, length_scale=0.1, max_input_tokens=64, max_output_tokens=8, min_tokens=2)
    # 1000*0.1=100 -> cap 64; 129*0.1=12.9 -> 13 -> cap 8; 3*0.1 -> 0 -> min 2; 25*.1=2.5 -> 3; 1.5 -> 2
    assert [(r.input_tokens, r.output_tokens) for r in out] == [(64, 8), (2, 2), (3, 2)]
    assert [r.arrival_s for r in out] == [0.0, 1.0, 2.0]


def test_transform_defaults_are_identity_and_sort() -> None:
    trace = [TraceRequest(2.0, 5, 6), TraceRequest(1.0, 7, 8)]
    assert transform(trace) == sorted(trace, key=lambda r: r.arrival_s)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": (3.0, 3.0)},
        {"window": (5.0, 1.0)},
        {"time_scale": 0.0},
        {"time_scale": -1.0},
        {"length_scale": 0.0},
        {"max_input_tokens": 0},
        {"max_output_tokens": 4, "min_tokens": 5},
        {"min_tokens": -1},
    ],
)
def test_transform_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        transform(reqs(0.0, 1.0), **kwargs)


# ---- burst window ----------------------------------------------------------------------------------

def test_find_burst_window() -> None:
    trace = reqs(0.0, 5.0, 10.0, 10.2, 10.4, 10.9, 11.0, 20.0)
    start, end = find_burst_window(trace, 1.0)
    assert (start, end) == (10.0, 11.0)  # 10, 10.2, 10.4, 10.9 (11.0 is outside [10, 11))
    assert len(transform(trace, window=(start, end))) == 4
    assert find_burst_window(reqs(3.0, 1.0), 0.5) == (1.0, 1.5)  # tie -> earliest
    with pytest.raises(ValueError):
        find_burst_window([], 1.0)
    with pytest.raises(ValueError):
        find_burst_window(trace, 0.0)


# ---- synthetic gamma -------------------------------------------------------------------------------

def test_gamma_reproducible_and_lengths() -> None:
    a = synthetic_gamma(200, rate_rps=4.0, burstiness=0.5, input_tokens=(16, 64), output_tokens=8, seed=7)
    b = synthetic_gamma(200, rate_rps=4.0, burstiness=0.5, input_tokens=(16, 64), output_tokens=8, seed=7)
    c = synthetic_gamma(200, rate_rps=4.0, burstiness=0.5, input_tokens=(16, 64), output_tokens=8, seed=8)
    assert a == b and a != c
    assert a[0].arrival_s == 0.0
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:]))
    assert all(16 <= r.input_tokens <= 64 and r.output_tokens == 8 for r in a)
    assert len({r.input_tokens for r in a}) > 30  # actually sampled from the range
    assert all(isinstance(r.input_tokens, int) and isinstance(r.arrival_s, float) for r in a)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_mean_rate_and_burstiness(burstiness: float) -> None:
    n, rate = 20000, 5.0
    trace = synthetic_gamma(n, rate_rps=rate, burstiness=burstiness, input_tokens=1, output_tokens=1, seed=0)
    gaps = np.diff([r.arrival_s for r in trace])
    assert (n - 1) / trace[-1].arrival_s == pytest.approx(rate, rel=0.05)
    # Gamma(shape=k) gaps have coefficient of variation 1/sqrt(k): lower burstiness = burstier.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)


def test_gamma_edge_cases() -> None:
    assert synthetic_gamma(0, 1.0, 1.0, 1, 1, seed=0) == []
    assert [r.arrival_s for r in synthetic_gamma(3, float("inf"), 1.0, 1, 1, seed=0)] == [0.0, 0.0, 0.0]
    for kwargs in (
        {"rate_rps": 0.0},
        {"burstiness": 0.0},
        {"input_tokens": 0},
        {"input_tokens": (5, 4)},
        {"output_tokens": (1.0, 2.0)},
        {"num_requests": -1},
    ):
        args = {"num_requests": 3, "rate_rps": 1.0, "burstiness": 1.0, "input_tokens": 4,
                "output_tokens": 4, "seed": 0} | kwargs
        with pytest.raises(ValueError):
            synthetic_gamma(**args)
