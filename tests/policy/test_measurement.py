"""Whether a measured table is trusted (policy/measurement.py): each condition over its limit is a named reason."""

from __future__ import annotations

import pytest

from policy.measurement import Conditions, MeasurementLimits, judge

QUIET = Conditions(other_share=0.02, steal_share=0.0, spread=0.03, reference_drift=0.02)


def test_a_quiet_measurement_is_trusted() -> None:
    verdict = judge(QUIET)
    assert verdict.trusted and verdict.reasons == () and "quiet" in verdict.why()


@pytest.mark.parametrize("field, value, words", [
    ("other_share", 0.6, "other processes used 60%"),
    ("steal_share", 0.2, "hypervisor took 20%"),
    ("spread", 0.5, "repeats disagree by 50%"),
    ("reference_drift", 0.3, "reference kernel ran 30%"),
])
def test_each_condition_over_its_limit_is_a_reason(field, value, words) -> None:
    verdict = judge(Conditions(**{**QUIET.as_dict(), field: value}))
    assert not verdict.trusted and len(verdict.reasons) == 1 and words in verdict.reasons[0]


def test_limits_are_settings() -> None:
    busy = Conditions(**{**QUIET.as_dict(), "other_share": 0.3})
    assert not judge(busy).trusted and judge(busy, MeasurementLimits(max_other_share=0.5)).trusted
