"""bench.peer_servers' pieces that need neither vLLM nor AIPerf: the fixed-rate schedule and its Mooncake
export, the command lines, AIPerf's token totals, the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.aiperf import export_mooncake
from bench.peer_servers import completions_command, fixed_rate_items, run_order, table, token_counts
from bench.triton.requests import prepare_requests
from bench.vllm_server import serve_command, vllm_env
from workload.items import PromptBuilder, default_text_path


def test_fixed_rate_schedule_exports_to_mooncake(smollm, tmp_path: Path) -> None:
    builder = PromptBuilder(smollm.tokenizer, default_text_path().read_text(encoding="utf-8"))
    items = fixed_rate_items(builder, 6, 2.0, 128, 256, 64, seed=1)
    assert [w.arrival_s for w in items] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert all(128 <= len(w.prompt_ids) <= 256 and w.output_tokens == 64 for w in items)
    assert fixed_rate_items(builder, 6, 2.0, 128, 256, 64, seed=1) == items  # seeded
    reqs, retok = prepare_requests(items, smollm.tokenizer)
    assert retok["max_abs_diff"] <= 2  # text prompts of (nearly) the requested token counts
    path = tmp_path / "trace.jsonl"
    export_mooncake(reqs, path)
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == [0.0, 500.0, 1000.0, 1500.0, 2000.0, 2500.0]
    assert {r["output_length"] for r in rows} == {64}
    with pytest.raises(ValueError):
        fixed_rate_items(builder, 4, 0.0, 128, 256, 64)


def test_completions_command_forces_lengths_on_a_fixed_schedule(tmp_path: Path) -> None:
    cmd = completions_command("aiperf", "127.0.0.1:9", tmp_path / "t.jsonl", tmp_path / "tok", tmp_path / "a", 32, 64)
    joined = " ".join(cmd)
    assert "--endpoint-type completions --streaming" in joined
    assert "--extra-inputs ignore_eos:true --extra-inputs min_tokens:64" in joined
    assert "--custom-dataset-type mooncake_trace --fixed-schedule" in joined
    assert cmd[cmd.index("--url") + 1] == "http://127.0.0.1:9" and cmd[cmd.index("--request-count") + 1] == "32"


def test_vllm_server_command_is_local_fp32_on_the_cpu_platform(tmp_path: Path) -> None:
    cmd = serve_command("py", tmp_path, 1234, "morphserve")
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path)]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--dtype") + 1] == "float32"
    env = vllm_env(2)
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_token_totals_and_table(tmp_path: Path) -> None:
    path = tmp_path / "profile_export_aiperf.json"
    path.write_text(json.dumps({"total_output_tokens": {"avg": 2048.0}, "total_isl": {"avg": 6000.0},
                                "output_sequence_length": {"min": 64, "max": 64, "avg": 64}}))
    assert token_counts(path) == {"output_tokens": 2048.0, "input_tokens": 6000.0, "usage_output_tokens": None,
                                  "osl_min": 64, "osl_max": 64}
    stats = {"ttft_s": {"p50": 0.5, "p95": 1.0, "mean": 0.6}, "tpot_s": {"p50": 0.1, "p95": 0.2, "mean": 0.1},
             "e2el_s": {"p50": 7.0, "p95": 9.0, "mean": 7.0}}
    ours = {k: {s: v * 2 for s, v in d.items()} for k, d in stats.items()}
    md = table([{"vllm": stats, "ours": ours}])
    assert "| TTFT p50 | 500.0 | 1000.0 | 2.00x | 2.00 |" in md
    slower_vm = {k: {s: v * 3 for s, v in d.items()} for k, d in stats.items()}  # both servers 3x slower in run 2
    md = table([{"vllm": stats, "ours": ours}, {"vllm": slower_vm, "ours": {k: {s: v * 0.5 for s, v in d.items()}
                                                                          for k, d in slower_vm.items()}}])
    # medians 1000 vs 875 (0.88x), while ours was 2.00x and 0.50x of vLLM in the two runs
    assert "| TTFT p50 | 1000.0 [500.0-1500.0] | 875.0 [750.0-1000.0] | 0.88x | 1.25 [0.50-2.00] |" in md


def test_the_server_that_goes_first_alternates_between_runs() -> None:
    assert [run_order(i) for i in range(4)] == [("vllm", "ours"), ("ours", "vllm"), ("vllm", "ours"), ("ours", "vllm")]
