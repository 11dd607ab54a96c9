"""The request lifecycle in the engine (serve/engine/lifecycle.py): the queue deadline, the request deadline,
shedding on arrival, the admission bound, draining, cancellation and failures, each answered with its ErrorKind
(serve/engine/errors.py) on a virtual clock, with exact tokens and KV blocks; and the operator's controls
(serve/engine/controls.py) on a real engine."""

from __future__ import annotations

import math

import pytest

from serve.config import EngineConfig
from serve.engine.controls import ControlError, run_control
from serve.engine.engine import LLMEngine
from serve.engine.errors import (
    DeadlineExceeded,
    EngineDraining,
    EngineOverloaded,
    EngineUnavailable,
    InvalidRequest,
    error_kind,
    retry_after_of,
)
from serve.engine.outputs import OutputCollector
from serve.engine.sampling_params import SamplingParams
from serve.error_kinds import ErrorKind


class StepClock:
    """A clock the test advances."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(tiny, clock: StepClock, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=64, block_size=4, max_model_len=256, **config), loaded=tiny,
                     clock=clock)


def run(engine: LLMEngine, clock: StepClock, collect: OutputCollector, rids: list[str], step_s: float = 1.0,
        limit: int = 200) -> None:
    """Step until every request in ``rids`` finished; each step takes ``step_s`` of the clock."""
    for _ in range(limit):
        if all(collect.finished(r) for r in rids):
            return
        engine.step()
        clock.t += step_s
    raise AssertionError(f"not finished: {collect.results}")


LONG = SamplingParams(max_tokens=10, ignore_eos=True)


def test_the_queue_deadline_sheds_a_request_that_got_no_token(tiny) -> None:
    clock, collect = StepClock(), OutputCollector()
    e = make(tiny, clock, max_num_seqs=1, queue_timeout_s=3.0)
    first = e.add_request([1, 2, 3], LONG, callback=collect)
    late = e.add_request([4, 5, 6], LONG, callback=collect)     # behind it: one slot
    ended: list = []
    e.add_request([7, 8, 9], LONG, callback=lambda out: ended.append(out) if out.finished else None)
    run(e, clock, collect, [first, late])
    shed = collect.results[late]
    assert shed["finish_reason"] == "error" and shed["error_kind"] == "overloaded" and shed["token_ids"] == []
    assert "queue_timeout_s=3 s" in shed["error"] and "retry later, after 1 s" in shed["error"]
    assert ended[0].error_kind is ErrorKind.OVERLOADED and ended[0].retry_after_s == 1  # round(3 / 3)
    assert collect.results[first]["finish_reason"] == "length" and len(collect.results[first]["token_ids"]) == 10
    assert e.pool.num_used == 0 and not e.has_unfinished_requests()


def test_an_earlier_arrival_counts_toward_the_queue_deadline(tiny) -> None:
    """A front end passes the request's arrival at it: time spent before the engine saw the request counts."""
    clock, collect = StepClock(), OutputCollector()
    e = make(tiny, clock, max_num_seqs=1, queue_timeout_s=3.0)
    busy = e.add_request([1, 2, 3], LONG, callback=collect)
    early = e.add_request([4, 5, 6], LONG, callback=collect, arrival_time=clock.t - 2.5)
    e.step()
    clock.t += 1.0
    e.step()  # 3.5 s after its arrival at the front end, 1 s after the engine saw it
    assert collect.results[early]["error_kind"] == "overloaded" and not collect.finished(busy)


def test_the_request_deadline_ends_it_with_what_it_generated(tiny) -> None:
    clock, collect = StepClock(), OutputCollector()
    e = make(tiny, clock, max_num_seqs=4, request_timeout_s=100.0)
    timed = e.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), callback=collect, timeout_s=2.5)
    default = e.add_request([4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True), callback=collect)
    run(e, clock, collect, [timed])
    r = collect.results[timed]
    assert r["finish_reason"] == "error" and r["error_kind"] == "deadline_exceeded"
    assert len(r["token_ids"]) == 3  # steps at 100, 101, 102 made a token each; at 103 > 102.5 it ended
    assert r["error"] == "request timed out after timeout_s=2.5 s (3 tokens generated)"
    assert not collect.finished(default)  # the engine's request_timeout_s (100 s) is far off
    run(e, clock, collect, [default])
    assert collect.results[default]["finish_reason"] == "length"
    assert e.pool.num_used == 0


def test_the_engine_default_deadline_applies_to_requests_that_name_none(tiny) -> None:
    clock, collect = StepClock(), OutputCollector()
    e = make(tiny, clock, request_timeout_s=1.5)
    rid = e.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), callback=collect)
    run(e, clock, collect, [rid])
    assert collect.results[rid]["error_kind"] == "deadline_exceeded" and len(collect.results[rid]["token_ids"]) == 2


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "5"])
def test_a_bad_timeout_is_invalid_input(tiny, bad) -> None:
    e = make(tiny, StepClock())
    with pytest.raises(InvalidRequest, match="timeout_s") as info:
        e.add_request([1, 2, 3], LONG, timeout_s=bad)
    assert error_kind(info.value) is ErrorKind.INVALID_INPUT and isinstance(info.value, ValueError)
    assert e.num_waiting() == 0


def test_shedding_on_arrival_refuses_with_a_retry_after(tiny) -> None:
    clock = StepClock()
    e = make(tiny, clock, max_num_seqs=2, queue_timeout_s=30.0)
    for i in range(10):
        e.add_request([1, 2, 3, 4 + i], SamplingParams(max_tokens=4, ignore_eos=True))
    while e.start_rate.rate_at(clock.t) is None:  # a pair starts every 4 steps: 0.5 starts per second
        e.step()
        clock.t += 1.0
    assert e.start_rate.rate_at(clock.t) == pytest.approx(0.5)
    for i in range(15 - e.num_waiting()):  # 15 waiting: a 16th would start after 32 s > 30 s
        e.add_request([9, 9, 9, i], SamplingParams(max_tokens=4))
    with pytest.raises(EngineOverloaded, match="would wait ~32 s > queue_timeout_s=30 s") as info:
        e.add_request([5, 5, 5], SamplingParams(max_tokens=4))
    assert info.value.kind is ErrorKind.OVERLOADED and info.value.retry_after_s == 2
    assert isinstance(info.value, RuntimeError) and e.num_waiting() == 15


def test_without_shedding_on_arrival_the_same_request_is_admitted(tiny) -> None:
    clock = StepClock()
    e = make(tiny, clock, max_num_seqs=2, queue_timeout_s=30.0, shed_on_arrival=False)
    for i in range(10):
        e.add_request([1, 2, 3, 4 + i], SamplingParams(max_tokens=4, ignore_eos=True))
    while e.start_rate.rate_at(clock.t) is None:
        e.step()
        clock.t += 1.0
    for i in range(17 - e.num_waiting()):
        e.add_request([9, 9, 9, i], SamplingParams(max_tokens=4))
    assert e.num_waiting() == 17


def test_the_waiting_bound_is_overloaded_with_a_retry_after(tiny) -> None:
    e = make(tiny, StepClock(), max_num_waiting=2)
    e.add_request([1, 2, 3], LONG)
    e.add_request([1, 2, 4], LONG)
    with pytest.raises(EngineOverloaded, match="max_num_waiting=2") as info:
        e.add_request([1, 2, 5], LONG)
    assert error_kind(info.value) is ErrorKind.OVERLOADED and retry_after_of(info.value) == 1


def test_draining_refuses_new_requests_and_finishes_those_in_flight(tiny) -> None:
    clock, collect = StepClock(), OutputCollector()
    e = make(tiny, clock)
    rid = e.add_request([1, 2, 3], LONG, callback=collect)
    e.step()
    e.drain()
    with pytest.raises(EngineDraining, match="draining") as info:
        e.add_request([4, 5, 6], LONG)
    assert info.value.kind is ErrorKind.DRAINING and info.value.retry_after_s == 1
    run(e, clock, collect, [rid])
    assert collect.results[rid]["finish_reason"] == "length" and len(collect.results[rid]["token_ids"]) == 10
    e.drain(False)
    again = e.add_request([4, 5, 6], SamplingParams(max_tokens=2, ignore_eos=True), callback=collect)
    run(e, clock, collect, [again])
    assert collect.results[again]["finish_reason"] == "length"


def test_cancellation_and_failures_carry_their_kind(tiny) -> None:
    clock, collect = StepClock(), OutputCollector()
    e = make(tiny, clock)
    cancelled = e.add_request([1, 2, 3], LONG, callback=collect)
    e.step()
    assert e.abort_request(cancelled)
    r = collect.results[cancelled]
    assert r["finish_reason"] == "abort" and r["error_kind"] == "cancelled" and e.pool.num_used == 0

    def boom(chunks):
        raise RuntimeError("device lost")

    e.executor.execute = boom
    failed = e.add_request([4, 5, 6], LONG, callback=collect)
    e.step()
    assert collect.results[failed]["error_kind"] == "internal" and "device lost" in collect.results[failed]["error"]
    for i in range(e.faults.max_consecutive - 1):
        e.add_request([7, 8, i], LONG)
        e.step()
    with pytest.raises(EngineUnavailable, match="refuses new requests until restarted") as info:
        e.add_request([9, 9, 9], LONG)
    assert info.value.kind is ErrorKind.UNAVAILABLE and isinstance(info.value, RuntimeError)


def test_error_kinds_of_plain_exceptions() -> None:
    assert (error_kind(ValueError("x")) is ErrorKind.INVALID_INPUT
            and error_kind(TypeError("x")) is ErrorKind.INVALID_INPUT)
    assert error_kind(RuntimeError("overloaded: retry later")) is ErrorKind.INTERNAL  # words decide nothing
    assert error_kind(DeadlineExceeded("x")) is ErrorKind.DEADLINE_EXCEEDED and retry_after_of(KeyError()) is None


def test_operator_controls_on_a_real_engine(tiny) -> None:
    clock, collect = StepClock(), OutputCollector()
    e = make(tiny, clock)
    assert run_control(e, "drain", {}) == {"status": "ok", "draining": True, "num_running": 0, "num_waiting": 0}
    with pytest.raises(EngineDraining):
        e.add_request([1, 2, 3], LONG)
    state = run_control(e, "state", {})
    assert state["draining"] and state["stats"]["kv_blocks_total"] == 64
    assert run_control(e, "resume", None)["draining"] is False
    rid = e.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), callback=collect)
    run(e, clock, collect, [rid])
    with pytest.raises(ControlError, match="cannot yield memory"):  # morph mode off holds no quantized layers
        run_control(e, "memory_yield", {"size": "1MiB"})
    for name, body, match in [("memory_yield", {"size": 5}, "string"), ("memory_yield", {}, "exactly one"),
                              ("memory_yield", {"size": "lots"}, "such as"), ("shutdown", {}, "unknown"),
                              ("memory_yield", {"size": "9" * 400 + "B"}, "such as"),
                              ("drain", [1], "JSON object")]:
        with pytest.raises(ControlError, match=match):
            run_control(e, name, body)
