"""The step costs time each precision over the layers a step streams, one layer after the other, per layer: one
layer timed again and again stays in cache and its cost depends on where its copy lies, not on what a step pays."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from policy import FULL
from serve.model.step_costs import measure


def _layer(seconds: float, calls: list[int]) -> SimpleNamespace:
    """A layer whose four linears each wait ``seconds`` and count their calls."""
    def op(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        return x
    return SimpleNamespace(qkv=op, o=op, gate_up=op, down=op)


def test_a_precision_given_several_layers_is_timed_over_all_of_them_per_layer() -> None:
    fast, slow = [0], [0]
    layers = [_layer(1e-4, fast), _layer(5e-4, slow)]  # per layer: 4 x 0.1 ms and 4 x 0.5 ms, mean 1.2 ms
    costs = measure({FULL: layers}, (8, 8, 8), torch.device("cpu"), torch.float32, token_counts=(1,), repeats=3)
    assert slow[0] == fast[0] > 0  # every layer of the stack ran, as often as the first
    per_layer = costs.layer_cost_s(FULL, 1)
    assert 1.1e-3 < per_layer < 1.6e-3, per_layer  # the mean layer's cost, not the first's (0.4 ms) nor the sum
