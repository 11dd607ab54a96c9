"""fp8 weight-only: e4m3fn ``[N, K]`` + fp32 per-tensor or per-channel scale; correctness only on CPU
(dequantize then fp32 matmul), ``torch._scaled_mm`` on CUDA (sm89+)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from serve.model.quantized_linear.common import (
    _AMAX_EPS,
    Calibration,
    UnifiedTensors,
    WeightAndScale,
    _check,
    _flatten_input,
    _is_cuda,
    _out_dtype,
)

_FP8_MAX = 448.0


@dataclass(eq=False)
class Fp8WeightOnly(WeightAndScale):
    """e4m3fn ``weight [N, K]`` with fp32 ``scale`` (shape ``[]``/``[1]`` per-tensor or ``[N]``
    per-channel); ``w = weight * scale``.

    Not a fast path on CPU: fp8 is a GPU (Hopper+) format, so on CPU the weight is dequantized and
    multiplied in fp32 (slower than plain fp32, but bit-faithful to modelopt's fake quantization).
    On CUDA (checked on an H200, sm89+) activations are quantized dynamically to e4m3 and ``torch._scaled_mm`` is
    used, i.e. W8A8 numerics rather than the exact weight-only result.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    SCALE: ClassVar[str] = "scale"
    format: ClassVar[str] = "fp8_wo"

    def __post_init__(self) -> None:
        _check(self.weight.dim() == 2, f"fp8 weight must be 2-D, got shape {tuple(self.weight.shape)}")
        _check(
            self.weight.dtype == torch.float8_e4m3fn,
            f"fp8 weight must be torch.float8_e4m3fn, got {self.weight.dtype}",
        )
        _check(
            self.scale.numel() in (1, self.weight.shape[0]),
            f"fp8 scale must be per-tensor (1 element) or per-channel ({self.weight.shape[0]}), "
            f"got shape {tuple(self.scale.shape)}",
        )
        self.scale = self.scale.float().reshape(-1).contiguous()

    @property
    def per_channel(self) -> bool:
        return self.scale.numel() > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = _flatten_input(x, self.in_features)
        x2 = x2.to(self.weight.device)
        if _is_cuda(self.weight):
            y = self._forward_cuda(x2)
        else:
            y = x2.float() @ self.dequantize().t()
        return y.to(_out_dtype(x)).reshape(*lead, self.out_features)

    def _forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        # Checked on an H200 (within 8 %): dynamic e4m3 activation scales (per row when the weight scale is
        # per channel -> rowwise scaling, else per tensor); _scaled_mm wants mat2 column-major, which
        # weight.t() of a row-major [N, K] is. Dimensions must be multiples of 16.
        fmax = torch.finfo(torch.float8_e4m3fn).max
        if self.per_channel:
            amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
            scale_b = self.scale.reshape(1, -1)
        else:
            amax = x.abs().amax().float().clamp(min=1e-12)
            scale_b = self.scale.reshape(())
        scale_a = amax / fmax
        xq = (x.float() / scale_a).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, self.weight.t(), scale_a, scale_b, out_dtype=torch.bfloat16)

    __call__ = forward

    def dequantize(self) -> torch.Tensor:
        scale = self.scale[:, None] if self.scale.numel() > 1 else self.scale.reshape(())
        return self.weight.float() * scale


def quantize_fp8_rtn(weight: torch.Tensor, group_size: int | None = None, per_channel: bool = False) -> Fp8WeightOnly:
    """Plain (no modelopt) e4m3 quantization, scale = amax / 448 per tensor or per output channel
    (``group_size`` is ignored)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    return _fp8_from_amax(w, amax)


def fp8_from_calibration(cal: Calibration) -> Fp8WeightOnly:
    """modelopt's FP8 weight codes (amax ``[1]`` per tensor or ``[N]`` per channel) as a runtime layer."""
    return _fp8_from_amax(cal.weight.float(), cal.amax.reshape(-1))


def _fp8_from_amax(w: torch.Tensor, amax: torch.Tensor) -> Fp8WeightOnly:
    """Mirrors modelopt's ``_fp8_eager``: codes = e4m3(clamp(w * 448/amax)), scale = 1 / (448/amax)."""
    amax = amax.float()
    safe = torch.where(amax <= _AMAX_EPS, torch.ones_like(amax), amax)
    mult = _FP8_MAX / safe
    bmult = mult[:, None] if mult.numel() > 1 else mult.reshape(())
    codes = (w.float() * bmult).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8WeightOnly(codes, 1 / mult)


def fp8_from_unified(t: UnifiedTensors, layer_cfg: dict) -> Fp8WeightOnly:
    """An ``FP8`` module of a modelopt unified checkpoint (``weight`` e4m3 ``[N, K]``, fp32 ``weight_scale``) as a
    runtime layer. One with a static activation scale (``input_scale``: W8A8) is refused: this format runs weight-only
    (its CPU path dequantizes, its CUDA path takes dynamic activation scales), so it would not compute what the
    checkpoint describes."""
    _check(t.optional("input_scale") is None,
           "FP8 with a static activation scale (input_scale, W8A8) is not a format this engine runs: its fp8 is "
           "weight-only")
    return Fp8WeightOnly(t.require("weight"), t.require("weight_scale").float())
