"""Smoke checks of the bench tools that talk to a real tritonserver (docs/bench-tools.md): http_front_cost,
http_door_checks, triton_overhead and memory_yield_demo's pieces, against one small server for the module (the
embedded model, mode default, the operator's yield control armed), each with a handful of requests. What is checked
is what each tool reports; timings only have to exist."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.e2e

pytest.importorskip("tritonclient.grpc")

from serve.config import EMBEDDED_MODEL, EngineConfig  # noqa: E402
from serve.triton.server import TritonServer  # noqa: E402
from tests.triton_support import running_server, skip_module_without_triton  # noqa: E402

skip_module_without_triton()

PARAMS = {"engine_dir": EMBEDDED_MODEL, "morph_mode": "default", "max_model_len": 256, "device_memory": "700MiB",
          "num_threads": 1, "memory_floor": "0", "queue_timeout_s": 0, "max_tokens_limit": 64}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with running_server(PARAMS, tmp_path_factory.mktemp("bench-tools")) as srv:
        yield srv


def test_http_front_cost_measures_both_front_ends_refusals_and_a_flood(server: TritonServer) -> None:
    from bench import http_front_cost

    args = argparse.Namespace(requests=2, stream_requests=1, stream_tokens=4)
    out = http_front_cost.measure(args, server.http_port, server.triton_http_port, server.front_ends.triton_grpc_port)
    assert set(out["generate_p50_ms"]) == {"front", "direct", "grpc_direct"}
    assert all(v > 0 for v in out["generate_p50_ms"].values())
    assert all(v >= 0 for v in out["stream_itl_p50_ms"].values())  # gaps between 4 streamed tokens (nan: none)
    assert set(out["refusal_p50_ms"]) == {"deep_78KB_400", "over_limit_413", "type_error_400", "65_stops_of_4KB"}
    assert out["flood"]["refused_requests_sent"] >= 1 and out["flood"]["p50_ms_flooded"] > 0


def test_http_door_checks_refuse_bad_bodies_and_answer_ordinary_requests(server: TritonServer) -> None:
    from bench import http_door_checks as checks

    url = server.http_url
    deep = checks.deep_bodies(url, None)
    assert deep["all_4xx"] and len(deep["refused"]) == 8 and deep["ordinary_answers"] == [32] * 4
    assert all(400 <= t["status"] < 500 for t in checks.typed(url))
    assert 400 <= checks.timeout(url)["status"] < 600  # past its timeout_s: refused, never answered
    load = checks.load(url, 2, 4, 2)
    assert load["outcomes"] == {"answer": 2} and load["with_first_event"] == 2
    assert 0 < load["first_event_p50_s"] <= load["first_event_p95_s"] <= load["first_event_max_s"]


def test_triton_overhead_times_every_path(server: TritonServer) -> None:
    from bench import triton_overhead
    from serve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(num_threads=1, num_kv_blocks=64, max_model_len=256))
    engine.start_background()
    try:
        rows = triton_overhead.measure(server.grpc_url, engine, 1, 2)
    finally:
        engine.shutdown()
    assert set(rows) == set(triton_overhead.PATHS)
    assert all(len(v) == 1 and 0 < v[0][0] <= v[0][1] for v in rows.values())
    table = triton_overhead.to_markdown(rows)
    assert ("| overhead of the Triton path |" in table
            and "| overhead of the BLS hop (ensemble vs morphserve) |" in table)


def _wait(server: TritonServer, pgid: int, t0: float, test, timeout_s: float = 120.0) -> dict:
    from bench.memory_yield_demo import sample

    end = time.monotonic() + timeout_s
    while True:
        s = sample(server, pgid, t0)
        if test(s) or time.monotonic() > end:
            return s
        time.sleep(0.5)


def test_memory_yield_demo_yields_and_reclaims_through_the_operator_control(server: TritonServer) -> None:
    """The demo's first phase (the operator's yield, then reclaim) and its samples, without the second process."""
    from bench.memory_yield_demo import control, summarize

    assert server.proc is not None
    pgid, t0 = os.getpgid(server.proc.pid), time.monotonic()
    before = _wait(server, pgid, t0, lambda s: True)
    assert before["yielded_mib"] == 0 and before["kv_blocks_total"] > 0 and before["server_rss_mib"] > 0
    control(server, "yield 8MiB")
    held = _wait(server, pgid, t0, lambda s: s["yielded_mib"] >= 8)
    assert held["yielded_mib"] >= 8 and held["layers_quantized"] >= 1
    control(server, "reclaim")
    back = _wait(server, pgid, t0, lambda s: s["yielded_mib"] == 0)
    assert back["yielded_mib"] == 0 and back["layers_quantized"] == 0
    timeline = [{**before, "t_s": 0.0}, {**held, "t_s": 1.0}, {**back, "t_s": 2.0}, {**back, "t_s": 3.0}]
    events = [{"t_s": 0.5, "event": "manual_yield"}, {"t_s": 1.5, "event": "manual_reclaim"},
              {"t_s": 2.0, "event": "manual_done"}, {"t_s": 2.5, "event": "second_process_allocates"},
              {"t_s": 2.8, "event": "second_process_exited"}]
    summary = summarize(timeline, events, {"ok": 3, "failed": 0}, "")
    assert summary["manual_yielded_mib"] == held["yielded_mib"] and summary["manual_seconds_to_reclaim"] == 0.5
    assert summary["yielded_max_mib"] == held["yielded_mib"] and summary["reclaimed"] is True


def test_reliability_probe_rows_report_what_was_sent_and_what_came_back(server: TritonServer) -> None:
    """bench.reliability_probe's cheap rows against the module's server (the probe itself starts its own launcher):
    each row says what was sent and what came back, and every one holds on this code."""
    from bench import reliability_held as held
    from bench import reliability_probe as probe
    from bench.reliability_common import Target

    assert server.operator_port is not None
    t = Target(server.http_url, server.grpc_url, f"127.0.0.1:{server.metrics_port}", server.operator_port, os.getpid())
    rows = {"4": probe.f4_apis(t), "5": probe.f5_client_errors(t), "6": probe.f6_aliases(t), "8": probe.f8_cache(t, 50),
            "typed": held.typed(t), "sampling": held.sampling(t), "grpc-tensors": held.grpc_tensors(t),
            "fuzz": held.fuzz(t, 30)}
    assert {k: (r["held"], r["got"]) for k, r in rows.items() if not r["held"]} == {}
    assert all(r["sent"] and r["got"] for r in rows.values())
    assert rows["8"]["got"].startswith("statuses {400: 50}") and "21/21 answered 400" in rows["typed"]["got"]
    assert "25/25 refused" in rows["grpc-tensors"]["got"] and "30 mutated" in rows["fuzz"]["sent"]
