"""bench.aiperf's pieces that need no AIPerf: the Mooncake export, AIPerf's summary format, the table."""

from __future__ import annotations

import json
from pathlib import Path

from bench.aiperf import METRICS, export_mooncake, parse_aiperf, table
from bench.triton.requests import PreparedRequest


def test_mooncake_export_keeps_the_schedule_and_the_prompts(tmp_path: Path) -> None:
    reqs = [PreparedRequest(i, "request", t, f"prompt {i} \u00e9", 8 + i, 5, 5) for i, t in enumerate([0.0, 0.25, 1.5])]
    path = tmp_path / "t.jsonl"
    export_mooncake(reqs, path)
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == [0.0, 250.0, 1500.0]
    assert [r["text_input"] for r in rows] == [r.text for r in reqs]
    assert [r["output_length"] for r in rows] == [8, 9, 10]
    assert all(set(r) == {"timestamp", "text_input", "output_length"} for r in rows)


def test_parse_aiperf_summary_in_seconds(tmp_path: Path) -> None:
    stats = {"unit": "ms", "avg": 20.0, "p50": 10.0, "p95": 30.0, "p99": 40.0}
    path = tmp_path / "profile_export_aiperf.json"
    path.write_text(json.dumps({"time_to_first_token": stats, "inter_token_latency": {**stats, "unit": "ms"},
                                "request_latency": {**stats, "p50": 1000.0}, "request_count": {"avg": 3}}))
    got = parse_aiperf(path)
    assert got["ttft_s"] == {"p50": 0.01, "p95": 0.03, "p99": 0.04, "mean": 0.02}
    assert got["e2el_s"]["p50"] == 1.0 and got["completed"] == 3
    own = {k: {"p50": 0.02, "p95": 0.06, "p99": 0.08, "mean": 0.04} for k, _, _ in METRICS}
    md = table([{"own": own, "aiperf": got}])
    assert "| TTFT | p50 | 20.0 | 10.0 | 0.50 |" in md
