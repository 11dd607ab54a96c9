"""SLAI's iteration budget from the tightest running TBT (policy/slai_budget.py)."""

from __future__ import annotations

import pytest

from policy.slai_budget import StepFit, fit_step_time, must_run_now, token_budget


def test_the_fit_recovers_base_and_per_token_cost() -> None:
    fit = fit_step_time([(n, 0.02 + 0.001 * n) for n in (1, 8, 64, 200, 512)])
    assert fit is not None and fit.base_s == pytest.approx(0.02) and fit.per_token_s == pytest.approx(0.001)
    assert fit_step_time([(8, 0.1)] * 3) is None  # too few batches
    flat = fit_step_time([(8, 0.08)] * 5)  # no spread in sizes: the mean cost per token
    assert flat == StepFit(0.0, 0.01)


def test_the_budget_never_exceeds_what_keeps_the_tightest_decode_within_its_tbt() -> None:
    fit = StepFit(0.02, 0.001)  # 20 ms + 1 ms per token
    budget, why = token_budget(now=10.0, deadlines=[10.2, 11.0], fit=fit, max_tokens=512, decodes=3, min_progress=16)
    assert budget == 180 and fit.predict(budget) <= 0.2 + 1e-9 < fit.predict(budget + 1), why
    assert token_budget(10.0, [], fit, 512, 0, 16)[0] == 512  # nothing decoding: the configured budget
    assert token_budget(10.0, [20.0], fit, 512, 2, 16)[0] == 512  # plenty of slack: capped by the configuration


def test_the_floor_keeps_admission_moving_when_no_budget_meets_a_deadline() -> None:
    budget, why = token_budget(10.0, [10.01], StepFit(0.02, 0.001), 512, decodes=4, min_progress=16)
    assert budget == 20 and "floor" in why


def test_a_decode_that_cannot_wait_an_iteration_runs_now() -> None:
    assert must_run_now(now=1.0, deadline=1.15, predicted_s=0.1)
    assert not must_run_now(now=1.0, deadline=1.25, predicted_s=0.1)
