"""Hardening without a server: sampling-value validation, Triton input limits, engine fault isolation,
health, admission that does not wait for a forward, the bounded waiting queue, launcher flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serve.config import EngineConfig
from serve.engine.admission import EngineOverloaded
from serve.engine.engine import LLMEngine
from serve.engine.outputs import FinishReason
from serve.engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from serve.triton.request_inputs import InputError, InputLimits, parse_request

# ---- SamplingParams: the one place sampling values are validated ---------------------------------

def test_tiny_temperature_is_greedy_not_a_crash():
    assert SamplingParams(temperature=1e-40).temperature == 0.0
    assert SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5


@pytest.mark.parametrize("kwargs, match", [
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "at most"),
    ({"stop": ["y" * (MAX_STOP_STRING_CHARS + 1)]}, "at most"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": True}, "top_p"),
    ({"max_tokens": 4.0}, "max_tokens"),
])
def test_sampling_limits(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


# ---- request_inputs: bounds checked before decoding ------------------------------------------------

def _getter(**arrays):
    return lambda name: arrays.get(name)


def _text(s: bytes) -> np.ndarray:
    return np.array([s], dtype=np.object_)


@pytest.mark.parametrize("arrays, match", [
    ({"text_input": _text(b"a" * 2000)}, "at most 1000"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one string"),
    ({"text_input": _text(b"a"), "stop": np.array([b"s"] * 5, dtype=np.object_)}, "at most 4 items"),
    ({"text_input": _text(b"a"), "stop": np.array([b"s" * 100], dtype=np.object_)}, "at most 64 bytes"),
    ({"text_input": _text(b"a"), "timeout_s": np.array([0.0], dtype=np.float32)}, "timeout_s"),
    ({"text_input": _text(b"a"), "timeout_s": np.array([np.nan], dtype=np.float32)}, "timeout_s"),
    ({"text_input": _text(b"a"), "max_tokens": np.array([4, 5], dtype=np.int32)}, "exactly one"),
])
def test_input_limits(arrays, match):
    limits = InputLimits(max_prompt_bytes=1000, max_list_items=4, max_item_bytes=64)
    with pytest.raises(InputError, match=match):
        parse_request(_getter(**arrays), 64, 16, limits=limits)


def test_timeout_parsed():
    r = parse_request(_getter(text_input=_text(b"hi"), timeout_s=np.array([2.5], dtype=np.float32)), 64, 16)
    assert r.timeout_s == 2.5 and parse_request(_getter(text_input=_text(b"hi")), 64, 16).timeout_s is None


# ---- engine: faults fail only their requests, health, admission --------------------------------

@pytest.fixture()
def engine(tiny):
    e = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=4, max_model_len=256, max_num_seqs=4,
                               max_num_waiting=3), loaded=tiny)
    yield e
    e.stop()


def _collect(results):
    def cb(out):
        r = results.setdefault(out.request_id, {"n": 0})
        r["n"] += len(out.new_token_ids)
        if out.finished:
            r["reason"], r["error"] = out.finish_reason, out.error
    return cb


def _run(e, results, rids, limit=500):
    for _ in range(limit):
        if all("reason" in results.get(r, {}) for r in rids):
            return
        e.step()
    raise AssertionError(f"requests did not finish: {results}")


@pytest.fixture()
def log_lines():
    import io
    import sys

    from serve.logging_setup import configure_logging

    buf = io.StringIO()
    configure_logging("info", stream=buf, force=True)
    yield buf
    configure_logging("info", stream=sys.stderr, force=True)


def test_failed_forward_fails_only_its_batch_and_is_logged(engine, log_lines):
    e, results = engine, {}
    a = e.add_request("one two", SamplingParams(max_tokens=4, ignore_eos=True), callback=_collect(results))
    real = e.executor.execute
    calls = {"n": 0}

    def boom(chunks):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return real(chunks)

    e.executor.execute = boom
    e.step()  # batch = [a] fails
    b = e.add_request("three four", SamplingParams(max_tokens=4, ignore_eos=True), callback=_collect(results))
    _run(e, results, [a, b])
    assert results[a]["reason"] is FinishReason.ERROR and "injected forward failure" in results[a]["error"]
    assert results[b]["reason"] is FinishReason.LENGTH and results[b]["n"] == 4
    assert e.healthy and e.pool.num_used == 0
    events = [json.loads(line) for line in log_lines.getvalue().splitlines() if line.startswith("{")]
    faults = [ev for ev in events if ev["event"] == "engine_fault"]
    assert len(faults) == 1 and faults[0]["request_ids"] == [a] and faults[0]["where"] == "forward"
    assert "Traceback" in faults[0]["traceback"] and "injected forward failure" in faults[0]["traceback"]


def test_sampler_failure_of_one_row_spares_the_others(engine, monkeypatch):
    e, results = engine, {}
    from serve.engine import sampler as sampler_mod

    real = sampler_mod.sample_with_logprobs

    def picky(logits, params, gens, default, contexts):
        if any(p.top_k == 7 for p in params):
            raise RuntimeError("bad row")
        return real(logits, params, gens, default, contexts)

    monkeypatch.setattr(sampler_mod, "sample_with_logprobs", picky)
    bad = e.add_request("x y", SamplingParams(max_tokens=3, temperature=0.7, top_k=7), callback=_collect(results))
    good = [e.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True), callback=_collect(results))
            for p in ("a b", "c d")]
    _run(e, results, [bad, *good])
    assert results[bad]["reason"] is FinishReason.ERROR
    assert all(results[g]["reason"] is FinishReason.LENGTH and results[g]["n"] == 3 for g in good)
    assert e.healthy and e.faults.failed_iterations == 0


def test_repeated_failed_iterations_make_the_engine_unhealthy(engine):
    e, results = engine, {}

    def boom(chunks):
        raise RuntimeError("device lost")

    e.executor.execute = boom
    for i in range(e.faults.max_consecutive):
        assert e.healthy
        rid = e.add_request(f"p {i}", SamplingParams(max_tokens=2), callback=_collect(results))
        e.step()
        assert results[rid]["reason"] is FinishReason.ERROR
    assert not e.healthy and "device lost" in e.faults.last_error
    assert e.stats().healthy is False


def test_temperature_underflow_does_not_fail_the_batch(engine):
    e, results = engine, {}
    rids = [e.add_request("hello there", SamplingParams(max_tokens=3, temperature=t, ignore_eos=True),
                          callback=_collect(results)) for t in (1e-40, 0.0, 0.8)]
    _run(e, results, rids)
    assert all(results[r]["reason"] is FinishReason.LENGTH for r in rids)


def test_admission_does_not_wait_for_the_engine_lock_and_is_bounded(engine):
    e = engine
    entered, release = threading.Event(), threading.Event()

    def hold():
        with e._lock:  # what a long forward does
            entered.set()
            release.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    entered.wait(10)
    try:
        t0 = time.monotonic()
        rids = [e.add_request(f"w {i}", SamplingParams(max_tokens=2)) for i in range(3)]
        assert time.monotonic() - t0 < 5.0, "add_request waited for the engine lock"
        assert e.num_waiting() == 3
        with pytest.raises(EngineOverloaded, match="retry later"):
            e.add_request("one too many", SamplingParams(max_tokens=2))
    finally:
        release.set()
        t.join()
    assert e.stats().num_waiting == 3
    for r in rids:
        assert e.abort_request(r)
    assert e.num_waiting() == 0 and e.pool.num_used == 0


def test_background_loop_serves_handed_over_requests(engine):
    e, results, done = engine, {}, threading.Event()
    cb = _collect(results)

    def on_out(out):
        cb(out)
        if out.finished:
            done.set()

    e.start_background()
    rid = e.add_request("hi", SamplingParams(max_tokens=3, ignore_eos=True), callback=on_out)
    assert done.wait(60) and results[rid]["n"] == 3


EXIT_WHILE_GENERATING = """
import threading
from serve.config import EngineConfig
from serve.engine import LLMEngine, SamplingParams
engine = LLMEngine(EngineConfig(model="smollm2-135m", num_threads=2))
engine.start_background()
first = threading.Event()
def on_out(out):
    first.set()
    if out.finished:
        print("long request:", out.finish_reason.value, flush=True)
engine.add_request("Tell me a long story", SamplingParams(max_tokens=2000, ignore_eos=True), callback=on_out)
assert first.wait(120)
print("main thread returns", flush=True)
"""


@pytest.mark.slow
def test_a_process_that_exits_while_the_engine_generates_exits_cleanly():
    """The loop is a daemon thread. Left running at exit, it used to be ended inside a torch op, and the process
    aborted ("terminate called without an active exception"). Now the loop is stopped at exit: it finishes its
    step, and the request in flight is aborted and told so."""
    out = subprocess.run([sys.executable, "-c", EXIT_WHILE_GENERATING], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["main thread returns", "long request: abort"], out.stderr[-2000:]


# ---- engine directory manifest -------------------------------------------------------------------

def test_manifest_garbage_and_non_ascii_are_clear(tmp_path: Path):
    from serve.model.engine_dir import EngineDirError, read_manifest

    (tmp_path / "manifest.json").write_bytes(b"\xff\xfe garbage \x80")
    with pytest.raises(EngineDirError, match="unreadable manifest"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format_version": -1, "note": "caf\u00e9"}', encoding="utf-8")
    # Inside tritonserver the stub ran with an ASCII locale: read the manifest there too.
    code = ("from serve.model.engine_dir import read_manifest, EngineDirError\n"
            f"try: read_manifest({str(tmp_path)!r})\nexcept EngineDirError as e: print(e)")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert "format_version -1" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_corrupt_variant_file_is_refused(tmp_path: Path):
    from serve.model.engine_dir import EngineDir, EngineDirError, sha256_file

    f = tmp_path / "layer_000.int8.safetensors"
    f.write_bytes(b"\x00" * 64)
    rec = {"file": f.name, "bytes": 64, "sha256": sha256_file(f)}
    ed = EngineDir(tmp_path, {"layers": [{"variants": {"int8": rec}}]}, loaded=None)  # type: ignore[arg-type]
    f.write_bytes(b"\x00" * 63 + b"\x01")  # same size, one byte flipped
    with pytest.raises(EngineDirError, match="sha256 checksum mismatch"):
        ed.layer_variant(0, "int8")


# ---- launcher ----------------------------------------------------------------------------------

def test_launcher_closes_the_repository_api_by_default(tmp_path: Path):
    from serve.triton.install import TritonInstall
    from serve.triton.server import TritonServer

    inst = TritonInstall(tmp_path, tmp_path / "bin", tmp_path, tmp_path, tmp_path)
    cmd = TritonServer(workdir=tmp_path).command(inst, tmp_path, tmp_path)
    assert "--model-control-mode=none" in cmd and not any(c.startswith("--load-model") for c in cmd)
    closed = "shared-memory,logging,trace,model-repository:"  # tritonserver's own ports too (finding 4)
    assert any(c.startswith(f"--http-restricted-api={closed}") for c in cmd)
    assert any(c.startswith(f"--grpc-restricted-protocol={closed}") for c in cmd)
    assert all("0.0.0.0" not in c for c in cmd)
    opened = TritonServer(workdir=tmp_path, repository_api=True,
                          client_apis=["shared-memory"]).command(inst, tmp_path, tmp_path)
    assert "--model-control-mode=explicit" in opened
    assert any(c.startswith("--http-restricted-api=logging,trace:") for c in opened)


def test_busy_ports_fail_before_starting(tmp_path: Path):
    import socket

    from serve.triton.install import TritonLaunchError
    from serve.triton.server import TritonServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        srv = TritonServer(http_port=port, workdir=tmp_path)
        with pytest.raises(TritonLaunchError, match="already in use"):
            srv.start()
        assert srv.proc is None


class _FakeProc:
    def __init__(self) -> None:
        self.rc: int | None = None

    def poll(self) -> int | None:
        return self.rc


class _FakeServer:
    """Stands in for TritonServer in the supervisor's restart logic (start/stop/ready bookkeeping only)."""

    def __init__(self, die_after_start: int, rc: int = -11, on_start: Any = None) -> None:
        self.proc: _FakeProc | None = _FakeProc()
        self.starts = self.stops = 0
        self.die_after_start = die_after_start
        self.rc = rc
        self.on_start = on_start
        self.ready_after_s = 0.0
        self.log_path = "server.log"

    def start(self) -> None:
        self.starts += 1
        self.proc = _FakeProc()
        if self.starts <= self.die_after_start:
            self.proc.rc = self.rc
        if self.on_start is not None:
            self.on_start(self)

    def wait_ready(self, timeout: float) -> float:
        from serve.triton.install import TritonLaunchError

        if self.proc is not None and self.proc.rc is not None:
            raise TritonLaunchError("exited before becoming ready")
        return 0.0

    def stop(self, keep_front: bool = False) -> None:
        assert keep_front, "the supervisor keeps the HTTP front between restarts"
        self.stops += 1
        if self.proc is not None and self.proc.rc is None:
            self.proc.rc = 0

    def log_tail(self, n: int = 10) -> str:
        return ""


def test_supervisor_restarts_a_dead_server_and_gives_up_after_bounded_retries():
    from serve.triton.supervisor import EXIT_GAVE_UP, RestartPolicy, supervise

    srv = _FakeServer(die_after_start=10)
    srv.proc.rc = -11  # crashed
    policy = RestartPolicy(max_restarts=3, backoff_s=0.01, health_every_s=0)
    reasons: list[str] = []
    assert supervise(srv, policy, threading.Event(), poll_s=0.01, on_give_up=reasons.append) == EXIT_GAVE_UP
    assert srv.starts == 3  # bounded
    assert len(reasons) == 1 and "died 4 times within 600 s" in reasons[0] and "exit code -11" in reasons[0]

    srv = _FakeServer(die_after_start=0)
    srv.proc.rc = -11
    stop, restarted = threading.Event(), []
    supervise(srv, policy, stop, on_ready=lambda s, n: (restarted.append(n), stop.set()), poll_s=0.01)
    assert restarted == [1] and srv.starts == 1


def test_supervisor_restarts_an_unhealthy_engine():
    from serve.triton.supervisor import RestartPolicy, supervise

    srv, stop, verdicts = _FakeServer(die_after_start=0), threading.Event(), iter([True, False])
    supervise(srv, RestartPolicy(backoff_s=0.01, health_every_s=0.01), stop,
              on_ready=lambda s, n: stop.set(), poll_s=0.01, healthy=lambda s: next(verdicts, True))
    assert srv.stops >= 1 and srv.starts == 1


def test_supervisor_restarts_a_server_killed_during_its_first_load():
    from serve.triton.supervisor import RestartPolicy, supervise

    srv, stop, seen = _FakeServer(die_after_start=1), threading.Event(), []
    srv.start()  # killed (SIGSEGV / OOM killer) before it was ever ready
    supervise(srv, RestartPolicy(backoff_s=0.01, health_every_s=0), stop, ready=False, poll_s=0.01,
              on_ready=lambda s, n: (seen.append(n), stop.set()))
    assert seen == [1] and srv.starts == 2


def test_supervisor_does_not_restart_a_first_load_that_exits_with_an_error():
    from serve.triton.install import TritonLaunchError
    from serve.triton.supervisor import RestartPolicy, supervise

    srv = _FakeServer(die_after_start=1, rc=1)  # e.g. a bad model configuration: restarting cannot help
    srv.start()
    with pytest.raises(TritonLaunchError):
        supervise(srv, RestartPolicy(backoff_s=0.01, health_every_s=0), threading.Event(), ready=False)
    assert srv.starts == 1


def test_supervisor_budget_is_a_rate_over_a_window():
    from serve.triton.supervisor import RestartPolicy, supervise

    stop = threading.Event()
    srv = _FakeServer(die_after_start=100, on_start=lambda s: s.starts >= 6 and stop.set())
    srv.proc.rc = -11
    # 2 restarts per 1 ms, one every >= 10 ms: never more than one in the window, so it never gives up.
    policy = RestartPolicy(max_restarts=2, window_s=0.001, backoff_s=0.01, max_backoff_s=0.01, health_every_s=0)
    assert supervise(srv, policy, stop, poll_s=0.01) == 0 and srv.starts == 6


def test_lifecycle_parameters_reach_the_engine_config():
    """queue_timeout_s, shed_on_arrival and request_timeout_s are EngineConfig fields (the engine decides them):
    config.pbtxt's values reach it, bad ones fail the load naming the parameter; the model's own knob is the
    operator port."""
    from serve.config import EngineConfig
    from serve.triton.model_params import ServerParams, engine_config_kwargs, validate_params

    kwargs, _ = engine_config_kwargs({"queue_timeout_s": "30", "shed_on_arrival": "false", "request_timeout_s": "9"},
                                     EngineConfig, Path.cwd())
    config = EngineConfig(**kwargs)
    assert (config.queue_timeout_s, config.shed_on_arrival, config.request_timeout_s) == (30.0, False, 9.0)
    assert EngineConfig().queue_timeout_s == 0.0  # offline replays: no queue deadline unless asked for
    for key, bad in (("queue_timeout_s", "-1"), ("queue_timeout_s", "inf"), ("queue_timeout_s", "soon"),
                     ("request_timeout_s", "0"), ("shed_on_arrival", "maybe")):
        with pytest.raises(ValueError, match=key):
            validate_params({"engine_dir": "x", key: bad})
    assert ServerParams.from_params({"operator_port": "8003"}, default_max_tokens=16).operator_port == 8003
    with pytest.raises(ValueError, match="operator_port"):
        ServerParams.from_params({"operator_port": "70000"}, default_max_tokens=16)
