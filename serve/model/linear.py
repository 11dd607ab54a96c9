"""Full-precision linear ops and fusion helpers; quantized ops live in serve/model/quantized_linear.py.

Every linear op is a callable x[T, K] -> y[T, N] with an exact `nbytes`, so the layer bank can account
for device memory whatever precision a layer runs at.

fp32 on CPU runs our AVX2 kernel (serve/model/kernels/linear_avx2.cpp) up to ``FP32_KERNEL_MAX_ROWS`` rows:
torch's F.linear goes through MKL, which takes a slow generic path on AMD CPUs (README "fp32 kernels and paged decode attention").
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from serve.model import kernels

FP32_KERNEL_MAX_ROWS = 128
"""Rows (tokens) up to which fp32 CPU linears use our kernel. On the 2-core AMD EPYC (AVX2) a decoder layer's
projections run 2x / 4.3x / 1.4x / 1.0x / 0.9x as fast as F.linear at 1 / 4 / 32 / 128 / 512 rows
(`python -m bench.quant_kernels`), so above this MKL's blocked GEMM (prefill chunks) is kept."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; fp32 CPU operands with ``x`` of at most FP32_KERNEL_MAX_ROWS rows run
    our AVX2 kernel (same fp32 math, summed in another order) when it is built (``kernels.ops()``)."""
    if (x.dim() == 2 and x.shape[0] <= FP32_KERNEL_MAX_ROWS and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
            and (bias is None or bias.dtype == torch.float32)):
        ops = kernels.ops()
        if ops is not None:
            return ops.fp32_linear(x.contiguous(), weight, None if bias is None else bias.contiguous())
    return F.linear(x, weight, bias)


class LinearOp(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

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
