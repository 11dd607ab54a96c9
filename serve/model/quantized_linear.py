"""Runtime weight-only quantized linear layers that feed aten kernels directly.

(Over ~450 lines on purpose: the three formats share the input, alignment and packing helpers and the
loader; side by side, the byte accounting and the per-device kernel choice are read in one place.)

Three formats, each a small dataclass with ``forward`` (``[..., K]`` in, ``[..., N]`` out in the input's dtype),
``dequantize`` (fp32 ``[N, K]``), ``nbytes`` (exact bytes of the stored tensors), ``to(device)``,
and ``tensors()`` / ``metadata()`` / ``from_tensors()`` for safetensors round trips:

- :class:`Int8WeightOnly`: int8 ``[N, K]`` + bf16 per-output-channel scales; on CPU our AVX2 kernel
  (:mod:`serve.model.kernels`), else ``aten._weight_int8pack_mm``.
- :class:`Int4WeightOnly`: 4-bit codes (0..15) + bf16 ``scale_and_zero [K/group, N, 2]`` with
  ``w = (code - 8) * scale + zero``, optional AWQ ``pre_quant_scale`` applied to activations; on CPU the
  codes are packed for our AVX2 kernel (layout ``"avx2"``), else by
  ``aten._convert_weight_to_int4pack_for_cpu`` for ``aten._weight_int4pack_mm_for_cpu`` (layout ``"cpu"``).
- :class:`Fp8WeightOnly`: e4m3fn ``[N, K]`` + fp32 per-tensor or per-channel scale; correctness only on
  CPU (dequantize then fp32 matmul).

Our CPU kernels (AVX2 + FMA, built once per machine; README "Quantized CPU kernels") read the same integer
weights and bf16 scales. By default (``MORPHSERVE_QACTIVATIONS=int8``) up to :data:`SMALL_BATCH` rows they
round the activations to int8 blocks of 32 values, as llama.cpp does, and use AVX2 integer dot products
(q8act_avx2.cpp: 1.5-1.6x faster per layer than fp32 activations on the 2-core AMD EPYC); results then differ
from the dequantized weight by the activations' rounding (<= 1/254 of a block's largest value).
``MORPHSERVE_QACTIVATIONS=fp32`` keeps fp32 activations (fp32 accumulation: equal to the dequantized weight
to fp32 rounding). Batches above :data:`SMALL_BATCH` rows dequantize to fp32 once and run one GEMM. When
the kernels are unavailable (no AVX2, no compiler, ``MORPHSERVE_QKERNELS=torch``), torch's int kernels
run: they get bf16 activations (30-70x slower with fp32) and return bf16, so their outputs carry bf16
rounding (~3e-3 relative); the result is cast back to fp32.

CUDA paths ran on an NVIDIA H200 (sm90, torch 2.11+cu130) in ``make gpu-check`` on 2026-11-30:
tests/test_cuda.py checks each against its dequantized weights; they are only reached when the tensors live
on a CUDA device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from serve.model import kernels
from serve.model.linear import linear

INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
"""Group sizes accepted by ``aten._weight_int4pack_mm_for_cpu``."""

_INT8_K_MULTIPLE = 16
"""``aten._weight_int8pack_mm`` reads out of bounds (segfault / garbage) unless K % 16 == 0."""

_INT8_ALIGN = 64
"""``aten._weight_int8pack_mm`` segfaults when x or the weight are not 32/16-byte aligned (seen with
tensors from ``safetensors.load_file`` and sliced bf16 activations); fresh torch CPU allocations are
64-byte aligned, so misaligned operands are copied."""

_INT4_N_MULTIPLE = 16
"""``aten._convert_weight_to_int4pack_for_cpu`` requires N % 16 == 0."""

_UNPACK_CHUNK = 1024

SMALL_BATCH = 32
"""Rows (tokens) up to which our CPU kernels run as GEMVs; above it a layer is dequantized to fp32 once per
call and multiplied with one GEMM (prefill), which is faster there (bench/quant_decode.py)."""

_INT4_BLOCK = 32
"""Inputs per 16-byte run of the ``"avx2"`` int4 layout (see :func:`pack_int4_blocked`)."""


@runtime_checkable
class QuantizedLinear(Protocol):
    """What every runtime quantized linear provides."""

    format: ClassVar[str]

    @property
    def in_features(self) -> int: ...

    @property
    def out_features(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def dequantize(self) -> torch.Tensor: ...

    def to(self, device: torch.device | str) -> QuantizedLinear: ...

    def tensors(self) -> dict[str, torch.Tensor]: ...

    def metadata(self) -> dict[str, str]: ...


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _flatten_input(x: torch.Tensor, in_features: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    _check(
        x.shape[-1] == in_features,
        f"input has {x.shape[-1]} features, layer expects {in_features}",
    )
    return x.reshape(-1, in_features), tuple(x.shape[:-1])


def _q8_activations(x2: torch.Tensor) -> bool:
    """Whether the CPU kernels round this ``[M, K]`` input's activations to int8 (q8act_avx2.cpp): a GEMV-sized
    batch (M <= SMALL_BATCH), K a multiple of 32, and int8 activations on (:func:`kernels.int8_activations`)."""
    return x2.shape[0] <= SMALL_BATCH and x2.shape[1] % 32 == 0 and kernels.int8_activations()


def _q8_gemv_input(x: torch.Tensor, in_features: int) -> bool:
    """Whether ``x`` goes straight to an int8-activation kernel, skipping the general path: a contiguous fp32
    CPU ``[M, in_features]`` that :func:`_q8_activations` accepts. Every decode step's calls qualify. The
    general path's reshapes, casts, device moves and closures cost 25-45 us per call against a 30-110 us
    kernel at one row (an ad-hoc timeit of one SmolLM2 layer on the 2-core AMD EPYC), at 120 layer calls
    per decoded token."""
    return (x.dim() == 2 and x.shape[1] == in_features and x.dtype == torch.float32 and not x.is_cuda
            and x.is_contiguous() and _q8_activations(x))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % _INT8_ALIGN == 0 else t.clone()


def _is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """Outputs come back in the activations' dtype (fp32 on CPU, the model's bf16/fp16 on CUDA), so a
    quantized layer drops into any model dtype; non-float inputs get fp32."""
    return x.dtype if x.dtype.is_floating_point else torch.float32


# --------------------------------------------------------------------------------------------- int8


@dataclass(eq=False)
class Int8WeightOnly:
    """int8 ``weight [N, K]`` (symmetric, per output channel) with bf16 ``scales [N]``."""

    weight: torch.Tensor
    scales: torch.Tensor
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

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.weight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = None if _is_cuda(self.weight) else kernels.ops()
        if ops is not None and _q8_gemv_input(x, self.in_features):
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
        # Checked on an H200 (tests/test_cuda.py): aten._weight_int8pack_mm has no CUDA kernel, so upcast the int8
        # weight to bf16 and scale the output columns.
        return torch.mm(xb, self.weight.to(torch.bfloat16).t()) * self.scales

    __call__ = forward

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]

    def to(self, device: torch.device | str) -> Int8WeightOnly:
        return Int8WeightOnly(self.weight.to(device), self.scales.to(device))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scales": self.scales}

    def metadata(self) -> dict[str, str]:
        return {"format": self.format}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> Int8WeightOnly:
        _check_format(meta, cls.format)
        return cls(tensors["weight"], tensors["scales"])


# --------------------------------------------------------------------------------------------- int4


def _validate_int4_shape(n: int, k: int, group_size: int) -> None:
    _check(
        group_size in INT4_GROUP_SIZES,
        f"int4 group size must be one of {INT4_GROUP_SIZES} (CPU kernel limit), got {group_size}",
    )
    _check(
        k % group_size == 0,
        f"int4 group size {group_size} does not divide in_features {k}; "
        f"use a group size that divides it (e.g. 64 or 32 for a hidden size of 576)",
    )
    _check(
        n % _INT4_N_MULTIPLE == 0,
        f"int4 CPU kernel needs out_features divisible by {_INT4_N_MULTIPLE}, got {n}",
    )


def pack_int4_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Portable storage packing: codes ``[N, K]`` in 0..15 -> uint8 ``[N, K/2]``,
    low nibble = even k, high nibble = odd k."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_int4_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_nibbles`: uint8 ``[N, K/2]`` -> int32 codes ``[N, K]``."""
    low = (packed & 0x0F).to(torch.int32)
    high = (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def pack_int4_blocked(codes: torch.Tensor) -> torch.Tensor:
    """Our CPU kernel's layout (``"avx2"``): codes ``[N, K]`` in 0..15, K a multiple of 32 -> uint8
    ``[N, K/2]``; per row, each run of 32 inputs is 16 bytes, byte j = code[32b + j] | code[32b + 16 + j] << 4
    (one 16-byte load unpacks to two runs of 16 consecutive inputs)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // _INT4_BLOCK, 2, _INT4_BLOCK // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4_blocked(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_blocked`: uint8 ``[N, K/2]`` -> int32 codes ``[N, K]``."""
    n = packed.shape[0]
    p = packed.reshape(n, -1, _INT4_BLOCK // 2)
    return torch.stack([p & 0x0F, p >> 4], dim=2).reshape(n, -1).to(torch.int32)


def _cpu_int4_layout() -> str:
    return "avx2" if kernels.ops() is not None else "cpu"


def _layout_device(layout: str) -> str:
    return "cpu" if layout == "avx2" else layout


def _pack_int4_for_kernel(codes: torch.Tensor, device: torch.device, layout: str | None = None) -> torch.Tensor:
    """Codes packed for ``device``'s kernel; on CPU ``layout`` (default: ours when it is available)."""
    codes = codes.to(torch.int32)
    if device.type == "cuda":
        return _pack_int4_cuda(codes.to(device))
    if (layout or _cpu_int4_layout()) == "avx2":
        return pack_int4_blocked(codes.cpu())
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.cpu().contiguous(), 1)


def _run_cpu_kernel(x2: torch.Tensor, gemv, gemv_q8, dequantize) -> torch.Tensor:
    """fp32 ``[M, N]``: for small batches ``gemv_q8(x)`` when :func:`_q8_activations` accepts x, else
    ``gemv(x)``; above SMALL_BATCH rows one fp32 GEMM on the dequantized weight."""
    xf = x2.to(device="cpu", dtype=torch.float32).contiguous()
    if xf.shape[0] <= SMALL_BATCH:
        return gemv_q8(xf) if _q8_activations(xf) else gemv(xf)
    return linear(xf, dequantize())


def _pack_int4_cuda(codes: torch.Tensor) -> torch.Tensor:
    # Checked on an H200 (codes identical after repacking): the CUDA tinygemm packer takes uint8 [N, K/2] with the *even* k in the
    # high nibble (as torchao does) and returns an int32 tiled layout.
    k = codes.shape[1]
    inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
    nibbles = ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack(nibbles, inner_k_tiles)


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
        if self.layout == "avx2" and _q8_gemv_input(x, self.in_features):
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
        for start in range(0, k, _UNPACK_CHUNK):
            stop = min(start + _UNPACK_CHUNK, k)
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


# ---------------------------------------------------------------------------------------------- fp8


@dataclass(eq=False)
class Fp8WeightOnly:
    """e4m3fn ``weight [N, K]`` with fp32 ``scale`` (shape ``[]``/``[1]`` per-tensor or ``[N]``
    per-channel); ``w = weight * scale``.

    Not a fast path on CPU: fp8 is a GPU (Hopper+) format, so on CPU the weight is dequantized and
    multiplied in fp32 (slower than plain fp32, but bit-faithful to modelopt's fake quantization).
    On CUDA (checked on an H200, sm89+) activations are quantized dynamically to e4m3 and ``torch._scaled_mm`` is
    used, i.e. W8A8 numerics rather than the exact weight-only result.
    """

    weight: torch.Tensor
    scale: torch.Tensor
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

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.weight, self.scale)

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

    def to(self, device: torch.device | str) -> Fp8WeightOnly:
        return Fp8WeightOnly(self.weight.to(device), self.scale.to(device))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scale": self.scale}

    def metadata(self) -> dict[str, str]:
        return {"format": self.format}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> Fp8WeightOnly:
        _check_format(meta, cls.format)
        return cls(tensors["weight"], tensors["scale"])


# ------------------------------------------------------------------------------------------ loading

FORMATS: dict[str, type] = {cls.format: cls for cls in (Int8WeightOnly, Int4WeightOnly, Fp8WeightOnly)}


def _check_format(meta: dict[str, str] | None, expected: str) -> None:
    if meta is not None and "format" in meta:
        _check(meta["format"] == expected, f"metadata format {meta['format']!r} is not {expected!r}")


def load_quantized_linear(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> QuantizedLinear:
    """Rebuild any runtime format from ``tensors()`` + ``metadata()`` (dispatching on ``meta['format']``)."""
    fmt = meta.get("format")
    _check(fmt in FORMATS, f"unknown quantized linear format {fmt!r}; known: {sorted(FORMATS)}")
    return FORMATS[fmt].from_tensors(tensors, meta)
