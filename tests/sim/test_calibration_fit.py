"""The planner's local calibration fit (sim/local_target.py): one stalled forward does not become a cost of every
planned step."""

from __future__ import annotations

import numpy as np
import pytest

from sim.local_target import _fit_without_stalls


def test_a_stall_is_dropped_before_the_fit_is_kept() -> None:
    tokens = np.array([1, 4, 8, 16, 32, 64, 128, 256, 8, 16], dtype=float)
    x = np.column_stack([np.ones_like(tokens), tokens])
    y = 0.002 + 1e-4 * tokens + np.array([0, 1, -1, 0, 1, -1, 0, 1, -1, 0]) * 1e-5
    y[3] += 0.5  # one forward stalled for half a second
    const, per_token = _fit_without_stalls(x, y)
    assert const == pytest.approx(0.002, abs=2e-5) and per_token == pytest.approx(1e-4, rel=0.02)
