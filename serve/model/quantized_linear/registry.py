"""The one table of quantization formats: everything the rest of the code base needs to know per format.

A format is a module of this package (its linear class, its round-to-nearest quantizer, how it rebuilds
modelopt's calibrated codes) plus one :class:`QuantFormat` row below. Everything else looks a format up here:
the RTN dispatch (serve/model/rtn.py), safetensors loading (:func:`load_quantized_linear`, engine
directories), the builder's modelopt route (builder/quantize.py, builder/variants.py), the layer bank's fusion
and host packing (serve/morph/layer_bank.py) and the CUDA capability check (serve/morph/plan.py). How
TensorRT-LLM holds the format (:class:`TrtllmForm`: its GEMM kernel's name in NVIDIA's kernel tables, its
``quant_algo``, the bytes of its weights and scales) is here too, for the planner (sim/) and the builder's
TensorRT-LLM checkpoints (builder/levels.py, builder/trtllm_export.py). The precision's name and its
one-character signature code are policy's vocabulary (policy/precisions.py: policy is pure and imports nothing
of ours); :func:`check_registry` keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from policy.precisions import PRECISION_CODE, QUANTIZED_PRECISIONS, check_quantized_precision
from serve.model.quantized_linear.common import Calibration, QuantizedLinear, UnifiedTensors, _check
from serve.model.quantized_linear.fp8 import Fp8WeightOnly, fp8_from_calibration, fp8_from_unified, quantize_fp8_rtn
from serve.model.quantized_linear.int4 import (
    Int4WeightOnly,
    int4_from_calibration,
    int4_from_unified,
    quantize_int4_rtn,
)
from serve.model.quantized_linear.int8 import (
    Int8WeightOnly,
    int8_from_calibration,
    int8_from_unified,
    quantize_int8_rtn,
)


@dataclass(frozen=True)
class ModeloptRecipe:
    """How the builder calibrates a format with NVIDIA modelopt (names, so this table needs no modelopt)."""

    preset: str
    """The ``modelopt.torch.quantization`` preset config, e.g. ``"INT8_WEIGHT_ONLY_CFG"``."""
    export_formats: tuple[str, ...]
    """``modelopt.torch.export.model_config`` constants ``get_quantization_format`` may report for it."""
    method: str
    """How an engine directory's manifest describes the variants."""
    weights_only: bool = False
    """Disable the preset's input quantizers (fp8's stock preset is W8A8; the runtime format is weight-only)."""


SCALE_GRANULARITIES = ("channel", "group", "tensor")


@dataclass(frozen=True)
class TrtllmForm:
    """The format as TensorRT-LLM holds and runs it: what the planner models a GPU deployment with (sim/) and what
    the builder's TensorRT-LLM checkpoints hold (builder/). Our runtime's own tensors may differ (int4 keeps a
    zero point per group for torch's tinygemm kernel); these facts are the deployment's."""

    gemm_dtype: str
    """Its GEMM kernel's dtype in NVIDIA's measured TensorRT-LLM tables (aiconfigurator-core), e.g. ``"int4_wo"``."""
    quant_algo: str
    """TensorRT-LLM's ``quant_algo`` for a module of this format in a checkpoint, e.g. ``"W4A16_AWQ"``."""
    weight_bits: int
    """Bits per weight."""
    scales: str
    """One weight scale per output ``"channel"``, per ``"group"`` of inputs along K, or per ``"tensor"``."""
    scale_bytes: int | None = None
    """Bytes of one scale: None for the weights' own dtype (bf16 / fp16 in an engine), 4 for fp32. modelopt's
    checkpoints store every scaling factor in fp32 (:func:`trtllm_tensor_bytes` takes that as an override)."""
    pre_quant_scale: bool = False
    """AWQ's per-input-channel smoothing scale, in the weights' dtype."""
    group_size: int | None = None
    """The group size of the kernels NVIDIA's tables measured (modelopt INT4_AWQ_CFG's block size)."""
    level: bool = True
    """Whether a morph level's mixed-precision checkpoint may hold it (builder/levels.py)."""


@dataclass(frozen=True)
class QuantFormat:
    """One quantization format: precision name, runtime linear, quantizers and the per-format rules."""

    precision: str
    """The precision name layers, modes and engine directories use ("int8", "int4", "fp8")."""
    linear: type
    """The runtime linear class (a :class:`QuantizedLinear`); its ``format`` names it in safetensors metadata."""
    quantize_rtn: Callable[[torch.Tensor, int], QuantizedLinear]
    """Plain round-to-nearest: ``(weight [N, K], group_size) -> layer`` (formats without groups ignore it)."""
    from_calibration: Callable[[Calibration], QuantizedLinear]
    """modelopt's exact codes from one calibrated weight quantizer (the builder reads it off the module)."""
    from_unified: Callable[[UnifiedTensors, dict], QuantizedLinear]
    """One module of a modelopt unified Hugging Face checkpoint (``export_hf_checkpoint``: its tensors and its
    ``quantized_layers`` entry, whose ``quant_algo`` is :attr:`TrtllmForm.quant_algo`) as a runtime layer."""
    modelopt: ModeloptRecipe
    trtllm: TrtllmForm
    min_cuda_capability: tuple[int, int]
    """The compute capability its CUDA kernel needs."""
    cpu_kernel: bool = True
    """Whether a CPU runs it with a quantized kernel; False: correctness only there (dequantize, fp32 matmul)."""
    grouped: bool = False
    """Whether it quantizes in groups along K and so takes a group size (int4)."""
    fuse: Callable[[list], QuantizedLinear | None] | None = None
    """Fusion rule: one layer computing projections that share an input (q/k/v, gate/up), or None when these
    cannot share a kernel call; no rule: never fused (each runs on its own)."""
    host_pack: Callable[[QuantizedLinear, torch.device], QuantizedLinear] | None = None
    """The layer bank's host copy for a device: a layer whose kernel layout depends on the device comes back
    already packed for it, so a swap is a plain memcpy; no rule: the tensors are copied as they are."""

    @property
    def format(self) -> str:
        return self.linear.format

    @property
    def code(self) -> str:
        """The precision's character in a configuration signature."""
        return PRECISION_CODE[self.precision]


REGISTRY: dict[str, QuantFormat] = {f.precision: f for f in (
    QuantFormat(
        "int8", Int8WeightOnly, quantize_int8_rtn, int8_from_calibration, int8_from_unified,
        ModeloptRecipe("INT8_WEIGHT_ONLY_CFG", ("QUANTIZATION_INT8_WO",),
                       "modelopt INT8_WEIGHT_ONLY_CFG (per-output-channel max calibration)"),
        TrtllmForm("int8_wo", "W8A16", weight_bits=8, scales="channel"),
        min_cuda_capability=(7, 0),
        fuse=Int8WeightOnly.concat,
    ),
    QuantFormat(
        "int4", Int4WeightOnly, quantize_int4_rtn, int4_from_calibration, int4_from_unified,
        ModeloptRecipe("INT4_AWQ_CFG", ("QUANTIZATION_INT4_AWQ",),
                       "modelopt INT4_AWQ_CFG (awq_lite, symmetric, group-wise)"),
        TrtllmForm("int4_wo", "W4A16_AWQ", weight_bits=4, scales="group", pre_quant_scale=True, group_size=128),
        min_cuda_capability=(8, 0),  # tinygemm: Ampere
        grouped=True,
        fuse=Int4WeightOnly.concat,
        host_pack=Int4WeightOnly.for_device_on_host,
    ),
    QuantFormat(
        "fp8", Fp8WeightOnly, quantize_fp8_rtn, fp8_from_calibration, fp8_from_unified,
        ModeloptRecipe("FP8_DEFAULT_CFG", ("QUANTIZATION_FP8", "QUANTIZATION_FP8_PC_PT"),
                       "modelopt FP8_DEFAULT_CFG with input quantizers disabled (e4m3 weights, per-tensor scale)",
                       weights_only=True),
        # level=False: modelopt's fp8 export re-derives the fused q/k/v and gate/up scales (the largest of the
        # three), so a level's fp8 modules would not hold the runtime's fp8 variants (builder/trtllm_export.py)
        TrtllmForm("fp8", "FP8", weight_bits=8, scales="tensor", scale_bytes=4, level=False),
        min_cuda_capability=(8, 9),  # e4m3 _scaled_mm: Ada / Hopper
        cpu_kernel=False,
    ),
)}

FORMATS: dict[str, type] = {f.format: f.linear for f in REGISTRY.values()}
"""Runtime linear class by its safetensors ``format`` name ("int8_wo", ...)."""

_BY_CLASS: dict[type, QuantFormat] = {f.linear: f for f in REGISTRY.values()}
_BY_QUANT_ALGO: dict[str, QuantFormat] = {f.trtllm.quant_algo: f for f in REGISTRY.values()}


def check_registry() -> None:
    """The table and policy's vocabulary name the same precisions, and every format name is unique."""
    if tuple(REGISTRY) != QUANTIZED_PRECISIONS:
        raise RuntimeError(f"quantization registry {tuple(REGISTRY)} differs from policy's {QUANTIZED_PRECISIONS}")
    if len(FORMATS) != len(REGISTRY) or len(_BY_QUANT_ALGO) != len(REGISTRY):
        raise RuntimeError("two quantization formats share a format name or a quant_algo")
    for f in REGISTRY.values():
        if f.trtllm.scales not in SCALE_GRANULARITIES or (f.trtllm.scales == "group") != f.grouped:
            raise RuntimeError(f"{f.precision}: TensorRT-LLM scales {f.trtllm.scales!r} do not match "
                               f"grouped={f.grouped}")


check_registry()


def quant_format(precision: str) -> QuantFormat:
    """The format of a quantized ``precision``; ValueError naming the known ones otherwise."""
    return REGISTRY[check_quantized_precision(precision)]


def format_for_quant_algo(quant_algo: object) -> QuantFormat | None:
    """The format a checkpoint module's ``quant_algo`` names (``"W4A16_AWQ"`` -> int4), or None for one this engine
    does not run."""
    return _BY_QUANT_ALGO.get(quant_algo) if isinstance(quant_algo, str) else None


def format_of(op: object) -> QuantFormat | None:
    """The format a linear op is stored in, or None for anything that is not a quantized linear."""
    return _BY_CLASS.get(type(op))


def fuse_quantized(ops: Sequence[object]) -> QuantizedLinear | None:
    """One quantized layer for ``ops`` when they share a format whose fusion rule accepts them, else None."""
    formats = {format_of(op) for op in ops}
    if len(formats) != 1:
        return None
    fmt = formats.pop()
    if fmt is None or fmt.fuse is None:
        return None
    return fmt.fuse(list(ops))


def host_packed(op: object, device: torch.device) -> object:
    """``op`` as the layer bank keeps it in host memory for ``device`` (see :attr:`QuantFormat.host_pack`)."""
    fmt = format_of(op)
    return op if fmt is None or fmt.host_pack is None else fmt.host_pack(op, device)


def trtllm_tensor_bytes(precision: str, out_features: int, in_features: int, elt: int, *,
                        group_size: int | None = None, scale_bytes: int | None = None) -> tuple[int, int, int]:
    """Bytes of one ``[out_features, in_features]`` linear's tensors at ``precision`` as TensorRT-LLM holds it:
    (weights, weight scales, AWQ pre-quant scale or 0). ``elt``: bytes of the weights' dtype (2 for bf16 / fp16);
    ``group_size``: a grouped format's group (default: the one its kernels were measured at); ``scale_bytes``:
    overrides the format's scale dtype (modelopt's checkpoints: 4, fp32 scaling factors)."""
    form = quant_format(precision).trtllm
    n, k = out_features, in_features
    groups = {"channel": n, "tensor": 1, "group": n * (k // (group_size or form.group_size or k))}[form.scales]
    return (n * k * form.weight_bits // 8, groups * (scale_bytes or form.scale_bytes or elt),
            k * elt if form.pre_quant_scale else 0)


def load_quantized_linear(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> QuantizedLinear:
    """Rebuild any runtime format from ``tensors()`` + ``metadata()`` (dispatching on ``meta['format']``)."""
    fmt = meta.get("format")
    _check(fmt in FORMATS, f"unknown quantized linear format {fmt!r}; known: {sorted(FORMATS)}")
    return FORMATS[fmt].from_tensors(tensors, meta)
