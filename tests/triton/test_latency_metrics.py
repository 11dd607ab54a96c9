"""Latency metrics against hand-computed examples (vLLM `vllm bench serve` definitions)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from workload.latency import RequestTiming, distribution, markdown_table, meets_slo, summarize


def three_requests() -> list[RequestTiming]:
    # A: sent at 0, tokens at 1, 2, 4       -> TTFT 1, E2EL 4, TPOT (4-1)/2 = 1.5, ITL [1, 2]
    # B: sent at 1, tokens at 1.5, 2.5      -> TTFT 0.5, E2EL 1.5, TPOT 1.0, ITL [1]
    # C: sent at 2, one token at 5          -> TTFT 3, E2EL 3, no TPOT, no ITL
    return [
        RequestTiming(send_s=0.0, token_times_s=[1.0, 2.0, 4.0], num_output_tokens=3),
        RequestTiming(send_s=1.0, token_times_s=[1.5, 2.5], num_output_tokens=2),
        RequestTiming(send_s=2.0, token_times_s=[5.0], num_output_tokens=1),
    ]


def test_per_request_values() -> None:
    a, b, c = three_requests()
    assert (a.ttft_s, a.e2el_s, a.tpot_s, a.itls_s) == (1.0, 4.0, 1.5, [1.0, 2.0])
    assert (b.ttft_s, b.e2el_s, b.tpot_s, b.itls_s) == (0.5, 1.5, 1.0, [1.0])
    assert (c.ttft_s, c.e2el_s, c.tpot_s, c.itls_s) == (3.0, 3.0, None, [])


def test_summarize_hand_computed() -> None:
    s = summarize(three_requests(), duration_s=5.0, slo_ttft_s=2.0)
    assert (s["num_requests"], s["completed"], s["failed"], s["duration_s"]) == (3, 3, 0, 5.0)
    # TTFT [0.5, 1, 3]: linear percentiles p50 = 1, p95 = 1 + 0.9*2 = 2.8, p99 = 1 + 0.98*2 = 2.96
    assert s["ttft_s"]["p50"] == pytest.approx(1.0)
    assert s["ttft_s"]["p95"] == pytest.approx(2.8)
    assert s["ttft_s"]["p99"] == pytest.approx(2.96)
    assert s["ttft_s"]["mean"] == pytest.approx(1.5)
    # TPOT [1.5, 1.0] (C has a single token)
    assert s["tpot_s"]["mean"] == pytest.approx(1.25)
    assert s["tpot_s"]["p50"] == pytest.approx(1.25)
    # ITL pooled [1, 2, 1]
    assert s["itl_s"]["mean"] == pytest.approx(4 / 3)
    assert s["itl_s"]["p50"] == pytest.approx(1.0)
    assert s["itl_s"]["p99"] == pytest.approx(1.98)
    # E2EL [4, 1.5, 3]
    assert s["e2el_s"]["mean"] == pytest.approx(8.5 / 3)
    assert s["e2el_s"]["p50"] == pytest.approx(3.0)
    # Only C breaks TTFT <= 2
    assert s["slo"] == {"ttft_s": 2.0, "tpot_s": None, "violation_rate": pytest.approx(1 / 3)}
    assert s["goodput_rps"] == pytest.approx(2 / 5)
    assert s["request_throughput_rps"] == pytest.approx(3 / 5)
    assert s["output_tok_s"] == pytest.approx(6 / 5)


def test_percentiles_match_numpy_default() -> None:
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    d = distribution(values)
    for p in (50, 95, 99):
        assert d[f"p{p}"] == pytest.approx(float(np.percentile(values, p)))
    assert d["mean"] == pytest.approx(float(np.mean(values)))


def test_tpot_slo_and_failed_requests_count_as_violations() -> None:
    timings = three_requests() + [
        RequestTiming(send_s=3.0, token_times_s=[], num_output_tokens=0, ok=False, error="boom"),
    ]
    s = summarize(timings, duration_s=10.0, slo_ttft_s=2.0, slo_tpot_s=1.2)
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 3, 1)
    # A violates TPOT (1.5 > 1.2), C violates TTFT, D failed; only B is good.
    assert s["slo"]["violation_rate"] == pytest.approx(3 / 4)
    assert s["goodput_rps"] == pytest.approx(0.1)
    # The failed request is left out of the distributions and the throughputs.
    assert s["ttft_s"]["mean"] == pytest.approx(1.5)
    assert s["request_throughput_rps"] == pytest.approx(0.3)


def test_failed_request_with_partial_tokens_is_excluded() -> None:
    t = RequestTiming(send_s=0.0, token_times_s=[0.1, 0.2], num_output_tokens=2, ok=False, error="reset")
    assert not t.completed and not meets_slo(t, slo_ttft_s=10.0)
    s = summarize([t], duration_s=1.0, slo_ttft_s=10.0)
    assert s["failed"] == 1 and s["ttft_s"]["p50"] is None and s["itl_s"]["mean"] is None


def test_ok_without_tokens_is_not_completed() -> None:
    s = summarize([RequestTiming(send_s=0.0)], duration_s=1.0, slo_ttft_s=1.0)
    assert (s["completed"], s["failed"], s["slo"]["violation_rate"]) == (0, 1, 1.0)


def test_slo_boundary_is_inclusive() -> None:
    t = RequestTiming(send_s=0.0, token_times_s=[2.0, 3.0], num_output_tokens=2)
    assert meets_slo(t, slo_ttft_s=2.0, slo_tpot_s=1.0)
    assert not meets_slo(t, slo_ttft_s=1.999)


def test_chunked_tokens_tpot_uses_token_count_itl_uses_chunks() -> None:
    # 5 tokens in 3 chunks: TPOT = (3 - 1) / 4, ITL gaps = [0.5, 1.5]
    t = RequestTiming(send_s=0.0, token_times_s=[1.0, 1.5, 3.0], num_output_tokens=5)
    assert t.tpot_s == pytest.approx(0.5)
    assert t.itls_s == [0.5, 1.5]


def test_empty_run_never_crashes() -> None:
    s = summarize([], duration_s=0.0, slo_ttft_s=2.0)
    assert s["num_requests"] == 0 and s["completed"] == 0
    for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        assert s[key] == {"p50": None, "p95": None, "p99": None, "mean": None}
    assert s["slo"]["violation_rate"] is None
    assert s["goodput_rps"] is None and s["output_tok_s"] is None
    assert "n/a" in markdown_table({"empty": s})


def test_invalid_timings_rejected() -> None:
    with pytest.raises(ValueError, match="before send"):
        RequestTiming(send_s=1.0, token_times_s=[0.5], num_output_tokens=1)
    with pytest.raises(ValueError, match="non-decreasing"):
        RequestTiming(send_s=0.0, token_times_s=[1.0, 0.9], num_output_tokens=2)
    with pytest.raises(ValueError, match="num_output_tokens"):
        RequestTiming(send_s=0.0, num_output_tokens=-1)
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], duration_s=-1.0, slo_ttft_s=1.0)


def test_markdown_table() -> None:
    s = summarize(three_requests(), duration_s=5.0, slo_ttft_s=2.0)
    table = markdown_table({"fp16": s, "morph": s})
    lines = table.strip().splitlines()
    assert len(lines) == 4
    header_cols = lines[0].count("|")
    assert all(line.count("|") == header_cols for line in lines)
    for col in ("mode", "completed/failed", "P50 TTFT", "P95 TTFT", "P99 TTFT", "mean TPOT",
                "P99 ITL", "SLO violation %", "goodput", "output tok/s"):
        assert col in lines[0]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    # mode, 3/0, TTFT s, TPOT ms, ITL ms, violation %, goodput, tok/s
    assert cells == ["fp16", "3/0", "1.000", "2.800", "2.960", "1250.0", "1980.0", "33.3", "0.400", "1.2"]
    assert math.isclose(s["output_tok_s"], 1.2)
