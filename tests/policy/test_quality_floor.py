"""The controller's quality floor (PolicyConfig.quality_floor) with hand-built telemetry and a fake clock: off by
default, no further quantizing step while the meter's lower bound is under the floor (under pressure and when
covering a deficit), the newest transition restored first when it stays under, and every reason carries the
reading; per-tier floors count while their tier has a request running."""

from __future__ import annotations

import re

import pytest

from policy import PolicyConfig
from policy.quality import MAX_TIER, QualityReading, floor_in_force, tier_floors, wilson_interval
from serve.engine.slo import MAX_PRIORITY
from tests.policy.test_policy import CALM, HOT, FakeEngine, controller, step


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


# ---- per-tier floors (PolicyConfig.quality_floor_by_tier) ----------------------------------------------------------


def test_the_floor_in_force_is_the_strictest_of_the_running_tiers_and_the_servers():
    by_tier = ((0, 0.97), (2, 0.8))
    assert floor_in_force(None, by_tier, ()) is None  # nothing running asks for a floor
    assert floor_in_force(None, by_tier, (1, 3)) is None  # tiers without a floor of their own
    assert floor_in_force(None, by_tier, (2, 5)) == (0.8, " of tier 2")
    assert floor_in_force(None, by_tier, (0, 2)) == (0.97, " of tier 0")
    assert floor_in_force(0.9, by_tier, (2,)) == (0.9, "")  # the server's floor is stricter than tier 2's
    assert floor_in_force(0.9, by_tier, (0, 2)) == (0.97, " of tier 0")
    assert floor_in_force(0.9, (), ()) == (0.9, "")  # the server's floor holds whatever runs


def test_a_tier_floor_holds_only_while_that_tier_has_a_request_running():
    ctl, eng = controller(cost_aware=False, persist_iters=1, quality_floor_by_tier={"0": 0.9},
                          max_quantized_fraction=1.0), FakeEngine()
    assert step(ctl, eng, running_tiers=(0, 1), **HOT).action == "quantize"  # no reading yet
    d = step(ctl, eng, quality=LOW, running_tiers=(0, 1), **HOT)
    assert d.action == "none" and "quality lower bound 0.705 < floor 0.900 of tier 0" in d.reason
    d = step(ctl, eng, quality=LOW, running_tiers=(1,), **HOT)  # tier 0 finished: only tier 1 runs, no floor
    assert d.action == "quantize"
    held = ctl.cover_deficit(eng.telemetry(quality=LOW, running_tiers=(0,), **HOT), 10)
    assert held.action == "none" and "floor 0.900 of tier 0" in held.reason
    assert ctl.cover_deficit(eng.telemetry(quality=LOW, running_tiers=(3,), **HOT), 10).action == "quantize"


def test_a_tier_floor_restores_after_staying_under_and_its_leaving_stops_the_clock():
    ctl = controller(cost_aware=False, persist_iters=1, quality_floor_by_tier={"0": 0.9}, quality_restore_s=2.0)
    eng = FakeEngine()
    step(ctl, eng, running_tiers=(0,), **HOT)
    d = step(ctl, eng, quality=LOW, dt=1.0, running_tiers=(0,), **HOT)
    assert d.action == "none" and "under for 0.00 s" in d.reason
    d = step(ctl, eng, quality=LOW, dt=1.5, running_tiers=(1,), **CALM)  # tier 0 gone: nothing held, clock stops
    assert d.action == "none" and "floor 0.900" not in d.reason
    d = step(ctl, eng, quality=LOW, dt=1.5, running_tiers=(0,), **HOT)  # back: under again since now
    assert d.action == "none" and "under for 0.00 s" in d.reason
    d = step(ctl, eng, quality=LOW, dt=2.0, running_tiers=(0,), **HOT)
    assert d.action == "restore" and "floor 0.900 of tier 0: restore first" in d.reason


def test_tier_floors_are_validated_by_name():
    config = PolicyConfig.for_mode("default", quality_floor_by_tier={"1": 0.9, "0": 0.97})
    assert config.quality_floor_by_tier == ((0, 0.97), (1, 0.9))  # a JSON object, as --policy and config.pbtxt give
    assert PolicyConfig.for_mode("default").quality_floor_by_tier == ()
    assert tier_floors([[3, 1]]) == ((3, 1.0),)
    for bad, named in [({"10": 0.9}, "tier '10'"), ({"x": 0.9}, "tier 'x'"), ({"0": 1.5}, "tier 0's floor"),
                       ({"0": 0}, "tier 0's floor"), ([[0, 0.9], ["0", 0.8]], "tier 0 twice"), (0.9, "tier -> floor")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            PolicyConfig.for_mode("default", quality_floor_by_tier=bad)
    with pytest.raises(ValueError, match="quality_floor_by_tier"):
        PolicyConfig(quality_floor_by_tier=((1, 0.9), (0, 0.9)))  # built directly: sorted pairs only
    assert MAX_TIER == MAX_PRIORITY  # the tiers requests may name
