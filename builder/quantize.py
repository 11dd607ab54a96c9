"""Turn decoder-layer ``nn.Linear`` weights into the runtime formats of :mod:`serve.model.quantized_linear`.

Two routes:

- **modelopt** (:func:`quantize_with_modelopt`): runs ``mtq.quantize`` with ``INT8_WEIGHT_ONLY_CFG``
  (per-channel max calibration), ``INT4_AWQ_CFG`` (awq_lite; block size 128 when every decoder
  linear's in_features allows it, else 64, else 32) or ``FP8_DEFAULT_CFG`` with input quantizers
  disabled (weights only), then :func:`extract_quantized_linears` reads each quantizer's calibrated
  ``amax`` (and AWQ's ``pre_quant_scale``) and rebuilds exactly the integer / e4m3 codes modelopt's
  fake quantization uses. modelopt int4 AWQ is symmetric: codes ``q in [-8, 7]`` map to the CPU
  kernel's ``(code - 8) * scale + zero`` as ``code = q + 8``, ``zero = 0``.
- **plain round-to-nearest fallback** (``quantize_*_rtn``, :func:`quantize_model_rtn`): no modelopt,
  no calibration data; int8 per-channel symmetric, int4 symmetric group-wise, fp8 per-tensor or
  per-channel. Fast, meant for tests and quick experiments.

modelopt is imported lazily, so the fallback does not pay its import cost.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from policy.precisions import check_quantized_precision
from serve.model.layers import PROJECTIONS
from serve.model.quantized_linear import REGISTRY, Calibration, QuantFormat, QuantizedLinear, quant_format
from serve.model.rtn import check_int4_block_size, choose_int4_block_size, quantize_linear_rtn

_DECODER_LINEAR_RE = re.compile(r"(^|\.)layers\.(\d+)\.(self_attn|mlp)\.(" + "|".join(PROJECTIONS) + r")$")


ForwardLoop = Callable[[nn.Module], None]


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every decoder-layer q/k/v/o/gate/up/down linear, by its ``named_modules`` name."""
    return {
        name: module
        for name, module in model.named_modules()
        if _DECODER_LINEAR_RE.search(name) and isinstance(module, nn.Linear)
    }


# ------------------------------------------------------------------------------- plain RTN fallback


def quantize_model_rtn(
    model: nn.Module, precision: str, group_size: int | None = None
) -> dict[str, QuantizedLinear]:
    """Plain RTN for every decoder linear; int4 group size defaults to :func:`choose_int4_block_size`."""
    linears = decoder_linears(model)
    if quant_format(precision).grouped and group_size is None:
        group_size = choose_int4_block_size(m.in_features for m in linears.values())
    return {
        name: quantize_linear_rtn(m.weight, precision, group_size or 128) for name, m in linears.items()
    }


# --------------------------------------------------------------------------------------- modelopt


@dataclass
class ModeloptQuantization:
    """Result of :func:`quantize_with_modelopt`.

    ``model`` is the modelopt-quantized (fake-quant) model: its QuantLinear modules are the
    reference the runtime layers are checked against; after AWQ its linear weights are the smoothed
    ones. ``block_size`` is the int4 block size used (None for int8 / fp8)."""

    model: nn.Module
    precision: str
    block_size: int | None
    layers: dict[str, QuantizedLinear] = field(default_factory=dict)


def modelopt_config(precision: str, block_size: int | None = None) -> dict[str, Any]:
    """A private copy of the modelopt preset for ``precision``, adjusted for weight-only use:
    int4 gets ``block_size`` (default 128); fp8 gets its input quantizers disabled."""
    import modelopt.torch.quantization as mtq

    fmt = quant_format(precision)
    cfg = copy.deepcopy(getattr(mtq, fmt.modelopt.preset))
    if fmt.grouped:
        _set_weight_block_size(cfg, block_size or 128)
    if fmt.modelopt.weights_only:
        # Later entries win in modelopt 0.47's ordered quant_cfg list.
        cfg["quant_cfg"].append({"quantizer_name": "*input_quantizer", "enable": False})
    return cfg


def _set_weight_block_size(cfg: dict[str, Any], block_size: int) -> None:
    entries = [e for e in cfg["quant_cfg"] if e.get("quantizer_name") == "*weight_quantizer" and "cfg" in e]
    if not entries:
        raise ValueError("modelopt int4 preset has no '*weight_quantizer' entry to set the block size on")
    for entry in entries:
        entry["cfg"]["block_sizes"][-1] = block_size


def quantize_with_modelopt(
    model: nn.Module,
    precision: str,
    forward_loop: ForwardLoop,
    block_size: int | None = None,
    inplace: bool = False,
) -> ModeloptQuantization:
    """Calibrate with modelopt and extract every decoder linear in the runtime format.

    ``forward_loop(model)`` runs calibration batches through the model (modelopt's ForwardLoop).
    The model is deep-copied first unless ``inplace`` (mtq.quantize swaps modules and AWQ rewrites
    weights). For int4, ``block_size`` defaults to :func:`choose_int4_block_size` of the decoder
    linears' in_features; the one used is reported in the result."""
    import modelopt.torch.quantization as mtq

    grouped = quant_format(precision).grouped
    in_dims = [m.in_features for m in decoder_linears(model).values()]
    if not in_dims:
        raise ValueError("model has no decoder-layer q/k/v/o/gate/up/down linears")
    if grouped:
        block_size = block_size or choose_int4_block_size(in_dims)
        check_int4_block_size(in_dims, block_size)
    else:
        block_size = None
    target = model if inplace else copy.deepcopy(model)
    with torch.no_grad():
        target = mtq.quantize(target, modelopt_config(precision, block_size), forward_loop)
    return ModeloptQuantization(target, precision, block_size, extract_quantized_linears(target, precision))


def extract_quantized_linears(model: nn.Module, precision: str) -> dict[str, QuantizedLinear]:
    """Runtime layers for every decoder linear of a modelopt-quantized model."""
    check_quantized_precision(precision)
    layers = {name: extract_quantized_linear(m, precision) for name, m in decoder_linears(model).items()}
    if not layers:
        raise ValueError("model has no decoder-layer q/k/v/o/gate/up/down linears")
    return layers


def extract_quantized_linear(module: nn.Module, precision: str) -> QuantizedLinear:
    """Runtime layer from one modelopt QuantLinear, reproducing its fake-quant weight codes."""
    fmt = quant_format(precision)
    _check_modelopt_format(module, precision)
    with torch.no_grad():
        return fmt.from_calibration(calibration(module))


def modelopt_format(module: nn.Module) -> QuantFormat | None:
    """The registry format of a modelopt-quantized module (by modelopt's ``get_quantization_format``), or None."""
    from modelopt.torch.export import model_config as mc
    from modelopt.torch.export.quant_utils import get_quantization_format

    found = get_quantization_format(module) if hasattr(module, "weight_quantizer") else None
    return next((f for f in REGISTRY.values()
                 if found in {getattr(mc, name) for name in f.modelopt.export_formats}), None)


def _check_modelopt_format(module: nn.Module, precision: str) -> None:
    from modelopt.torch.export import model_config as mc
    from modelopt.torch.export.quant_utils import get_quantization_format

    expected = {getattr(mc, name) for name in quant_format(precision).modelopt.export_formats}
    found = get_quantization_format(module) if hasattr(module, "weight_quantizer") else None
    if found not in expected:
        raise ValueError(
            f"module is not modelopt-quantized as {precision} (format {found!r}, expected {sorted(expected)})"
        )


def calibration(module: nn.Module) -> Calibration:
    """What a calibrated modelopt QuantLinear's weight quantizer holds, for the formats to rebuild its codes."""
    from modelopt.torch.export.quant_utils import get_prequant_scaling_factor, get_weight_block_size

    wq = module.weight_quantizer
    amax = wq.export_amax()
    if amax is None:
        raise ValueError("weight quantizer has no amax: was the model calibrated?")
    max_bound = float(wq.maxbound)
    min_bound = -max_bound if wq.narrow_range else -max_bound - 1
    return Calibration(module.weight.float(), amax.float(), max_bound, min_bound,
                       get_weight_block_size(module), get_prequant_scaling_factor(module))


def token_batches_loop(batches: Sequence[torch.Tensor]) -> ForwardLoop:
    """A modelopt forward loop feeding ``input_ids`` batches through a causal LM."""

    def loop(model: nn.Module) -> None:
        with torch.no_grad():
            for ids in batches:
                model(input_ids=ids)

    return loop
