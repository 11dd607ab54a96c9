"""int4 weight-only: 4-bit codes (0..15) + bf16 ``scale_and_zero [K/group, N, 2]`` with
``w = (code - 8) * scale + zero``, optional AWQ ``pre_quant_scale`` applied to activations; on CPU the codes are
packed for our AVX2 kernel (layout ``"avx2"``), else by ``aten._convert_weight_to_int4pack_for_cpu`` for
``aten._weight_int4pack_mm_for_cpu`` (layout ``"cpu"``); on CUDA the tinygemm layout (layout ``"cuda"``).
The layouts themselves are in :mod:`.int4_packing`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from serve.model import kernels
from serve.model.quantized_linear import common
from serve.model.quantized_linear.common import (
    Calibration,
    UnifiedTensors,
    _check,
    _check_format,
    _flatten_input,
    _is_cuda,
    _out_dtype,
    _round_codes,
    _run_cpu_kernel,
    _scale,
    _tensor_bytes,
)
from serve.model.quantized_linear.int4_packing import (
    _cpu_int4_layout,
    _layout_device,
    _pack_int4_for_kernel,
    _validate_int4_shape,
    check_int4_block_size,
    pack_int4_nibbles,
    unpack_int4_blocked,
    unpack_int4_nibbles,
    unpack_int4_out_pairs,
)

_INT4_MAX = 7.0

_UNPACK_TILE = 1024
"""Identity rows per kernel call when :meth:`Int4WeightOnly.codes` recovers codes through an aten kernel."""


@dataclass(eq=False)
class Int4WeightOnly:
    """Group-wise 4-bit weight, ``packed`` for the kernel named by ``layout``.

    ``"avx2"``: :func:`pack_int4_blocked` for our CPU kernel (codes read directly). ``"cpu"``: whatever
    ``_convert_weight_to_int4pack_for_cpu`` produced on this machine (its layout depends on the CPU's
    vector width, AVX2 vs AVX-512). ``"cuda"``: the tinygemm layout. None is serialised as is:
    :meth:`tensors` stores the portable nibble layout of :func:`pack_int4_nibbles` instead, and
    :meth:`from_tensors` repacks. Codes are recovered by running the kernel itself on an identity
    matrix with scale 1 / zero 8 (exact: integers 0..15 survive bf16), so no layout is assumed.
    """

    packed: torch.Tensor
    scale_and_zero: torch.Tensor
    group_size: int
    in_features: int
    pre_quant_scale: torch.Tensor | None = None
    layout: str = ""  # the kernel ``packed`` is laid out for ("avx2" | "cpu" | "cuda"); default: the device's
    format: ClassVar[str] = "int4_wo"

    def __post_init__(self) -> None:
        _check(
            self.scale_and_zero.dim() == 3 and self.scale_and_zero.shape[2] == 2,
            f"scale_and_zero must be [K/group, N, 2], got {tuple(self.scale_and_zero.shape)}",
        )
        n = self.scale_and_zero.shape[1]
        _validate_int4_shape(n, self.in_features, self.group_size)
        self.layout = self.layout or self.packed.device.type
        _check(self.layout in ("avx2", "cpu", "cuda"),
               f"int4 packed layout must be avx2, cpu or cuda, got {self.layout!r}")
        _check(
            self.scale_and_zero.shape[0] == self.in_features // self.group_size,
            f"scale_and_zero has {self.scale_and_zero.shape[0]} groups, expected "
            f"{self.in_features // self.group_size}",
        )
        self.scale_and_zero = self.scale_and_zero.to(torch.bfloat16).contiguous()
        if self.pre_quant_scale is not None:
            _check(
                tuple(self.pre_quant_scale.shape) == (self.in_features,),
                f"pre_quant_scale must have shape ({self.in_features},), "
                f"got {tuple(self.pre_quant_scale.shape)}",
            )
            self.pre_quant_scale = self.pre_quant_scale.float().contiguous()

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        group_size: int,
        zeros: torch.Tensor | None = None,
        pre_quant_scale: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> Int4WeightOnly:
        """From unsigned codes ``[N, K]`` in 0..15 and per-group ``scales``/``zeros`` ``[N, K/group]``;
        ``w = (code - 8) * scale + zero`` (``zeros`` default to 0, i.e. symmetric int4)."""
        _check(codes.dim() == 2, f"int4 codes must be 2-D, got shape {tuple(codes.shape)}")
        n, k = codes.shape
        _validate_int4_shape(n, k, group_size)
        _check(
            int(codes.min()) >= 0 and int(codes.max()) <= 15,
            "int4 codes must lie in [0, 15] (signed value + 8)",
        )
        _check(
            tuple(scales.shape) == (n, k // group_size),
            f"int4 scales must have shape ({n}, {k // group_size}), got {tuple(scales.shape)}",
        )
        if zeros is None:
            zeros = torch.zeros_like(scales)
        scale_and_zero = torch.stack([scales.float().t(), zeros.float().t()], dim=-1)
        device = torch.device(device)
        pqs = None if pre_quant_scale is None else pre_quant_scale.to(device)
        layout = device.type if device.type == "cuda" else _cpu_int4_layout()
        return cls(
            _pack_int4_for_kernel(codes, device, layout),
            scale_and_zero.to(device),
            group_size,
            k,
            pqs,
            layout,
        )

    @property
    def out_features(self) -> int:
        return self.scale_and_zero.shape[1]

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.packed, self.scale_and_zero, self.pre_quant_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "avx2" and common._q8_gemv_input(x, self.in_features):
            ops = kernels.ops()
            if ops is not None:
                xs = x if self.pre_quant_scale is None else x * self.pre_quant_scale
                return ops.int4_linear_q8(xs, self.packed, self.scale_and_zero, self.group_size)
        x2, lead = _flatten_input(x, self.in_features)
        x2 = x2.to(self.packed.device)
        if self.pre_quant_scale is not None:
            x2 = x2.float() * self.pre_quant_scale
        if self.layout == "avx2":
            y = self._mm_avx2(x2)
        else:
            y = self._mm(x2.to(torch.bfloat16).contiguous(), self.scale_and_zero)
        return y.to(_out_dtype(x)).reshape(*lead, self.out_features)

    def _mm_avx2(self, x2: torch.Tensor) -> torch.Tensor:
        ops = kernels.ops()
        if ops is None:
            raise RuntimeError("int4 weight packed for our AVX2 kernel, but the kernels are unavailable")
        return _run_cpu_kernel(
            x2, lambda xf: ops.int4_linear(xf, self.packed, self.scale_and_zero, self.group_size),
            lambda xf: ops.int4_linear_q8(xf, self.packed, self.scale_and_zero, self.group_size),
            lambda: ops.int4_dequantize(self.packed, self.scale_and_zero, self.group_size))

    def _mm(self, xb: torch.Tensor, scale_and_zero: torch.Tensor) -> torch.Tensor:
        if _layout_device(self.layout) != self.packed.device.type:
            raise RuntimeError(f"int4 weight packed for {self.layout} lies on {self.packed.device.type}: it is a "
                               "host staging copy; move it with .to(device) before running it")
        if _is_cuda(self.packed):
            # CUDA tinygemm kernel (sm80+; checked on an H200), same (code - 8) * scale + zero semantics.
            return torch.ops.aten._weight_int4pack_mm(xb, self.packed, self.group_size, scale_and_zero)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group_size, scale_and_zero)

    __call__ = forward

    def codes(self) -> torch.Tensor:
        """Unsigned codes ``[N, K]`` (int32, 0..15): unpacked (``"avx2"``) or recovered through the aten
        kernel itself."""
        if self.layout == "avx2":
            return unpack_int4_blocked(self.packed.cpu())
        if self.layout != self.packed.device.type:
            return self.to(self.layout).codes()
        k, n = self.in_features, self.out_features
        unit = torch.zeros(k // self.group_size, n, 2, dtype=torch.bfloat16, device=self.packed.device)
        unit[..., 0] = 1.0
        unit[..., 1] = 8.0  # (code - 8) * 1 + 8 == code
        out = torch.empty(k, n, dtype=torch.int32, device=self.packed.device)
        for start in range(0, k, _UNPACK_TILE):
            stop = min(start + _UNPACK_TILE, k)
            eye = torch.zeros(stop - start, k, dtype=torch.bfloat16, device=self.packed.device)
            eye[:, start:stop] = torch.eye(stop - start, dtype=torch.bfloat16, device=self.packed.device)
            out[start:stop] = self._mm(eye, unit).round().to(torch.int32)
        return out.t().contiguous()

    def scales_and_zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``scales``, ``zeros``, both ``[N, K/group]``."""
        sz = self.scale_and_zero.float()
        return sz[..., 0].t().contiguous(), sz[..., 1].t().contiguous()

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[N, K]`` exactly as the kernel sees it (bf16 scale/zero, fp32 arithmetic); AWQ's
        ``pre_quant_scale`` is *not* folded in (it scales activations, see :meth:`forward`)."""
        scales, zeros = (t.repeat_interleave(self.group_size, dim=1) for t in self.scales_and_zeros())
        return (self.codes().float() - 8.0) * scales + zeros

    def dequantize_folded(self) -> torch.Tensor:
        """fp32 ``[N, K]`` with ``pre_quant_scale`` folded in: ``x @ W.T`` equals :meth:`forward`
        up to kernel rounding. Use this for full-precision reference forwards."""
        w = self.dequantize()
        return w if self.pre_quant_scale is None else w * self.pre_quant_scale.float()[None, :]

    def to(self, device: torch.device | str) -> Int4WeightOnly:
        """A copy for ``device``, repacked when the kernel layout differs (CPU and CUDA int4 layouts do)."""
        device = torch.device(device)
        pqs = None if self.pre_quant_scale is None else self.pre_quant_scale.to(device)
        if device.type == _layout_device(self.layout):
            packed, layout = self.packed.to(device), self.layout
        else:
            layout = device.type if device.type == "cuda" else _cpu_int4_layout()
            packed = _pack_int4_for_kernel(self.codes().cpu(), device, layout)
        return Int4WeightOnly(packed, self.scale_and_zero.to(device), self.group_size, self.in_features, pqs,
                              layout)

    def for_device_on_host(self, device: torch.device | str) -> Int4WeightOnly:
        """A host (CPU) copy already packed for ``device``'s kernel: the layer bank's source for swap copies
        (pinned by the bank on CUDA), so a swap is a plain memcpy whatever the device."""
        on_device = self.to(device)
        if on_device.packed.device.type == "cpu":
            return on_device
        pqs = None if on_device.pre_quant_scale is None else on_device.pre_quant_scale.cpu()
        return Int4WeightOnly(on_device.packed.cpu(), on_device.scale_and_zero.cpu(), self.group_size,
                              self.in_features, pqs, on_device.layout)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "qweight": pack_int4_nibbles(self.codes().cpu()),
            "scale_and_zero": self.scale_and_zero.cpu(),
        }
        if self.pre_quant_scale is not None:
            out["pre_quant_scale"] = self.pre_quant_scale.cpu()
        return out

    def metadata(self) -> dict[str, str]:
        return {"format": self.format, "group_size": str(self.group_size)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> Int4WeightOnly:
        _check_format(meta, cls.format)
        _check(meta is not None and "group_size" in meta, "int4 metadata needs 'group_size'")
        group_size = int(meta["group_size"])
        codes = unpack_int4_nibbles(tensors["qweight"])
        sz = tensors["scale_and_zero"]
        _check(
            sz.dim() == 3 and sz.shape[1] == codes.shape[0],
            f"scale_and_zero shape {tuple(sz.shape)} does not match qweight rows {codes.shape[0]}",
        )
        _validate_int4_shape(codes.shape[0], codes.shape[1], group_size)
        pqs = tensors.get("pre_quant_scale")
        layout = _cpu_int4_layout()
        return cls(_pack_int4_for_kernel(codes, torch.device("cpu"), layout), sz, group_size, codes.shape[1], pqs,
                   layout)

    @classmethod
    def concat(cls, ops: list[Int4WeightOnly]) -> Int4WeightOnly | None:
        """One layer computing ``ops`` side by side (fused q/k/v, gate/up), or None when they cannot share a
        kernel call: only ``"avx2"`` layers (rows are independent there) with one group size, one input
        size and the same ``pre_quant_scale`` (AWQ may give each projection its own)."""
        first = ops[0]
        if any(op.layout != "avx2" or op.group_size != first.group_size or op.in_features != first.in_features
               for op in ops):
            return None
        pqs = [op.pre_quant_scale for op in ops]
        if any(p is not None for p in pqs) and not all(p is not None and torch.equal(p, pqs[0]) for p in pqs):
            return None
        return cls(torch.cat([op.packed for op in ops]), torch.cat([op.scale_and_zero for op in ops], dim=1),
                   first.group_size, first.in_features, first.pre_quant_scale, "avx2")


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


def int4_from_calibration(cal: Calibration) -> Int4WeightOnly:
    """modelopt's INT4 AWQ codes (symmetric, block-wise; ``q in [-8, 7]`` stored as ``code = q + 8``,
    ``zero = 0``) with AWQ's ``pre_quant_scale``, as a runtime layer."""
    block = cal.block_size
    w = cal.weight.float()
    n, k = w.shape
    check_int4_block_size([k], block)
    amax = cal.amax.reshape(n, k // block)
    groups = w.reshape(n, k // block, block)
    q = _round_codes(groups, amax[..., None], cal.max_bound, cal.min_bound)
    pqs = cal.pre_quant_scale
    return Int4WeightOnly.from_codes(
        q.reshape(n, k) + 8,
        _scale(amax, cal.max_bound),
        block,
        # a copy: modelopt updates its quantizer's scale in place (its exports re-smooth fused projections), and a
        # shared one would change this layer's activation scale under codes made for the old one
        pre_quant_scale=None if pqs is None else pqs.detach().float().reshape(k).clone(),
    )


def int4_from_unified(t: UnifiedTensors, layer_cfg: dict) -> Int4WeightOnly:
    """A ``W4A16_AWQ`` module of a modelopt unified checkpoint (``weight`` uint8 ``[N/2, K]``, ``weight_scale`` fp32
    ``[N, K/group]``, no zero point, optional ``pre_quant_scale [K]``) as a runtime layer."""
    _check(not layer_cfg.get("has_zero_point", False), "W4A16_AWQ with a zero point is not a format this engine runs")
    codes = unpack_int4_out_pairs(t.require("weight"))
    scales = t.require("weight_scale").float()
    n, k = codes.shape
    _check(scales.dim() == 2 and scales.shape[0] == n and scales.shape[1] > 0 and k % scales.shape[1] == 0,
           f"weight_scale {tuple(scales.shape)} does not fit weight codes {(n, k)}")
    group = k // scales.shape[1]
    _check(layer_cfg.get("group_size", group) == group,
           f"group_size {layer_cfg.get('group_size')} in the config, {group} in the tensors")
    # the config's pre_quant_scale flag says the format is AWQ's; modelopt folds the scale of projections that share
    # an input into the norm before them, so the tensor is there only where it was not folded
    pqs = t.optional("pre_quant_scale")
    return Int4WeightOnly.from_codes(codes, scales, group, pre_quant_scale=None if pqs is None else pqs.float())
