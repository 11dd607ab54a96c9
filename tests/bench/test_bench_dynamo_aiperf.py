"""bench.dynamo_aiperf's pieces that need neither AIPerf nor a Dynamo cluster (as tests/bench/test_bench_aiperf.py for
bench.aiperf): the Mooncake trace it hands AIPerf, the flags every worker gets, AIPerf's export read back, the table."""

from __future__ import annotations

import json
from pathlib import Path

from bench import dynamo_aiperf as da
from serve.dynamo.cli import parse_worker_args


def test_the_trace_holds_the_schedule_prompt_text_and_forced_lengths(tiny_dir: Path, tmp_path: Path) -> None:
    args = da.build_parser().parse_args(["--model", str(tiny_dir), "--num-requests", "3", "--input-len", "8",
                                         "--output-len", "2", "--request-rate", "4"])
    n, desc = da.write_trace(args, tmp_path / "t.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert n == 3 and len(rows) == 3 and desc.startswith("synthetic gamma: 3 requests")
    assert [r["output_length"] for r in rows] == [2, 2, 2] and all(r["text_input"] for r in rows)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)


def test_every_worker_gets_the_engine_flags_the_benchmark_was_given() -> None:
    """The benchmark's engine flags are serve/config_flags.py's, passed on: the worker's own parser reads them back."""
    args = da.build_parser().parse_args(["--device-memory", "700MiB", "--max-model-len", "384", "--worker-threads", "2",
                                         "--slo-ttft-s", "1.5"])
    flags = da.worker_flags(args, "default", "preserve")
    engine = parse_worker_args([*flags, "--model", "m"]).engine
    assert (engine.device_memory, engine.max_model_len, engine.num_threads, engine.slo_ttft_s, engine.morph_mode,
            engine.prefix_cache_across_morph) == ("700MiB", 384, 2, 1.5, "default", "preserve")
    assert "--model" not in flags  # the cluster names the model


def test_aiperf_export_read_back_in_seconds_and_the_table(tmp_path: Path) -> None:
    stats = {"unit": "ms", "avg": 20.0, "p50": 10.0, "p95": 30.0, "p99": 40.0}
    (tmp_path / "profile_export_aiperf.json").write_text(json.dumps({"records": {
        "time_to_first_token": stats, "inter_token_latency": stats, "request_latency": stats,
        "request_count": {"avg": 2}, "error_request_count": {"avg": 0}, "request_throughput": {"avg": 1.5}}}))
    (tmp_path / "profile_export.jsonl").write_text("\n".join(json.dumps(
        {"metrics": {"time_to_first_token": {"value": v, "unit": "ms"}}}) for v in (500.0, 2500.0)) + "\n")
    got = da.parse_aiperf(tmp_path / "profile_export_aiperf.json", slo_ttft_s=2.0)
    assert got["ttft_s"] == {"p50": 0.01, "p95": 0.03, "p99": 0.04, "avg": 0.02}
    assert (got["completed"], got["errors"], got["slo_violation_pct"]) == (2, 0, 50.0)
    workers = {"base_total_blocks": [10, 10], "max_total_blocks": [12, 10], "swaps": [1, 0], "requests": [1, 1],
               "prefix_queried_tokens": 100, "prefix_hit_tokens": 25}
    runs = [{**got, "replicas": 2, "mode": "default", "router": "kv", "workers": workers} for _ in range(2)]
    runs[1]["workers"] = {**workers, "prefix_hit_tokens": 50}
    table = da.table(runs)
    assert "| 2 | default | kv | exact | 2 | 2/0 | 37.5% [25.0%-50.0%] | 0.010 | 0.030 | 0.040 | 20.0 | 50.0 |" in table
