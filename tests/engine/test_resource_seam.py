"""The resource-manager seam with several managers: a second lever lands as one more manager, and the loop calls
each at fixed points in order (frees in reverse), offers shortfalls along the chain, records one manager's
failure under its name while the others and the batch still run, and reports each manager's typed stats."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from serve.config import EngineConfig
from serve.engine.assembly import build_parts
from serve.engine.engine import LLMEngine
from serve.engine.resources import ResourceManagers
from serve.engine.sampling_params import SamplingParams
from serve.engine.stats import resource_fields
from serve.engine.torch_device import TorchDevice
from serve.morph.runtime import MorphRuntime
from serve.resource_seam import ResourceManagerBase, YieldsMemory
from tests.morph.test_morph import FakeClock, assert_memory_exact


@dataclass(frozen=True)
class RecorderStats:
    calls: int

    def engine_fields(self) -> dict:
        return {}


class Recorder(ResourceManagerBase):
    """A lever that changes nothing: it logs every call the loop makes, in one log shared by all recorders."""

    def __init__(self, name: str, log: list, fail_boundary: bool = False, grows_pool: bool = False,
                 fail_shortfall: bool = False) -> None:
        self.name, self.log, self.fail_boundary, self.grows_pool = name, log, fail_boundary, grows_pool
        self.fail_shortfall = fail_shortfall
        self.offered: list[int] = []

    def before_schedule(self, scheduler) -> None:
        self.log.append((self.name, "before_schedule"))
        if self.fail_boundary:
            raise RuntimeError(f"{self.name} planted failure")

    def cover_shortfall(self, scheduler, blocks: int) -> int:
        self.offered.append(blocks)
        if self.fail_shortfall:
            raise RuntimeError(f"{self.name} planted shortfall failure")
        return 0

    def after_schedule(self, num_tokens: int) -> None:
        self.log.append((self.name, "after_schedule"))

    def on_first_token(self, now: float, ttft_s: float) -> None:
        self.log.append((self.name, "first_token"))

    def on_request_finished(self, request_id: str) -> None:
        self.log.append((self.name, "finished", request_id))

    def resource_stats(self) -> RecorderStats:
        return RecorderStats(len(self.log))

    def shutdown(self) -> None:
        self.log.append((self.name, "shutdown"))


def engine_with(tiny, mode: str, extra_before: list, extra_after: list, blocks: int = 20, **policy) -> LLMEngine:
    config = EngineConfig(num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=32, max_num_seqs=16,
                          morph_mode=mode, max_model_len=256,
                          policy_overrides={"persist_iters": 1, "cost_aware": False, **policy} if mode != "off" else {})
    clock = FakeClock()
    parts = build_parts(config, TorchDevice(config, tiny), clock)
    parts.resources = [*extra_before, *parts.resources, *extra_after]
    return LLMEngine(config, clock=clock, parts=parts)


def test_every_manager_is_called_in_order_and_freed_in_reverse(tiny):
    log: list = []
    a, b = Recorder("a", log), Recorder("b", log)
    e = engine_with(tiny, "off", [a], [b])
    rid = e.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    e.step()
    assert log[:4] == [("a", "before_schedule"), ("b", "before_schedule"), ("a", "after_schedule"),
                       ("b", "after_schedule")]
    assert log[4:6] == [("a", "first_token"), ("b", "first_token")]
    while e.has_unfinished_requests():
        e.step()
    assert [x for x in log if x[1] == "finished"] == [("b", "finished", rid), ("a", "finished", rid)]
    calls = len(log)
    assert e.stats().resources == {"a": RecorderStats(calls), "b": RecorderStats(calls)}
    e.shutdown()
    assert log[-2:] == [("b", "shutdown"), ("a", "shutdown")]


def test_one_managers_failure_is_recorded_under_its_name_and_the_others_still_run(tiny):
    log: list = []
    bad, good = Recorder("bad", log, fail_boundary=True), Recorder("good", log)
    e = engine_with(tiny, "off", [bad, good], [])
    out = e.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 3                      # the batch ran
    assert ("good", "before_schedule") in log              # the manager after the failing one ran
    assert e.faults.last_error.startswith("bad: RuntimeError: bad planted failure")
    assert e.faults.failed_iterations >= 3 and not e.healthy  # every boundary failed: the engine says so


class FailingObserver(Recorder):
    def after_execute(self, sampled, logits) -> None:
        self.log.append((self.name, "after_execute", len(sampled)))
        raise RuntimeError("observer planted failure")


def test_an_observer_failing_after_execute_is_recorded_and_the_engine_stays_healthy(tiny):
    log: list = []
    e = engine_with(tiny, "off", [], [FailingObserver("obs", log)])
    want = engine_with(tiny, "off", [], []).generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    out = e.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert out[0]["token_ids"] == want[0]["token_ids"]  # it saw every batch before the sampling and changed nothing
    assert [x for x in log if x[1] == "after_execute"] == [("obs", "after_execute", 1)] * 4
    assert e.faults.last_error.startswith("obs: RuntimeError: observer planted failure")
    assert e.healthy and e.faults.failed_iterations == 0


def test_a_shortfall_goes_to_each_pool_growing_manager_in_order_with_what_is_left(tiny):
    """A recorder ahead of the morph runtime covers nothing, so the runtime is offered the whole shortfall; the
    recorder after it is offered only what the runtime left (nothing, here: quantizing covered it)."""
    log: list = []
    first, last = Recorder("first", log, grows_pool=True), Recorder("last", log, grows_pool=True)
    e = engine_with(tiny, "performance", [first], [last], blocks=20, kv_high=1.0, queue_delay_high_s=1e9,
                    persist_iters=10_000)  # the controller's own pressure rule held back: only shortfalls act
    runtime = e.resource_manager(MorphRuntime)
    assert runtime is not None and runtime.grows_pool
    outs = e.generate([[(7 * i + j) % 4000 + 10 for j in range(8)] for i in range(4)],
                      SamplingParams(max_tokens=40, ignore_eos=True))  # decodes outgrow the base pool
    assert [len(o["token_ids"]) for o in outs] == [40] * 4
    assert first.offered, "the scheduler met a shortfall"
    assert runtime.stats.swaps >= 1 and e.scheduler.num_preemptions == 0  # the runtime covered them all
    assert last.offered == []                                             # so nothing was left to offer
    assert_memory_exact(e)


def test_a_failed_shortfall_is_recorded_and_its_iteration_not_counted_healthy(tiny):
    """A manager failing inside the scheduler's shortfall hook (mid-schedule) is recorded under its name, the
    scheduler preempts what is left, and that iteration does not count as healthy, as a boundary failure."""
    log: list = []
    bad = Recorder("bad", log, grows_pool=True, fail_shortfall=True)
    e = engine_with(tiny, "off", [bad], [], blocks=12)
    for i in range(4):
        e.add_request([(7 * i + j) % 4000 + 10 for j in range(8)], SamplingParams(max_tokens=24, ignore_eos=True))
    failed_steps = 0
    while e.has_unfinished_requests():
        offered = len(bad.offered)
        e.step()
        if len(bad.offered) > offered:  # this iteration's shortfall failed: not reset to healthy after the batch
            failed_steps += 1
            assert not e.resources.iteration_ok and e.faults.consecutive >= 1
        else:
            assert e.resources.iteration_ok and e.faults.consecutive == 0
    assert failed_steps and e.scheduler.num_preemptions > 0  # the scheduler preempted what was left
    assert e.faults.last_error.startswith("bad: RuntimeError: bad planted shortfall failure")
    assert e.faults.failed_iterations == failed_steps


def test_managers_are_reached_by_type_and_their_stats_are_typed(tiny):
    log: list = []
    e = engine_with(tiny, "default", [], [Recorder("rec", log)])
    runtime = e.resource_manager(MorphRuntime)
    assert isinstance(runtime, MorphRuntime) and e.resource_manager(YieldsMemory) is runtime
    assert isinstance(e.resource_manager(Recorder), Recorder)
    stats = e.stats()
    # the default mode's kv_rung auto is int8 on this fp32 CPU engine: the KV-precision rung is a manager too, and
    # the quality meter (quality_meter 0.02 by default) watches after the levers
    assert set(stats.resources) == {"kv_precision", "morph", "quality", "rec"}
    assert stats.resources["morph"].configuration == "f" * e.model_config.num_layers
    assert stats.swaps_total == stats.resources["morph"].swaps_total == 0
    off = engine_with(tiny, "off", [], [])
    assert off.resource_manager(MorphRuntime) is None and off.stats().resources == {}
    with pytest.raises(ValueError, match="cannot yield memory"):
        off.request_memory_yield(1 << 20)


def test_two_managers_filling_one_engine_field_is_refused():
    @dataclass(frozen=True)
    class Swaps:
        def engine_fields(self) -> dict:
            return {"swaps_total": 1}
    with pytest.raises(ValueError, match="fills EngineStats fields"):
        resource_fields({"one": Swaps(), "two": Swaps()})
    with pytest.raises(ValueError, match="distinct names"):
        ResourceManagers([Recorder("x", []), Recorder("x", [])])
