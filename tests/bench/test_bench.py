"""bench.triton.run / bench.quality / bench.plots: the benchmark's own aggregation code against hand-computed
examples, the server-log parser, and end-to-end smoke runs against a real tritonserver."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest

from bench import qactivations_quality as qaq
from bench.triton.report import check_targets
from bench.triton.requests import (
    PreparedRequest,
    RequestRecord,
    probe_schedule,
    prompt_text,
    retokenization_stats,
    run_request,
    timing_from_chunks,
)
from bench.triton.run import assemble_result
from serve.model import kernels
from workload.latency import summarize
from workload.quality import aggregate_match, match_rates, quality_loss_pct, weighted_perplexity
from workload.summary import (
    config_changes,
    morph_summary,
    parse_morph_events,
    time_weighted_quantized_share,
    tokens_by_config,
)

# --------------------------------------------------------------------------------------------------
# Metric aggregation
# --------------------------------------------------------------------------------------------------


def test_timing_from_chunks_and_summary_hand_computed():
    # Request A: sent at 10.0, chunks at 11.0, 11.5, 12.0 carrying 4 tokens (one chunk held 2 tokens).
    a = timing_from_chunks(10.0, [11.0, 11.5, 12.0], 4, ok=True)
    # Request B: sent at 10.5, first token at 13.5 (TTFT 3.0), single token.
    b = timing_from_chunks(10.5, [13.5], 1, ok=True)
    # Request C: failed before any token.
    c = timing_from_chunks(11.0, [], 0, ok=False, error="GenerationError: boom")
    assert (a.ttft_s, a.e2el_s) == (1.0, 2.0)
    assert a.tpot_s == pytest.approx((2.0 - 1.0) / 3)          # (E2EL - TTFT) / (tokens - 1)
    assert a.itls_s == [0.5, 0.5]                                # chunk gaps
    assert b.tpot_s is None and not c.completed
    s = summarize([a, b, c], duration_s=4.0, slo_ttft_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["ttft_s"]["mean"] == pytest.approx(2.0)
    assert s["ttft_s"]["p50"] == pytest.approx(2.0)              # linear between 1.0 and 3.0
    assert s["slo"]["violation_rate"] == pytest.approx(2 / 3)    # B too slow, C failed
    assert s["goodput_rps"] == pytest.approx(1 / 4)
    assert s["output_tok_s"] == pytest.approx(5 / 4)


def test_timing_clamps_early_chunks_and_no_tokens_is_not_completed():
    t = timing_from_chunks(5.0, [4.9999, 6.0], 2, ok=True)
    assert t.ttft_s == 0.0 and t.e2el_s == 1.0
    assert not timing_from_chunks(5.0, [], 0, ok=True).completed


def test_tokens_by_config_windows_and_initial():
    changes = [(10, "4f"), (25, "44"), (40, "4f")]
    # whole run: [0,10) ff, [10,25) 4f, [25,40) 44, [40,50) 4f
    assert tokens_by_config(changes, "ff", 0, 50) == {"ff": 10, "4f": 25, "44": 15}
    # benchmark window [12, 30): 4f 13, 44 5
    assert tokens_by_config(changes, "ff", 12, 30) == {"4f": 13, "44": 5}
    # no events: everything in the initial configuration; static mode: events at 0
    assert tokens_by_config([], "ff", 3, 8) == {"ff": 5}
    assert tokens_by_config([(0, "4f"), (0, "44")], "ff", 3, 8) == {"44": 5}
    assert tokens_by_config(changes, "ff", 50, 50) == {}


def test_time_weighted_quantized_share():
    tl = [{"t": 0.0, "quantized_layers": 0}, {"t": 1.0, "quantized_layers": 2}, {"t": 3.0, "quantized_layers": 4},
          {"t": 4.0, "quantized_layers": 0}]
    # (0*1 + 2/4*2 + 4/4*1) / 4 = 0.5
    assert time_weighted_quantized_share(tl, 4, 4.0) == pytest.approx(0.5)
    assert time_weighted_quantized_share(tl, 4, 0.0) == 0.0


def test_retokenization_stats_and_probe_schedule():
    s = retokenization_stats([(10, 10), (10, 9), (20, 22)])
    assert s == {"requested_tokens": 40, "sent_tokens": 41, "exact": 1, "requests": 3, "mean_abs_diff": 1.0,
                 "max_abs_diff": 2}
    assert probe_schedule(4, 8.0) == [1.0, 3.0, 5.0, 7.0]
    assert probe_schedule(0, 8.0) == []


def test_quality_aggregation_hand_computed():
    nll = {"ff": math.log(10.0), "44": math.log(40.0)}
    # 3 tokens at ppl 10, 1 at ppl 40: exp((3 ln 10 + ln 40) / 4) = 10 * 4 ** 0.25
    assert weighted_perplexity({"ff": 3, "44": 1}, nll) == pytest.approx(10 * 4 ** 0.25)
    assert weighted_perplexity({"ff": 0}, nll) is None
    assert quality_loss_pct(11.0, 10.0) == pytest.approx(10.0)
    assert quality_loss_pct(None, 10.0) is None
    m = match_rates([1, 2, 3, 4], [1, 2, 9, 4, 5])
    assert (m["prefix_match"], m["positional_match"]) == (2, 3)
    assert (m["prefix_match_rate"], m["positional_match_rate"]) == (0.5, 0.75)
    short = match_rates([1, 2, 3, 4], [1])
    assert (short["prefix_match"], short["positional_match"]) == (1, 1)
    agg = aggregate_match([{**m, "ok": True}, {"ok": False, "reference_tokens": 4}])
    assert agg["reference_tokens"] == 8 and agg["failed"] == 1
    assert (agg["prefix_match_rate"], agg["positional_match_rate"]) == (2 / 8, 3 / 8)


def test_check_targets_hand_computed():
    res = {
        "off": {"slo": {"violation_rate": 0.5}, "ttft_s": {"p95": 10.0}},
        "default": {"slo": {"violation_rate": 0.04}, "ttft_s": {"p95": 4.0}},
        "accuracy": {"quality": {"ppl_loss_pct": 2.0}},
        "static-int4": {"quality": {"ppl_loss_pct": 5.0}},
        "performance": {"ttft_s": {"p95": 4.5}},
    }
    t = {x["name"]: x for x in check_targets(res)}
    assert t["default vs off: SLO violations reduced"]["value"] == pytest.approx(0.92)
    assert t["default vs off: SLO violations reduced"]["passed"] is True
    assert t["default vs off: P95 TTFT improvement"]["value"] == pytest.approx(2.5)
    assert t["accuracy quality loss <= half of static-int4's (perplexity)"]["passed"] is True
    assert t["performance P95 TTFT <= default's"]["passed"] is False
    res["off"]["slo"]["violation_rate"] = 0.0
    assert {x["name"]: x for x in check_targets(res)}["default vs off: SLO violations reduced"]["passed"] is None


# --------------------------------------------------------------------------------------------------
# Server log -> configurations
# --------------------------------------------------------------------------------------------------

LOG = """I1129 09:23:08.924464 13679 grpc_server.cc:2558] "Started GRPCInferenceService at 127.0.0.1:43301"
{"component": "triton_model", "event": "request_added", "request_id": "x", "timestamp": "2026-11-29T09:23:08.99Z"}
{"blocks_added": 16, "component": "morphserve.morph", "event": "swap", "from_precision": "full", "kv_blocks_total": 100, "layer": 2, "time_ms": 10.0, "timestamp": "2026-11-29T09:00:01Z", "to_precision": "int4"}
{"blocks_added": 8, "component": "morphserve.morph", "event": "swap", "from_precision": "full", "kv_blocks_total": 108, "layer": 0, "time_ms": 20.0, "timestamp": "2026-11-29T09:00:02Z", "to_precision": "int8"}
{"component": "morphserve.morph", "event": "swap_deferred", "layer": 1, "timestamp": "2026-11-29T09:00:02.5Z"}
{"blocks_removed": 8, "component": "morphserve.morph", "event": "kv_shrink", "kv_blocks_total": 100, "layer": 0, "timestamp": "2026-11-29T09:00:03Z"}
{"component": "morphserve.morph", "event": "restore", "from_precision": "int8", "layer": 0, "time_ms": 30.0, "timestamp": "2026-11-29T09:00:03Z", "to_precision": "full"}
{"component": "morphserve.morph", "event": "swap", "layer": 1, "truncat
"""  # noqa: E501 - data, not prose


def test_parse_morph_events_skips_noise_and_truncated_lines():
    ev = parse_morph_events(LOG)
    assert [e["event"] for e in ev] == ["swap", "swap", "kv_shrink", "restore"]


def test_config_changes_rebuilt_from_layers_and_timestamps():
    ev = parse_morph_events(LOG)
    import datetime as dt

    base = dt.datetime(2026, 11, 29, 9, 0, 0, tzinfo=dt.timezone.utc).timestamp()
    # 10 tokens per second since 09:00:00
    ch = config_changes(ev, 4, lambda epoch: (epoch - base) * 10)
    assert ch == [(10, "ff4f"), (20, "8f4f"), (30, "8f4f"), (30, "ff4f")]
    assert config_changes(ev, 4, None) == []  # no tokens_served and no way to place them


def test_config_changes_prefers_logged_fields():
    ev = [{"event": "swap", "layer": 0, "to_precision": "int4", "config": "4f", "tokens_served": 5},
          {"event": "restore", "layer": 0, "to_precision": "full", "config": "ff", "tokens_served": 9}]
    assert config_changes(ev, 2) == [(5, "4f"), (9, "ff")]


def test_morph_summary_from_events_and_timeline():
    ev = parse_morph_events(LOG)
    tl = [{"t": 0.0, "quantized_layers": 0, "kv_capacity_tokens": 84 * 16},
          {"t": 2.0, "quantized_layers": 2, "kv_capacity_tokens": 108 * 16},
          {"t": 4.0, "quantized_layers": 1, "kv_capacity_tokens": 100 * 16}]
    final = {"swaps": 2, "restores": 1, "quantized_layers": 1, "kv_capacity_tokens": 100 * 16}
    m = morph_summary(ev, tl, final, num_layers=4, duration_s=4.0, block_size=16)
    assert (m["swaps"], m["restores"], m["final_quantized_layers"]) == (2, 1, 1)
    assert m["kv_capacity_tokens"] == {"base": 84 * 16, "max": 108 * 16}
    assert m["max_quantized_layers"] == 2
    assert m["time_weighted_quantized_share"] == pytest.approx((0 + 2 / 4 * 2) / 4)
    assert m["mean_swap_ms"] == {"full->int4": 10.0, "full->int8": 20.0, "int8->full": 30.0}


# --------------------------------------------------------------------------------------------------
# Prompts, failures, plots
# --------------------------------------------------------------------------------------------------


def test_prompt_text_matches_requested_length(smollm):
    import random

    from workload.items import PromptBuilder, default_text_path

    b = PromptBuilder(smollm.tokenizer, default_text_path().read_text(encoding="utf-8"))
    rng = random.Random(0)
    diffs = []
    for n in (16, 64, 200):
        for _ in range(5):
            ids = b.prompt(n, rng)
            text, sent = prompt_text(smollm.tokenizer, ids)
            assert sent == len(smollm.tokenizer.encode(text))
            diffs.append(sent - n)
    assert max(abs(d) for d in diffs) <= 2


def _args(**kw):
    base = dict(slo_ttft_s=2.0, slo_tpot=None, engine_dir="smollm2-135m", device_memory="600MiB")
    base.update(kw)
    return argparse.Namespace(**base)


def test_run_request_against_nothing_fails_fast_without_raising():
    from serve.triton.server import free_port

    rec = RequestRecord(PreparedRequest(0, "request", 0.0, "hello", 4, 1, 1))
    import time

    rec.send_s = time.perf_counter()
    run_request(f"127.0.0.1:{free_port()}", "morphserve", rec, timeout_s=10.0)
    assert not rec.ok and rec.error and rec.end_s is not None
    assert rec.end_s - rec.send_s < 10.0
    # a mode whose server never started still produces the replay fields, all requests failed
    r = assemble_result("off", "test", [rec], {"status": "error", "error": rec.error}, _args(), 4, 16, {})
    assert (r["num_requests"], r["completed"], r["failed"]) == (1, 0, 1)
    assert r["slo"]["violation_rate"] == 1.0 and r["status"] == "error"


def test_plots_from_synthetic_results(tmp_path):
    from workload.plots import make_plots

    tl = [{"t": t, "waiting": t % 3, "running": 2, "quantized_layers": t, "kv_capacity_tokens": 100 + 10 * t,
           "kv_used_tokens": 50} for t in range(5)]
    res = {
        "off": {"requests": [{"arrival_s": 0.1, "ok": True, "ttft_s": 0.5}, {"arrival_s": 1.2, "ok": False}],
                "timeline": tl, "ttft_s": {"p95": 3.0}, "quality": {"ppl_loss_pct": 0.0}},
        "default": {"requests": [{"arrival_s": 0.1, "ok": True, "ttft_s": 0.2}], "timeline": tl,
                    "ttft_s": {"p95": 1.0}, "quality": {"ppl_loss_pct": 2.0,
                                                         "probe_agreement": {"positional_match_rate": 0.9}}},
    }
    paths = make_plots(res, tmp_path, slo_ttft_s=2.0)
    names = sorted(Path(p).name for p in paths)
    assert names == ["p95_ttft_vs_quality.png", "timeline_default.png", "timeline_off.png", "ttft_cdf.png"]
    assert all(Path(p).stat().st_size > 1000 for p in paths)


# --------------------------------------------------------------------------------------------------
# End to end against a real tritonserver
# --------------------------------------------------------------------------------------------------

REPLAY_FIELDS = ("mode", "trace", "num_requests", "completed", "failed", "duration_s", "ttft_s", "tpot_s", "itl_s",
                 "e2el_s", "slo", "goodput_rps", "output_tok_s", "morph", "timeline")


def _require_triton() -> None:
    """Skip where tritonserver is missing (fail under CI=true); any other error is the test's failure, not a skip."""
    from tests.triton_support import skip_module_without_triton

    skip_module_without_triton()


@pytest.mark.slow
@pytest.mark.e2e
def test_bench_smoke_off_mode(tmp_path):
    _require_triton()
    from bench.triton.__main__ import main

    out = tmp_path / "bench"
    rc = main(["--modes", "off", "--num-requests", "4", "--request-rate", "8", "--input-len", "32",
               "--output-len", "4", "--server-threads", "1", "--output-dir", str(out), "--num-probes", "2",
               "--probe-output-len", "4", "--ppl-tokens", "128", "--ppl-window", "64", "--quality-threads", "1",
               "--request-timeout", "60", "--engine-dir", "smollm2-135m", "--max-model-len", "512", "--quiet"])
    assert rc == 0
    r = json.loads((out / "off.json").read_text())
    for k in REPLAY_FIELDS:
        assert k in r, k
    assert (r["status"], r["num_requests"], r["completed"], r["failed"]) == ("ok", 4, 4, 0)
    assert r["ttft_s"]["p95"] > 0 and r["output_tok_s"] > 0
    assert all(q["output_tokens"] == 4 for q in r["requests"])
    assert r["tokens_by_config"] == {"f" * 30: r["generation_tokens"]["end"] - r["generation_tokens"]["start"]}
    assert r["morph"]["swaps"] == 0 and r["timeline"]
    q = r["quality"]
    assert q["ppl"] == pytest.approx(q["ppl_full"]) and q["ppl_loss_pct"] == pytest.approx(0.0)
    assert q["probe_agreement"]["probes"] == 2
    assert (out / "results.md").is_file() and (out / "results.json").is_file()
    assert (out / "ttft_cdf.png").is_file() and (out / "server-off.log").is_file()


@pytest.mark.slow
@pytest.mark.e2e
def test_bench_writes_json_when_the_server_fails(tmp_path):
    _require_triton()
    from bench.triton.__main__ import main

    out = tmp_path / "bench"
    # 100 MiB cannot hold the model's weights: the server exits during model load.
    rc = main(["--modes", "off", "--num-requests", "3", "--output-dir", str(out), "--device-memory", "100MiB",
               "--engine-dir", "smollm2-135m", "--no-quality", "--no-plots", "--num-probes", "0",
               "--server-start-timeout", "60", "--quiet"])
    assert rc == 1
    r = json.loads((out / "off.json").read_text())
    assert r["status"] == "error" and r["error"]  # the model cannot load: no room for the KV cache
    assert (r["num_requests"], r["completed"], r["failed"]) == (3, 0, 3)
    assert r["slo"]["violation_rate"] == 1.0


def test_qactivations_quality_switches_the_setting_per_side_and_restores_it(monkeypatch, capsys):
    """measure() evaluates every signature once under fp32 and once under int8 activations (the setting the
    quantized layers read per call), clears the evaluator's per-signature memo between sides, and restores
    the environment; the table's change column is int8 over fp32; windows above SMALL_BATCH are refused."""
    class Evaluator:  # records which setting each evaluation saw, as the real layers would read it
        def __init__(self) -> None:
            self._nll: dict[str, float] = {"stale": 1.0}
            self.seen: list[tuple[str, bool, int]] = []

        def forget(self) -> None:
            self._nll.clear()

        def perplexity(self, sig: str) -> float:
            self.seen.append((sig, kernels.int8_activations(), len(self._nll)))
            self._nll[sig] = 0.0
            return 100.0 + (1.0 if kernels.int8_activations() else 0.0)

    monkeypatch.setenv("MORPHSERVE_QACTIVATIONS", "fp32")
    ev = Evaluator()
    out = qaq.measure(ev, {"a": "ff", "b": "44"})
    assert ev.seen == [("ff", False, 0), ("44", False, 1), ("ff", True, 0), ("44", True, 1)]
    assert out == {"fp32": {"a": 100.0, "b": 100.0}, "int8": {"a": 101.0, "b": 101.0}}
    assert os.environ["MORPHSERVE_QACTIVATIONS"] == "fp32"
    assert "| a | 100.000 | 101.000 | +1.00 % |" in qaq.to_markdown({"ppl": out})
    with pytest.raises(SystemExit):
        qaq.main(["--window", "64"])
    assert "--window must be 2..32" in capsys.readouterr().err


def test_bench_peer_speculation_rows_draft_and_compare_outputs_with_off(tiny_dir, capsys):
    """The speculation rows (no peers): off, always and auto on one model at batch 1; always drafts, its greedy
    output is compared with off's, and the table puts each beside off, llama.cpp and vLLM."""
    from bench import peer

    wl = {"b1": {"prompts": [[300 + j for j in range(12)]], "max_tokens": [8]},
          "b3": {"prompts": [[300 + j for j in range(12 + i)] for i in range(3)], "max_tokens": [6, 7, 8]}}
    rows = peer.speculation_rows(lambda spec: peer.make_engine("off", 1, str(tiny_dir), spec), wl, 1,
                                 ["always", "auto"])
    assert list(rows) == ["off", "always", "auto"]
    # the batched workload runs with off and auto (auto must not slow a full batch), not with always
    assert list(rows["off"]["batched_tok_s"]) == ["b3"] and list(rows["auto"]["batched_tok_s"]) == ["b3"]
    assert rows["always"]["batched_tok_s"] == {}
    assert not rows["off"]["built"] and rows["off"]["draft_tokens"] == 0
    assert rows["always"]["built"] and rows["always"]["draft_tokens"] > 0  # speculation always drafted
    assert rows["always"]["differing_outputs"] == 0 and rows["always"]["outputs"] == 1
    assert all(len(r["tok_s"]) == 1 and r["tok_s"][0] > 0 for r in rows.values())
    rows["auto"]["differing_outputs"] = 1  # how a flipped near-tie is shown
    r = {"ours_speculation": rows, "speculation_model": "tiny", "llamacpp": [10.0], "vllm": {"b1": {"cold": [5.0]}}}
    table = "\n".join(peer.speculation_markdown(r, "b1"))
    assert "| speculation off |" in table and "| 1.00x |" in table and "| reference |" in table
    assert "| speculation always |" in table and "| yes |" in table and "no: 1 of 1 differ" in table
    assert f"{rows['always']['tok_s'][0] / 10.0:.2f}x | {rows['always']['tok_s'][0] / 5.0:.2f}x" in table
    auto_b3, off_b3 = rows["auto"]["batched_tok_s"]["b3"][0], rows["off"]["batched_tok_s"]["b3"][0]
    assert f"| b3 | {off_b3:.1f} | {auto_b3:.1f} | {auto_b3 / off_b3:.2f}x |" in table
    with pytest.raises(SystemExit):
        peer.main(["--speculation-modes", "sometimes"])
    assert "--speculation-modes takes always and/or auto" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        peer.main(["--speculation-model", "/no/such/engine"])
    assert "make build-engines" in capsys.readouterr().err


def test_bench_peer_without_peers_prints_the_speculation_rows(tiny_dir, tmp_path, monkeypatch, capsys):
    """The whole command without peers on tiny workloads: the speculation rows run on --speculation-model."""
    from bench import peer

    tiny_workloads = {"b1": {"prompts": [[300 + j for j in range(12)]], "max_tokens": [6]},
                      "two": {"prompts": [[400 + j for j in range(8)]] * 2, "max_tokens": [4, 4]}}
    monkeypatch.setattr(peer, "workloads", lambda vocab, seed=0: tiny_workloads)
    out = tmp_path / "peer.json"
    assert peer.main(["--model", str(tiny_dir), "--speculation-model", str(tiny_dir), "--runs", "1", "--warm-runs",
                      "0", "--quantized-modes", "", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (list(result["ours_speculation"]) == ["off", "always", "auto"]
            and result["speculation_model"] == str(tiny_dir))
    assert result["ours_speculation"]["always"]["draft_tokens"] > 0
    assert "| speculation always |" in capsys.readouterr().out


def test_bench_peer_cold_runs_reset_the_prefix_cache_and_warm_runs_reuse_it(tiny):
    from bench import peer
    from serve.config import EngineConfig
    from serve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(num_kv_blocks=64), loaded=tiny)
    wl = {"w": {"prompts": [[300 + j for j in range(40)]], "max_tokens": [4]}}
    out = peer.ours(engine, wl, runs=2, warm_runs=1)
    assert [len(out["w"][k]) for k in ("cold", "warm")] == [2, 1]
    # the cold runs found nothing (reset before each); the warm one reused both full blocks before the last token
    assert engine.stats().prefix_cache_hits == 32
    r = {"ours_fp32": out, "vllm": {"w": {"cold": [10.0], "warm": [20.0]}, "startup_s": 100.0}, "ours_quantized": {},
         "ours_startup_s": 1.0,
         "bound": {"gemv_read_gbs": 10.0, "weight_bytes_per_token": 1e6, "bound_tok_s": 1e4}}
    table = peer.to_markdown(r)
    # one run: the value (workload.repeats.cell)
    assert "| w | cold |" in table and "| w | warm |" in table and "| 10.0 |" in table
