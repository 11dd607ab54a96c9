"""Plain round-to-nearest quantizers into the runtime formats of :mod:`serve.model.quantized_linear`.

No modelopt and no calibration data: int8 per-channel symmetric, int4 symmetric group-wise, fp8 per tensor
or per channel. The runtime uses them for on-the-fly variants (no engine directory); the builder uses
their rounding helpers to rebuild modelopt's codes exactly from its calibrated amax.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from policy.precisions import check_quantized_precision
from serve.model.quantized_linear import (
    INT4_GROUP_SIZES,
    Fp8WeightOnly,
    Int4WeightOnly,
    Int8WeightOnly,
    QuantizedLinear,
)

_INT4_MAX, _INT8_MAX, _FP8_MAX = 7.0, 127.0, 448.0
_AMAX_EPS = 1.0 / (1 << 24)
"""modelopt's _tensor_quant / _fp8_eager treat amax <= 2**-24 as zero (whole block -> 0)."""


def choose_int4_block_size(in_features: Iterable[int]) -> int:
    """128 when every in_features allows it, else 64 (e.g. SmolLM's hidden 576), else 32."""
    dims = sorted(set(in_features))
    for block in (128, 64, 32):
        if all(k % block == 0 for k in dims):
            return block
    raise ValueError(f"no int4 block size in (128, 64, 32) divides all input dims {dims}")


def check_int4_block_size(in_features: Iterable[int], block_size: int) -> None:
    if block_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {block_size}")
    bad = sorted({k for k in in_features if k % block_size})
    if bad:
        dims = ", ".join(map(str, bad))
        raise ValueError(
            f"int4 group size {block_size} does not divide in_features {dims}; "
            "use a group size that divides every input dim (e.g. 64 or 32 for a hidden size of 576)"
        )


def quantize_int8_rtn(weight: torch.Tensor) -> Int8WeightOnly:
    """Plain (no modelopt) int8 symmetric per-output-channel round-to-nearest, scale = amax / 127."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    return Int8WeightOnly.from_int(_round_codes(w, amax[:, None], _INT8_MAX, -128.0), _scale(amax, _INT8_MAX))


def quantize_int4_rtn(weight: torch.Tensor, group_size: int = 128) -> Int4WeightOnly:
    """Plain (no modelopt) int4 symmetric group-wise round-to-nearest: per group of ``group_size``
    inputs, scale = amax / 7, q = clamp(round(w / scale), -8, 7), zero = 0."""
    w = weight.detach().float()
    n, k = w.shape
    check_int4_block_size([k], group_size)
    groups = w.reshape(n, k // group_size, group_size)
    amax = groups.abs().amax(dim=2)
    q = _round_codes(groups, amax[..., None], _INT4_MAX, -8.0).reshape(n, k)
    return Int4WeightOnly.from_codes(q + 8, _scale(amax, _INT4_MAX), group_size)


def quantize_fp8_rtn(weight: torch.Tensor, per_channel: bool = False) -> Fp8WeightOnly:
    """Plain (no modelopt) e4m3 quantization, scale = amax / 448 per tensor or per output channel."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    return _fp8_from_amax(w, amax)


def quantize_linear_rtn(weight: torch.Tensor, precision: str, group_size: int = 128) -> QuantizedLinear:
    """Dispatch to the plain RTN quantizer of ``precision`` (``group_size`` is used by int4 only)."""
    check_quantized_precision(precision)
    if precision == "int8":
        return quantize_int8_rtn(weight)
    if precision == "int4":
        return quantize_int4_rtn(weight, group_size)
    return quantize_fp8_rtn(weight)


def _scale(amax: torch.Tensor, max_bound: float) -> torch.Tensor:
    scale = amax.float() / max_bound
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _round_codes(w: torch.Tensor, amax: torch.Tensor, max_bound: float, min_bound: float) -> torch.Tensor:
    """Signed integer codes exactly as modelopt's ``_tensor_quant``: clamp(round(w * (max/amax)))."""
    amax = amax.float()
    mult = torch.tensor(max_bound, dtype=torch.float32) / amax
    mult = torch.where(amax <= _AMAX_EPS, torch.zeros_like(mult), mult)
    return torch.clamp((w.float() * mult).round(), min_bound, max_bound)


def _fp8_from_amax(w: torch.Tensor, amax: torch.Tensor) -> Fp8WeightOnly:
    """Mirrors modelopt's ``_fp8_eager``: codes = e4m3(clamp(w * 448/amax)), scale = 1 / (448/amax)."""
    amax = amax.float()
    safe = torch.where(amax <= _AMAX_EPS, torch.ones_like(amax), amax)
    mult = _FP8_MAX / safe
    bmult = mult[:, None] if mult.numel() > 1 else mult.reshape(())
    codes = (w.float() * bmult).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8WeightOnly(codes, 1 / mult)
