"""A modelopt unified Hugging Face checkpoint (``export_hf_checkpoint``): which decoder projections it quantizes, in
which format, and those projections as runtime layers.

Such a directory is a Hugging Face model directory whose config.json carries ``quantization_config`` with
``quant_method: modelopt`` (modelopt's ``convert_hf_quant_config_format`` of the ``hf_quant_config.json`` beside it).
``quantization_config`` is what this module reads: ``MIXED_PRECISION`` names each quantized module and its format in
``quantized_layers``; a single ``quant_algo`` quantizes every linear that ``ignore`` does not exclude. The tensors say
the same thing a second way (a quantized module has a ``weight_scale``), and the two must agree: a module the config
quantizes without scales, or one with scales the config leaves out, is refused. Each module's ``quant_algo`` maps to
one of our formats through the format registry (its ``from_unified`` reader builds the runtime layer); an algorithm
without a format here is refused naming the module and the algorithm, as are a quantized LM head or embedding, a
quantized KV cache and a decoder layer whose projections mix formats (this engine holds one precision per layer).

The result is static: the quantized projections have no full-precision weights beside them, so nothing can morph a
layer back up from it (serve/engine/static_model.py says what an engine does with that).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from serve.model.layers import PROJECTIONS, projection_key
from serve.model.quantized_linear import QuantizedLinear
from serve.model.quantized_linear.common import UnifiedTensors
from serve.model.quantized_linear.registry import REGISTRY, QuantFormat, format_for_quant_algo

QUANT_METHOD = "modelopt"
MIXED_PRECISION = "MIXED_PRECISION"
SCALE = "weight_scale"
MODULE_TENSORS = ("weight", "weight_scale", "pre_quant_scale", "input_scale")
"""Tensor leaves of one quantized linear in modelopt's unified checkpoints (the weight-only and W8A8 formats)."""
_PROJECTION = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(PROJECTIONS) + r")$")


class UnifiedCheckpointError(ValueError):
    """The checkpoint's quantization is one this engine cannot serve (the message says which module and why)."""


@dataclass
class UnifiedQuantization:
    """What a unified checkpoint quantizes: ``layers[i][proj]`` runtime layers, ``precisions[i]`` each quantized
    layer's precision (the registry's names), and the checkpoint's ``quant_algo`` and per-module formats."""

    quant_algo: str
    modules: dict[str, str]
    layers: dict[int, dict[str, QuantizedLinear]] = field(default_factory=dict)

    @property
    def precisions(self) -> dict[int, str]:
        """Each quantized layer's precision (its q_proj's format: a layer holds one, read_quantized checks it)."""
        fmt = {i: format_for_quant_algo(self.modules[projection_key(i, "q_proj")]) for i in sorted(self.layers)}
        return {i: f.precision for i, f in fmt.items() if f is not None}

    def describe(self) -> dict[str, Any]:
        return {"quant_method": QUANT_METHOD, "quant_algo": self.quant_algo,
                "layers": {str(i): p for i, p in self.precisions.items()}}


def quantization_config(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """config.json's modelopt ``quantization_config``, or None for an unquantized directory. Another quantization
    method (GPTQ, AWQ's own, compressed-tensors...) is refused: this engine reads modelopt's."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise UnifiedCheckpointError(f"quantization_config.quant_method {method!r} is not one this engine reads "
                                     f"(it serves modelopt unified checkpoints: quant_method {QUANT_METHOD!r})")
    return qc


def _module_formats(qc: Mapping[str, Any], scaled: set[str]) -> dict[str, dict[str, Any]]:
    """``{module: its quantized_layers entry}`` of every module the config quantizes."""
    algo = qc.get("quant_algo")
    if algo == MIXED_PRECISION:
        layers = qc.get("quantized_layers")
        if not isinstance(layers, dict) or not all(isinstance(v, dict) for v in layers.values()):
            raise UnifiedCheckpointError("quantization_config: MIXED_PRECISION without a quantized_layers map")
        return {m: dict(v) for m, v in layers.items()}
    if not isinstance(algo, str):
        raise UnifiedCheckpointError(f"quantization_config.quant_algo {algo!r} is not a quantization algorithm")
    ignore = [str(p) for p in qc.get("ignore") or []]
    groups = [g.get("weights", {}) for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    group_size = next((w.get("group_size") for w in groups if isinstance(w, dict) and w.get("group_size")), None)
    entry = {"quant_algo": algo, **({"group_size": group_size} if group_size else {})}
    # one algorithm for every linear not ignored: the linears are the modules holding a weight scale
    return {m: dict(entry) for m in sorted(scaled) if not any(fnmatch.fnmatchcase(m, p) for p in ignore)}


def split_tensors(tensors: Mapping[str, torch.Tensor], modules: set[str]) -> tuple[dict[str, dict[str, torch.Tensor]],
                                                                                   dict[str, torch.Tensor]]:
    """``({module: {leaf: tensor}}, the rest)``: each quantized module's tensors by leaf, and every other tensor."""
    per_module: dict[str, dict[str, torch.Tensor]] = {m: {} for m in modules}
    rest: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module in per_module and leaf in MODULE_TENSORS:
            per_module[module][leaf] = t
        else:
            rest[key] = t
    return per_module, rest


def _module_configs(cfg: Mapping[str, Any], names: Iterable[str]) -> dict[str, tuple[QuantFormat, dict[str, Any]]]:
    """``{module: (its format, its quantized_layers entry)}`` of every module the checkpoint quantizes, checked
    against the tensor ``names`` (a quantized module holds a weight scale, nothing else does)."""
    qc = quantization_config(cfg)
    if qc is None:
        return {}
    if qc.get("kv_cache_scheme") or qc.get("kv_cache_quant_algo"):
        raise UnifiedCheckpointError(f"quantization_config quantizes the KV cache ({qc.get('kv_cache_scheme')!r}): "
                                     "this engine does not read KV-cache scales (kv_cache_dtype sets its own)")
    scaled = {k[: -len(SCALE) - 1] for k in names if k.endswith("." + SCALE)}
    formats = _module_formats(qc, scaled)
    unlisted, unscaled = sorted(scaled - set(formats)), sorted(set(formats) - scaled)
    if unlisted or unscaled:
        raise UnifiedCheckpointError(
            "quantization_config and the tensors disagree: " + "; ".join(
                ([f"{', '.join(unlisted[:3])} hold weight scales the config does not quantize"] if unlisted else [])
                + ([f"{', '.join(unscaled[:3])} quantized in the config without a weight_scale tensor"]
                   if unscaled else [])))
    out = {}
    for module, layer_cfg in sorted(formats.items()):
        fmt = format_for_quant_algo(layer_cfg.get("quant_algo"))
        if fmt is None:
            known = ", ".join(f.trtllm.quant_algo for f in REGISTRY.values())
            raise UnifiedCheckpointError(f"{module}: quant_algo {layer_cfg.get('quant_algo')!r} is not a format this "
                                         f"engine runs (it runs {known})")
        out[module] = (fmt, layer_cfg)
    return out


def module_formats(cfg: Mapping[str, Any], names: Iterable[str]) -> dict[str, QuantFormat]:
    """``{module: format}`` of what a checkpoint (its config.json and tensor names) quantizes; empty when nothing.
    UnifiedCheckpointError when the config and tensors disagree or a module's algorithm has no format here."""
    return {m: fmt for m, (fmt, _) in _module_configs(cfg, names).items()}


def read_quantized(cfg: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                   num_layers: int) -> tuple[UnifiedQuantization | None, dict[str, torch.Tensor]]:
    """The checkpoint's quantized decoder projections as runtime layers, and every other tensor (unchanged).
    (None, tensors) for an unquantized checkpoint; UnifiedCheckpointError when it cannot be served."""
    qc = quantization_config(cfg)
    if qc is None:
        return None, dict(tensors)
    configs = _module_configs(cfg, tensors)
    per_module, rest = split_tensors(tensors, set(configs))
    quant = UnifiedQuantization(str(qc["quant_algo"]), {})
    for module, (fmt, layer_cfg) in configs.items():
        algo = fmt.trtllm.quant_algo
        match = _PROJECTION.match(module)
        if match is None or int(match.group(1)) >= num_layers:
            raise UnifiedCheckpointError(f"{module} is quantized ({algo}): this engine runs quantized decoder "
                                         "projections only (q/k/v/o/gate/up/down of its layers)")
        try:
            op = fmt.from_unified(UnifiedTensors(module, per_module[module]), layer_cfg)
        except ValueError as exc:
            raise UnifiedCheckpointError(f"{module} ({algo}): {exc}") from exc
        quant.modules[module] = algo
        quant.layers.setdefault(int(match.group(1)), {})[match.group(2)] = op
    for layer in quant.layers:
        algos = {quant.modules.get(projection_key(layer, p)) for p in PROJECTIONS}
        if len(algos) != 1:
            named = ", ".join(f"{p} {quant.modules.get(projection_key(layer, p)) or 'unquantized'}" for p
                              in PROJECTIONS)
            raise UnifiedCheckpointError(f"layer {layer} mixes formats ({named}): this engine holds one precision "
                                         "per decoder layer")
    return quant, rest
