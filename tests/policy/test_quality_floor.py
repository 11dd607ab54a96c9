"""The controller's quality floor (PolicyConfig.quality_floor) with hand-built telemetry and a fake clock: off by
default, no further quantizing step while the meter's lower bound is under the floor (under pressure and when
covering a deficit), the newest transition restored first when it stays under, and every reason carries the
reading."""

from __future__ import annotations

import pytest

from policy import PolicyConfig
from policy.quality import QualityReading, wilson_interval
from tests.policy.test_policy import HOT, FakeEngine, controller, step


def reading(agreed: int, samples: int) -> QualityReading:
    return QualityReading(samples, agreed, *wilson_interval(agreed, samples, 0.95), 0.05, 0.95)


GOOD = reading(396, 400)  # 0.99, lower bound ~0.975
LOW = reading(300, 400)   # 0.75, lower bound ~0.71


def test_off_by_default_pressure_quantizes_whatever_the_reading():
    assert PolicyConfig.for_mode("default").quality_floor is None
    ctl, eng = controller(cost_aware=False, persist_iters=1), FakeEngine()
    d = step(ctl, eng, quality=LOW, **HOT)
    assert d.action == "quantize" and "agreement 0.750 (lower 0.705 at 95%, 400 samples)" in d.reason


def test_no_further_quantizing_step_while_the_lower_bound_is_under_the_floor():
    ctl, eng = controller(cost_aware=False, persist_iters=1, quality_floor=0.9,
                          max_quantized_fraction=1.0), FakeEngine()
    assert step(ctl, eng, **HOT).action == "quantize"  # no reading yet: full precision meets the floor
    d = step(ctl, eng, quality=LOW, **HOT)
    assert d.action == "none" and "the quality floor holds" in d.reason
    assert "quality lower bound 0.705 < floor 0.900: no further quantizing" in d.reason
    d = step(ctl, eng, quality=GOOD, **HOT)
    assert d.action == "quantize" and "agreement 0.990" in d.reason  # met: the step goes ahead, the reason says so
    # covering a deficit before preempting is a quantizing step too: held, the scheduler preempts
    d = ctl.cover_deficit(eng.telemetry(quality=LOW, **HOT), 10)
    assert d.action == "none" and "quality lower bound 0.705 < floor 0.900" in d.reason
    assert ctl.cover_deficit(eng.telemetry(quality=GOOD, **HOT), 10).action == "quantize"


def test_restores_first_when_it_stays_under_even_under_pressure():
    ctl = controller(cost_aware=False, persist_iters=1, quality_floor=0.9, quality_restore_s=2.0)
    eng = FakeEngine()
    step(ctl, eng, **HOT)
    step(ctl, eng, quality=GOOD, **HOT)
    assert len(eng.quantized) == 4 and eng.now == pytest.approx(0.1)  # two steps of 2 layers each
    d = step(ctl, eng, quality=LOW, dt=1.0, **HOT)  # under since now
    assert d.action == "none" and "under for 0.00 s" in d.reason
    d = step(ctl, eng, quality=LOW, dt=1.0, extent_free=False, **HOT)
    assert d.action == "none" and "under for 1.00 s" in d.reason
    d = step(ctl, eng, quality=LOW, dt=1.0, extent_free=False, **HOT)
    assert d.action == "none" and "restore first" in d.reason and "KV extent is still in use" in d.reason
    newest = eng.stack[-1][0]
    d = step(ctl, eng, quality=LOW, dt=0.5, **HOT)  # the extent is free now: the restore waited for it only
    assert d.action == "restore" and "restore first" in d.reason and "(LIFO)" in d.reason
    assert len(eng.quantized) == 3 and newest not in eng.quantized  # the newest transition went first
    d = step(ctl, eng, quality=LOW, dt=1.0, **HOT)
    assert d.action == "none"  # the next restore waits quality_restore_s again
    assert step(ctl, eng, quality=LOW, dt=1.5, **HOT).action == "restore"
    assert len(eng.quantized) == 2


def test_a_bound_wide_from_few_samples_holds_but_never_restores():
    ctl = controller(cost_aware=False, persist_iters=1, quality_floor=0.9, quality_restore_s=1.0)
    eng = FakeEngine()
    step(ctl, eng, **HOT)
    few = reading(10, 10)  # all agree, lower bound ~0.72
    for _ in range(5):
        d = step(ctl, eng, quality=few, dt=1.0, **HOT)
        assert d.action == "none" and "the quality floor holds" in d.reason
    assert len(eng.quantized) == 2


def test_the_policy_keys_are_validated():
    with pytest.raises(ValueError, match="quality_floor"):
        PolicyConfig.for_mode("default", quality_floor=1.5)
    with pytest.raises(ValueError, match="quality_confidence"):
        PolicyConfig.for_mode("default", quality_confidence=1.0)
    assert PolicyConfig.for_mode("default", quality_floor=0.95).quality_floor == 0.95
