"""Load shedding on arrival (policy/shedding.py): the start-rate meter and the decision, then the real engine's
meter."""

from __future__ import annotations

import pytest

from policy.shedding import StartRateMeter, shed_on_arrival
from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams


def test_meter_counts_only_busy_intervals():
    m = StartRateMeter(window_s=100.0, min_starts=4)
    m.observe(0.0, 0, 0)
    m.observe(50.0, 1, 0)     # idle before: the 50 s do not count
    assert m.rate is None
    m.observe(51.0, 2, 3)     # previous call left nobody waiting: still not busy
    m.observe(53.0, 2, 1)     # 2 s busy, 2 starts
    assert m.rate is None     # 2 < min_starts
    m.observe(54.0, 2, 0)     # 1 s busy, 2 starts -> 4 starts in 3 s
    assert m.rate == pytest.approx(4 / 3)
    m.observe(100.0, 9, 2)    # idle since 54 s (nobody was waiting): ignored
    assert m.rate == pytest.approx(4 / 3) and m.rate_at(100.0) == pytest.approx(4 / 3)
    assert m.rate_at(154.5) is None  # the last busy interval ended 100.5 s ago, beyond the window: stale


def test_meter_forgets_beyond_its_window():
    m = StartRateMeter(window_s=10.0, min_starts=1)
    m.observe(0.0, 0, 5)
    for i in range(1, 11):      # 1 start per second for 10 s
        m.observe(float(i), 1, 5)
    assert m.rate == pytest.approx(1.0)
    for i in range(11, 31):     # then 4 per second: after 10 s the old rate is gone
        m.observe(float(i), 4, 5)
    assert m.rate == pytest.approx(4.0)


@pytest.mark.parametrize("window_s, min_starts", [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_meter_rejects_bad_settings(window_s, min_starts):
    with pytest.raises(ValueError):
        StartRateMeter(window_s, min_starts)


def test_decision():
    assert not shed_on_arrival(1000, None, 30.0).shed            # nothing measured yet: admit
    assert not shed_on_arrival(0, 0.001, 30.0).shed              # nobody waiting: a slot is next, admit
    assert not shed_on_arrival(1000, 0.5, 0.0).shed              # no deadline: never shed
    ok = shed_on_arrival(29, 1.0, 30.0)                          # 30th in line at 1/s: starts at 30 s
    assert not ok.shed and ok.predicted_wait_s == pytest.approx(30.0)
    d = shed_on_arrival(44, 1.0, 30.0)                           # 45th: 45 s > 30 s
    assert d.shed and d.predicted_wait_s == pytest.approx(45.0) and d.retry_after_s == 15
    assert "overloaded" in d.reason and "retry later, after 15 s" in d.reason and "44 requests waiting" in d.reason
    assert shed_on_arrival(10_000, 1.0, 30.0).retry_after_s == 30  # capped at the deadline
    assert shed_on_arrival(30, 1.0, 30.0).retry_after_s == 1       # at least 1 s


class StepClock:
    """A clock the test advances: every engine step takes exactly 1 s of it."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_engine_measures_its_start_rate(tiny):
    clock = StepClock()
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=4, max_model_len=256, max_num_seqs=2),
                       loaded=tiny, clock=clock)
    try:
        for i in range(10):
            engine.add_request([1, 2, 3, 4 + i], SamplingParams(max_tokens=4, ignore_eos=True))
        starts_at: list[float] = []
        while engine.has_unfinished_requests():
            before = {s.request_id for s in engine.scheduler.running}
            engine.step()
            starts_at += [clock.t for s in engine.scheduler.running if s.request_id not in before]
            clock.t += 1.0
        assert starts_at == [0.0, 0.0, 4.0, 4.0, 8.0, 8.0, 12.0, 12.0, 16.0, 16.0]
        # 2 slots, 4 tokens each (prefill + 3 decodes): a pair starts every 4 steps while others wait
        assert engine.start_rate.rate_at(clock.t) == pytest.approx(0.5)
        d = shed_on_arrival(engine.num_waiting() + 20, engine.start_rate.rate_at(clock.t), 30.0)
        assert d.shed and d.predicted_wait_s == pytest.approx(42.0)
    finally:
        engine.shutdown()
