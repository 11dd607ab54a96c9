"""int8 weight-only: int8 ``[N, K]`` + bf16 per-output-channel scales; on CPU our AVX2 kernel
(:mod:`serve.model.kernels`), else ``aten._weight_int8pack_mm``; on CUDA an upcast bf16 matmul."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from serve.model import kernels
from serve.model.quantized_linear import common
from serve.model.quantized_linear.common import (
    Calibration,
    UnifiedTensors,
    WeightAndScale,
    _aligned,
    _check,
    _flatten_input,
    _is_cuda,
    _out_dtype,
    _round_codes,
    _run_cpu_kernel,
    _scale,
)

_INT8_K_MULTIPLE = 16
"""``aten._weight_int8pack_mm`` reads out of bounds (segfault / garbage) unless K % 16 == 0."""

_INT8_MAX = 127.0


@dataclass(eq=False)
class Int8WeightOnly(WeightAndScale):
    """int8 ``weight [N, K]`` (symmetric, per output channel) with bf16 ``scales [N]``."""

    weight: torch.Tensor
    scales: torch.Tensor
    SCALE: ClassVar[str] = "scales"
    format: ClassVar[str] = "int8_wo"

    def __post_init__(self) -> None:
        _check(self.weight.dim() == 2, f"int8 weight must be 2-D, got shape {tuple(self.weight.shape)}")
        _check(self.weight.dtype == torch.int8, f"int8 weight must be torch.int8, got {self.weight.dtype}")
        n, k = self.weight.shape
        _check(
            k % _INT8_K_MULTIPLE == 0,
            f"int8 weight-only kernel needs in_features divisible by {_INT8_K_MULTIPLE}, got {k}",
        )
        _check(
            tuple(self.scales.shape) == (n,),
            f"int8 scales must have shape ({n},), got {tuple(self.scales.shape)}",
        )
        self.weight = _aligned(self.weight)
        self.scales = _aligned(self.scales.to(torch.bfloat16))

    @classmethod
    def from_int(cls, q: torch.Tensor, scale: torch.Tensor) -> Int8WeightOnly:
        """From integer codes in [-128, 127] and per-channel scales (w = q * scale)."""
        _check(
            int(q.min()) >= -128 and int(q.max()) <= 127,
            "int8 codes must lie in [-128, 127]",
        )
        return cls(q.to(torch.int8), scale.reshape(-1))

    @classmethod
    def concat(cls, ops: list[Int8WeightOnly]) -> Int8WeightOnly:
        """One layer computing ``ops`` side by side (fused q/k/v, gate/up): per-channel scales concatenate
        exactly."""
        return cls(torch.cat([op.weight for op in ops]), torch.cat([op.scales for op in ops]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = None if _is_cuda(self.weight) else kernels.ops()
        if ops is not None and common._q8_gemv_input(x, self.in_features):
            return ops.int8_linear_q8(x, self.weight, self.scales)
        x2, lead = _flatten_input(x, self.in_features)
        if ops is not None:
            y = _run_cpu_kernel(x2, lambda xf: ops.int8_linear(xf, self.weight, self.scales),
                                lambda xf: ops.int8_linear_q8(xf, self.weight, self.scales), self.dequantize)
        else:
            xb = x2.to(device=self.weight.device, dtype=torch.bfloat16)
            if _is_cuda(self.weight):
                y = self._forward_cuda(xb)
            else:
                y = torch.ops.aten._weight_int8pack_mm(_aligned(xb), self.weight, self.scales)
        return y.to(_out_dtype(x)).reshape(*lead, self.out_features)

    def _forward_cuda(self, xb: torch.Tensor) -> torch.Tensor:
        # Checked on an H200 (tests/model/test_cuda.py): aten._weight_int8pack_mm has no CUDA kernel, so upcast the int8
        # weight to bf16 and scale the output columns.
        return torch.mm(xb, self.weight.to(torch.bfloat16).t()) * self.scales

    __call__ = forward

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]


def quantize_int8_rtn(weight: torch.Tensor, group_size: int | None = None) -> Int8WeightOnly:
    """Plain (no modelopt) int8 symmetric per-output-channel round-to-nearest, scale = amax / 127
    (``group_size`` is ignored: one scale per output channel)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    return Int8WeightOnly.from_int(_round_codes(w, amax[:, None], _INT8_MAX, -128.0), _scale(amax, _INT8_MAX))


def int8_from_calibration(cal: Calibration) -> Int8WeightOnly:
    """modelopt's INT8 weight-only codes (per-output-channel amax, axis 0) as a runtime layer."""
    amax = cal.amax.reshape(-1)  # [N]
    q = _round_codes(cal.weight, amax[:, None], cal.max_bound, cal.min_bound)
    return Int8WeightOnly.from_int(q, _scale(amax, cal.max_bound))


def int8_from_unified(t: UnifiedTensors, layer_cfg: dict) -> Int8WeightOnly:
    """A ``W8A16`` module of a modelopt unified checkpoint (``weight`` int8 ``[N, K]``, ``weight_scale`` fp32 ``[N]``)
    as a runtime layer."""
    weight, scale = t.require("weight"), t.require("weight_scale")
    _check(weight.dtype == torch.int8, f"W8A16 weight must be int8, got {weight.dtype}")
    return Int8WeightOnly(weight, scale.float().reshape(-1))
