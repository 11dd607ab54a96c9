"""Full-precision linear ops and fusion helpers; quantized ops live in serve/model/quantized_linear.py.

Every linear op is a callable x[T, K] -> y[T, N] with an exact `nbytes`, so the layer bank can account
for device memory whatever precision a layer runs at.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F


class LinearOp(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    @classmethod
    def fused(cls, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] | None = None) -> "DenseLinear":
        """One matmul for projections that share an input (q/k/v, gate/up): fewer, larger GEMMs."""
        bias = None
        if biases is not None and any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)
                              for w, b in zip(weights, biases)])
        return cls(torch.cat(list(weights), dim=0).contiguous(), bias)


class ConcatLinear:
    """Runs several ops on the same input and concatenates outputs (for ops that cannot be fused)."""

    def __init__(self, ops: Sequence[LinearOp], bias: torch.Tensor | None = None) -> None:
        self.ops = list(ops)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([op(x) for op in self.ops], dim=-1)
        return y + self.bias if self.bias is not None else y

    @property
    def nbytes(self) -> int:
        return sum(op.nbytes for op in self.ops) + (self.bias.nbytes if self.bias is not None else 0)
