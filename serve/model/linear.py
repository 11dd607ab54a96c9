"""Full-precision linear ops and fusion helpers; quantized ops live in serve/model/quantized_linear.py.

Every linear op is a callable x[T, K] -> y[T, N] with an exact `nbytes`, so the layer bank can account
for device memory whatever precision a layer runs at.

fp32 on CPU runs our AVX2 kernel (serve/model/kernels/linear_avx2.cpp) up to ``FP32_KERNEL_MAX_ROWS`` rows and
oneDNN's matmul above that (:func:`onednn_linear`): torch's F.linear goes through MKL, which is slower than both on
the AMD CPUs measured (README "fp32 kernels and paged decode attention").
"""

from __future__ import annotations

import functools
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from serve.model import kernels

FP32_KERNEL_MAX_ROWS = 128
"""Rows (tokens) up to which fp32 CPU linears use our kernel; above it oneDNN's matmul (or MKL's F.linear where
torch has no oneDNN). A decoder's 30 layers of projections with their weights streamed from memory, as in a
real step (/tmp-free: `python -m bench.quant_kernels` measures them cache-hot), on the 2-core AMD EPYC 9004
(Zen 4, AVX-512), GFLOPS at 32 / 64 / 128 rows: ours 133 / 161 / 156, oneDNN 119 / 141 / 157, MKL 80 / 107 / 109;
at 512 rows (cache-hot) oneDNN runs 18.2 ms per layer against MKL's 22.1 and ours 21.6 (README)."""


@functools.cache
def onednn_available() -> bool:
    """Whether torch's oneDNN linear (``torch.ops.mkldnn._linear_pointwise``, the op torch's own CPU compiler
    emits) exists in this build."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through oneDNN's matmul on the weight as it lies (plain ``[N, K]`` rows, no packed copy):
    the same fp32 math as MKL's GEMM, summed in another order, and faster than it at every row count measured."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; fp32 CPU operands run our AVX2 kernel up to FP32_KERNEL_MAX_ROWS rows when
    it is built (``kernels.ops()``) and oneDNN above (same fp32 math, summed in another order)."""
    if (x.dim() == 2 and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.is_contiguous() and (bias is None or bias.dtype == torch.float32)):
        bias = None if bias is None else bias.contiguous()
        if x.shape[0] <= FP32_KERNEL_MAX_ROWS:
            ops = kernels.ops()
            if ops is not None:
                return ops.fp32_linear(x.contiguous(), weight, bias)
        if onednn_available():
            return onednn_linear(x.contiguous(), weight, bias)
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
