"""The run-time rule that corrects a wrong step-cost table (policy/cost_drift.py)."""

from __future__ import annotations

from policy.cost_drift import DriftRule


def test_a_table_three_times_too_slow_is_corrected_after_two_quiet_probes() -> None:
    rule = DriftRule(band=0.25, confirm=2)
    first = rule.observe({1: 0.33, 8: 0.35}, quiet=True)
    assert not first.correct and "1 of 2" in first.reason
    second = rule.observe({1: 0.34, 8: 0.33}, quiet=True)
    assert second.correct and "faster than the table" in second.reason


def test_busy_probes_say_nothing_and_do_not_count() -> None:
    rule = DriftRule(confirm=2)
    assert not rule.observe({1: 0.3}, quiet=True).correct
    dropped = rule.observe({1: 3.0}, quiet=False, why_not_quiet="other processes used 90% of the CPUs")
    assert not dropped.correct and "other processes" in dropped.reason
    assert rule.observe({1: 0.3}, quiet=True).correct  # the busy probe neither counted nor reset


def test_within_the_band_confirms_and_resets() -> None:
    rule = DriftRule(band=0.25, confirm=2)
    rule.observe({1: 0.5}, quiet=True)
    confirmed = rule.observe({1: 1.1, 8: 0.9}, quiet=True)
    assert not confirmed.correct and "confirmed" in confirmed.reason
    assert not rule.observe({1: 0.5}, quiet=True).correct  # counting starts again


def test_off_both_ways_is_noise() -> None:
    rule = DriftRule(confirm=1)
    assert not rule.observe({1: 0.5, 8: 2.0}, quiet=True).correct
    assert rule.observe({1: 2.0, 8: 1.9}, quiet=True).correct
