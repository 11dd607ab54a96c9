"""The quality meter's rules (policy/quality.py): Wilson's interval against known values, the window's reading,
the sampling rule's budget (nothing when nothing is quantized, debt repaid, several positions only when they fit),
and the floor's verdicts in words."""

from __future__ import annotations

import pytest

from policy.quality import FloorRule, QualityReading, QualityWindow, SamplingRule, wilson_interval


def test_wilson_interval_matches_the_published_values():
    # Newcombe (1998), Statistics in Medicine 17:857, table I: 81/263 -> 0.2553-0.3662; 15/148 -> 0.0624-0.1605
    lo, hi = wilson_interval(81, 263, 0.95)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
    lo, hi = wilson_interval(15, 148, 0.95)
    assert (round(lo, 4), round(hi, 4)) == (0.0624, 0.1605)
    # every sample agreeing: the lower bound is n / (n + z^2), under 1 however many samples
    lo, hi = wilson_interval(100, 100, 0.95)
    assert hi == 1.0 and lo == pytest.approx(100 / (100 + 1.959964 ** 2), abs=1e-6)
    assert wilson_interval(0, 0, 0.95) == (0.0, 1.0)
    assert wilson_interval(50, 100, 0.99)[0] < wilson_interval(50, 100, 0.90)[0]  # more confidence, wider
    with pytest.raises(ValueError):
        wilson_interval(3, 2, 0.95)
    with pytest.raises(ValueError):
        wilson_interval(1, 2, 1.0)


def test_window_reads_the_newest_samples_and_totals_all():
    w = QualityWindow(window=4, confidence=0.95)
    assert w.reading() is None
    for agreed, tv in [(False, 0.5), (True, 0.1), (True, 0.1), (True, 0.1), (True, 0.3)]:
        w.add(agreed, tv)
    r = w.reading()
    assert r is not None and (r.samples, r.agreed) == (4, 4)  # the disagreeing first sample left the window
    assert r.divergence == pytest.approx(0.15) and r.agreement == 1.0
    assert (w.samples_total, w.agreed_total) == (5, 4) and w.divergence_total == pytest.approx(1.1)
    assert (r.lower, r.upper) == wilson_interval(4, 4, 0.95)
    with pytest.raises(ValueError):
        w.add(True, 1.5)


def test_sampling_takes_nothing_while_nothing_is_quantized():
    rule = SamplingRule(fraction=0.02)
    for _ in range(100):
        rule.step(0.05, active=False)
        assert rule.choose([100, 200], active=False) == []
    assert rule.earned_s == 0.0 and rule.credit_s == 0.0
    assert SamplingRule(fraction=0.0).choose([10], active=True) == []  # the meter switched off


def test_sampling_spends_its_fraction_of_step_time():
    rule = SamplingRule(fraction=0.02, max_per_step=2, seed=1)
    step_s, cost_per_token = 0.010, 0.0001
    taken = 0
    for _ in range(10_000):
        rule.step(step_s, active=True)
        for i in rule.choose([100, 100, 100], active=True):
            rule.spent(cost_per_token * 100, 100)  # a sample over 100 tokens costs 10 ms, a whole step
            taken += 1
    # 2 % of 10 000 steps x 10 ms = 2 s of credit; a sample costs 10 ms: 200 samples, one more on the first step
    assert taken in (200, 201)
    assert rule.spent_s <= rule.earned_s + 0.010 + 1e-9
    assert rule.seconds_per_token == pytest.approx(cost_per_token)


def test_deferral_takes_no_sample_while_requests_wait_and_keeps_the_credit():
    rule = SamplingRule(fraction=1.0, seed=0, defer_while_waiting=True)
    rule.step(0.1, active=True)
    assert rule.choose([10, 10], active=True, waiting=1) == []
    assert rule.credit_s == pytest.approx(0.1)  # earned while deferring, spent once nobody waits
    assert len(rule.choose([10, 10], active=True, waiting=0)) == 1
    assert len(SamplingRule(fraction=1.0).choose([10], active=True, waiting=3)) == 1  # deferral off (a floor is set)


def test_no_sample_whose_estimated_cost_exceeds_the_tbt_room():
    rule = SamplingRule(fraction=1.0, max_per_step=3, seed=0)
    rule.spent(0.100, 100)  # 1 ms per context token
    rule.step(1.0, active=True)
    assert rule.choose([300, 300], active=True, room_s=0.25) == []  # 0.3 s each: a tight request's gap would burst
    assert rule.choose([300, 100], active=True, room_s=0.25) == [1]  # the 0.1 s one fits
    assert len(rule.choose([100, 100, 100], active=True, room_s=0.25)) == 2  # two fit together, three do not


def test_several_positions_only_when_their_estimated_cost_fits_the_credit():
    rule = SamplingRule(fraction=1.0, max_per_step=3, seed=0)
    assert len(rule.choose([10, 10, 10], active=True)) == 1  # no cost measured yet: one
    rule.spent(0.040, 40)  # 1 ms per token
    rule.step(0.200, active=True)  # credit 0.16 s, banked up to 3 x the costliest sample: 0.12 s
    assert rule.credit_s == pytest.approx(0.120)
    assert len(rule.choose([10, 10, 10], active=True)) == 3  # 30 ms planned fits
    assert len(rule.choose([50, 50, 50], active=True)) == 2  # 100 ms fits, 150 does not
    rule.spent(0.200, 100)
    assert rule.choose([10], active=True) == []  # in debt
    rule.step(0.0, active=False)
    assert rule.credit_s < 0  # a debt stays when quantization ends


def test_floor_off_holds_nothing():
    verdict = FloorRule(None, 5.0).check(0.0, QualityReading(100, 10, 0.05, 0.17, 0.5, 0.95), quantized=True)
    assert (verdict.hold, verdict.restore, verdict.reason) == (False, False, "")


def test_floor_holds_under_the_bound_and_restores_when_it_stays_under():
    floor = FloorRule(0.9, restore_s=5.0)
    good = QualityReading(200, 198, *wilson_interval(198, 200, 0.95), 0.01, 0.95)
    few = QualityReading(10, 10, *wilson_interval(10, 10, 0.95), 0.01, 0.95)   # all agree, bound still wide
    bad = QualityReading(200, 160, *wilson_interval(160, 200, 0.95), 0.2, 0.95)
    v = floor.check(0.0, None, quantized=True)
    assert not v.hold and "no samples yet" in v.reason
    v = floor.check(0.0, bad, quantized=False)
    assert not v.hold and "nothing quantized" in v.reason
    v = floor.check(1.0, good, quantized=True)
    assert not v.hold and "floor 0.900 met" in v.reason and "agreement 0.990" in v.reason
    v = floor.check(2.0, few, quantized=True)
    assert v.hold and not v.restore and "no further quantizing" in v.reason and "< floor 0.900" in v.reason
    v = floor.check(8.0, few, quantized=True)
    assert v.hold and not v.restore  # under for 6 s, but only the bound's width: agreement 1.0 is not under
    v = floor.check(9.0, bad, quantized=True)
    assert v.hold and v.restore and "restore first" in v.reason and "under for 7.00 s" in v.reason
    assert floor.check(9.5, bad, quantized=True).restore  # not taken (its KV extent in use, say): still asked
    floor.restored(10.0)
    v = floor.check(11.0, bad, quantized=True)
    assert v.hold and not v.restore  # the next restore waits restore_s again
    assert floor.check(15.0, bad, quantized=True).restore
    assert not floor.check(16.0, good, quantized=True).hold  # met again: the streak is gone
    assert not floor.check(17.0, bad, quantized=True).restore
    with pytest.raises(ValueError):
        FloorRule(1.5, 1.0)
