"""What every runtime weight-only quantized linear shares: the protocol, input handling, the CPU kernel
dispatch, byte accounting and the round-to-nearest arithmetic the quantizers use.

The formats themselves live one per module (:mod:`.int8`, :mod:`.int4`, :mod:`.fp8`) and are listed in
:mod:`.registry`. Each is a small dataclass with ``forward`` (``[..., K]`` in, ``[..., N]`` out in the input's
dtype), ``dequantize`` (fp32 ``[N, K]``), ``nbytes`` (exact bytes of the stored tensors), ``to(device)``, and
``tensors()`` / ``metadata()`` / ``from_tensors()`` for safetensors round trips.

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
tests/model/test_cuda.py checks each against its dequantized weights; they are only reached when the tensors live
on a CUDA device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol, Self, runtime_checkable

import torch

from serve.model import kernels
from serve.model.linear import linear

_INT8_ALIGN = 64
"""``aten._weight_int8pack_mm`` segfaults when x or the weight are not 32/16-byte aligned (seen with
tensors from ``safetensors.load_file`` and sliced bf16 activations); fresh torch CPU allocations are
64-byte aligned, so misaligned operands are copied."""

SMALL_BATCH = 32
"""Rows (tokens) up to which our CPU kernels run as GEMVs; above it a layer is dequantized to fp32 once per
call and multiplied with one GEMM (prefill), which is faster there (bench/quant_decode.py)."""


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

    def dequantize_folded(self) -> torch.Tensor:
        """fp32 ``[N, K]`` with any activation pre-scale (AWQ) folded in, so ``x @ W.T`` equals :meth:`forward`
        up to kernel rounding: what full-precision reference forwards use."""
        ...

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


def _run_cpu_kernel(x2: torch.Tensor, gemv: Callable[[torch.Tensor], torch.Tensor],
                    gemv_q8: Callable[[torch.Tensor], torch.Tensor],
                    dequantize: Callable[[], torch.Tensor]) -> torch.Tensor:
    """fp32 ``[M, N]``: for small batches ``gemv_q8(x)`` when :func:`_q8_activations` accepts x, else
    ``gemv(x)``; above SMALL_BATCH rows one fp32 GEMM on the dequantized weight."""
    xf = x2.to(device="cpu", dtype=torch.float32).contiguous()
    if xf.shape[0] <= SMALL_BATCH:
        return gemv_q8(xf) if _q8_activations(xf) else gemv(xf)
    return linear(xf, dequantize())


def _check_format(meta: dict[str, str] | None, expected: str) -> None:
    if meta is not None and "format" in meta:
        _check(meta["format"] == expected, f"metadata format {meta['format']!r} is not {expected!r}")


class WeightAndScale:
    """What formats stored as one 2-D ``weight [N, K]`` and one scale tensor named ``SCALE`` share (int8's
    ``scales``, fp8's ``scale``): shape, exact bytes, device moves and the safetensors round trip. The
    dataclass that mixes it in takes ``(weight, scale)`` as its two fields."""

    SCALE: ClassVar[str]
    format: ClassVar[str]
    weight: torch.Tensor

    def _scale_tensor(self) -> torch.Tensor:
        return getattr(self, self.SCALE)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.weight, self._scale_tensor())

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def dequantize_folded(self) -> torch.Tensor:
        return self.dequantize()  # no activation scale to fold in

    def to(self, device: torch.device | str) -> Self:
        return type(self)(self.weight.to(device), self._scale_tensor().to(device))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, self.SCALE: self._scale_tensor()}

    def metadata(self) -> dict[str, str]:
        return {"format": self.format}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> Self:
        _check_format(meta, cls.format)
        return cls(tensors["weight"], tensors[cls.SCALE])


# ------------------------------------------------------------------------------- round to nearest

_AMAX_EPS = 1.0 / (1 << 24)
"""modelopt's _tensor_quant / _fp8_eager treat amax <= 2**-24 as zero (whole block -> 0)."""


def _scale(amax: torch.Tensor, max_bound: float) -> torch.Tensor:
    scale = amax.float() / max_bound
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _round_codes(w: torch.Tensor, amax: torch.Tensor, max_bound: float, min_bound: float) -> torch.Tensor:
    """Signed integer codes exactly as modelopt's ``_tensor_quant``: clamp(round(w * (max/amax)))."""
    amax = amax.float()
    mult = torch.tensor(max_bound, dtype=torch.float32) / amax
    mult = torch.where(amax <= _AMAX_EPS, torch.zeros_like(mult), mult)
    return torch.clamp((w.float() * mult).round(), min_bound, max_bound)


@dataclass(frozen=True)
class Calibration:
    """One linear's calibrated weight quantizer, read off a modelopt QuantLinear by the builder
    (builder/quantize.py) so that each format rebuilds modelopt's exact codes without importing modelopt.

    ``amax`` as the quantizer exports it; ``max_bound`` / ``min_bound`` its integer range; ``block_size``
    its weight block (0 when not block-wise); ``pre_quant_scale`` AWQ's activation scale (None without)."""

    weight: torch.Tensor
    amax: torch.Tensor
    max_bound: float
    min_bound: float
    block_size: int = 0
    pre_quant_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class UnifiedTensors:
    """One linear's tensors in a modelopt unified Hugging Face checkpoint (``weight``, ``weight_scale``,
    ``pre_quant_scale``, ``input_scale``, keyed without the module prefix), for the formats' readers
    (:attr:`serve.model.quantized_linear.registry.QuantFormat.from_unified`)."""

    module: str
    tensors: dict[str, torch.Tensor]

    def require(self, name: str) -> torch.Tensor:
        _check(name in self.tensors, f"{self.module}.{name} is missing (tensors: {sorted(self.tensors)})")
        return self.tensors[name]

    def optional(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)
