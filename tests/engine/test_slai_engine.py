"""The slai scheduler inside the engine: chosen by config, per-request targets, SLO pressure reaching morph."""

from __future__ import annotations

import pytest

from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.engine.slai import SlaiScheduler
from serve.engine.slo import RequestSLO
from tests.morph_support import morph


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def engine(tiny, scheduler: str = "slai", clock=None, **kw) -> LLMEngine:
    cfg = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, max_model_len=256, scheduler=scheduler)
    return LLMEngine(EngineConfig(**{**cfg, **kw}), loaded=tiny, clock=clock)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [30, 31, 32],
           [40, 41, 42, 43, 44, 45, 46]]


def test_slai_generates_the_same_greedy_tokens_as_fcfs(tiny):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fcfs = [r["token_ids"] for r in engine(tiny, "fcfs").generate(PROMPTS, params)]
    slai = engine(tiny, "slai")
    assert isinstance(slai.scheduler, SlaiScheduler)
    assert [r["token_ids"] for r in slai.generate(PROMPTS, params)] == fcfs


def test_request_targets_are_resolved_from_the_config(tiny):
    e = engine(tiny, slo_ttft_s=3.0, slo_tbt_s=0.7, default_priority=2)
    e.add_request([1, 2, 3], request_id="plain")
    e.add_request([1, 2, 3], request_id="strict", slo=RequestSLO(tbt_s=0.1, priority=0))
    assert e._requests["plain"].slo == RequestSLO(3.0, 0.7, 2)
    assert e._requests["strict"].slo == RequestSLO(3.0, 0.1, 0)
    with pytest.raises(TypeError, match="RequestSLO"):
        e.add_request([1, 2, 3], slo={"tbt_s": 0.1})  # type: ignore[arg-type]
    assert e.stats().scheduler == "slai"


def test_outputs_carry_the_resolved_tier(tiny):
    """Front ends count each gap in its request's tier (serve/request_tracker.py): the engine's outputs carry it."""
    e = engine(tiny, default_priority=2)
    seen: dict[str, set] = {"plain": set(), "strict": set()}
    e.add_request([1, 2, 3], SamplingParams(max_tokens=3), request_id="plain",
                  callback=lambda out: seen[out.request_id].add(out.priority))
    e.add_request([1, 2, 3], SamplingParams(max_tokens=3), request_id="strict", slo=RequestSLO(priority=0),
                  callback=lambda out: seen[out.request_id].add(out.priority))
    while e.has_unfinished_requests():
        e.step()
    assert seen == {"plain": {2}, "strict": {0}}


def test_strict_tier_is_admitted_first(tiny):
    clock = FakeClock()
    e = engine(tiny, clock=clock, max_num_batched_tokens=8)
    e.add_request(list(range(1, 9)), SamplingParams(max_tokens=2), request_id="relaxed-short")
    e.add_request(list(range(1, 13)), SamplingParams(max_tokens=2), request_id="strict-long",
                  slo=RequestSLO(priority=0))
    e.step()
    assert [s.request_id for s in e.scheduler.running] == ["strict-long"]


@pytest.mark.parametrize("kwargs, match", [
    ({"scheduler": "edf"}, "unknown scheduler"), ({"slo_tbt_s": 0.0}, "slo_tbt_s"),
    ({"default_priority": 10}, "default_priority"), ({"default_priority": -1}, "default_priority"),
    ({"slai_theta": -1.0}, "slai_theta"), ({"slai_theta_high": float("nan")}, "slai_theta_high"),
    ({"slai_theta_kv_threshold": 1.5}, "slai_theta_kv_threshold"), ({"slai_max_decodes": 0}, "slai_max_decodes"),
])
def test_engine_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_unset_thetas_are_the_devices_calibration_and_set_ones_win():
    """slai_theta_low / slai_theta_high left unset take the device's calibration (CPU 3 / 6 from this engine's
    batch-time spread, CUDA the paper's 5 / 10); set ones are used on every device."""
    from serve.config import SLAI_THETA_BY_DEVICE
    from serve.engine.assembly import make_scheduler
    from serve.memory.block_pool import BlockPool

    assert SLAI_THETA_BY_DEVICE == {"cpu": (3.0, 6.0), "cuda": (5.0, 10.0)}
    unset, set_ = EngineConfig(scheduler="slai"), EngineConfig(scheduler="slai", slai_theta_low=2.0,
                                                               slai_theta_high=4.5)
    for device, want in (("cpu", (3.0, 6.0)), ("cuda", (5.0, 10.0))):
        s = make_scheduler(unset, BlockPool(8), FakeClock(), device_type=device)
        assert (s.config.theta_low, s.config.theta_high) == want
        s = make_scheduler(set_, BlockPool(8), FakeClock(), device_type=device)
        assert (s.config.theta_low, s.config.theta_high) == (2.0, 4.5)


def test_ttft_slack_reaches_the_morph_controller(tiny):
    clock = FakeClock()
    e = LLMEngine(EngineConfig(num_kv_blocks=40, block_size=4, max_num_batched_tokens=32, max_model_len=256,
                               morph_mode="performance", scheduler="slai",
                               policy_overrides={"persist_iters": 1, "queue_delay_high_s": 100.0, "kv_high": 0.99,
                                                 "kv_low": 0.98, "cost_aware": False}),
                  loaded=tiny, clock=clock)
    e.add_request(list(range(1, 5)), SamplingParams(max_tokens=4), request_id="tight",
                  slo=RequestSLO(ttft_s=0.5), arrival_time=clock.t)
    t = morph(e).telemetry(clock.t, e.scheduler)
    assert t.min_ttft_slack_s == pytest.approx(0.5) and t.critical_decodes_unscheduled == 0
    decision = morph(e).controller.decide(t)  # 0.5 s left < performance's ttft_slack_low_s 1.0 s
    assert decision.action == "quantize" and "TTFT target" in decision.reason
    fcfs = LLMEngine(EngineConfig(num_kv_blocks=40, block_size=4, max_model_len=256, morph_mode="performance"),
                     loaded=tiny, clock=clock)
    fcfs.add_request(list(range(1, 5)), slo=RequestSLO(ttft_s=0.5), arrival_time=clock.t)
    assert morph(fcfs).telemetry(clock.t, fcfs.scheduler).min_ttft_slack_s is None  # FCFS reports no deadlines
