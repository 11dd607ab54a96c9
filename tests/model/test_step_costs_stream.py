"""The step costs time each precision over the layers a step streams, one layer after the other, per layer: one
layer timed again and again stays in cache and its cost depends on where its copy lies, not on what a step pays."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from policy import FULL
from serve.model import step_costs
from serve.model.step_costs import measure


class FakeClock:
    """perf_counter for the measurement: it moves only when a fake layer's linear runs (no timing decides)."""

    def __init__(self) -> None:
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t


def _layer(clock: FakeClock, seconds: float, calls: list[int]) -> SimpleNamespace:
    """A layer whose four linears each take ``seconds`` on the fake clock and count their calls."""
    def op(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        clock.t += seconds
        return x
    return SimpleNamespace(qkv=op, o=op, gate_up=op, down=op)


def test_a_precision_given_several_layers_is_timed_over_all_of_them_per_layer(monkeypatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(step_costs, "time", SimpleNamespace(perf_counter=clock.perf_counter,
                                                            strftime=time.strftime, gmtime=time.gmtime))
    fast, slow = [0], [0]
    layers = [_layer(clock, 1e-4, fast), _layer(clock, 5e-4, slow)]  # per layer 0.4 and 2.0 ms, mean 1.2 ms
    costs = measure({FULL: layers}, (8, 8, 8), torch.device("cpu"), torch.float32, token_counts=(1,), repeats=3)
    assert slow[0] == fast[0] > 0  # every layer of the stack ran, as often as the first
    assert costs.layer_cost_s(FULL, 1) == pytest.approx(1.2e-3)  # the mean layer's, not the first's nor the sum
