"""Morph levels: the layer configurations the controller can reach, one TensorRT-LLM checkpoint each.

A TensorRT-LLM engine has its precisions fixed at compile time, so a GPU deployment of MorphServe needs one
engine per configuration it may switch to. A *level* names one such configuration as segments of the LIS
swap order (``manifest.json`` ``swap_order``)::

    int4@25             the first 25 % of the swap order at int4, every other layer at full precision
    int4@12+int8@25     swap-order positions [0, 12 %) at int4 and [12 %, 25 %) at int8

A percentage covers ``floor(pct / 100 * num_layers)`` layers, the rounding of the controller's
``max_quantized_layers`` (policy/controller.py), so ``int4@50`` is exactly the default mode's cap.

Default levels (:func:`default_levels`) come from policy/modes.py: for every dynamic mode, its first ladder step
at 25 / 50 / 75 % up to the mode's ``max_quantized_fraction``, and every later ladder step at that cap (where the
ladder moves layers once the cap is reached). With today's modes: ``int8@25`` (accuracy), ``int4@25``
(default, performance, accuracy's last ladder step), ``int4@50`` (default, performance), ``int4@75``
(performance). The static modes (every layer at one precision) are the whole-model checkpoints
``trtllm/int8`` and ``trtllm/int4``.

This module is stdlib-only at import (the CLI parses specs without importing torch): the precisions a level may
use come from policy's modes, the byte accounting reads the format registry (which imports torch) when called and
takes a :class:`serve.model.model_config.ModelConfig`-like object.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from policy.modes import MODES
from policy.precisions import QUANTIZED_PRECISIONS

LEVEL_PRECISIONS: tuple[str, ...] = tuple(p for p in QUANTIZED_PRECISIONS if any(p in m.ladder for m in MODES.values()))
"""Precisions a level may use: those of the modes' ladders (policy/modes.py; today int8 and int4), in policy's
order. Each must be one a level checkpoint can hold (the format registry's ``TrtllmForm.level``; fp8's is not,
tests/builder/test_trtllm_levels.py checks it); the whole-model fp8 checkpoint stays at trtllm/fp8."""
QUARTILES: tuple[int, ...] = (25, 50, 75)
DEFAULT = "default"
NONE = "none"
_SEGMENT = re.compile(r"^([a-z0-9]+)@(\d+(?:\.\d+)?)$")


class LevelSpecError(ValueError):
    """A --levels value that does not parse."""


@dataclass(frozen=True)
class Segment:
    precision: str
    percent: float

    def __str__(self) -> str:
        return f"{self.precision}@{_fmt(self.percent)}"


@dataclass(frozen=True)
class Level:
    segments: tuple[Segment, ...]

    @property
    def name(self) -> str:
        return "+".join(map(str, self.segments))

    @property
    def dirname(self) -> str:
        return "_".join(f"{s.precision}-{_fmt(s.percent)}" for s in self.segments)

    @property
    def precisions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.precision for s in self.segments))

    def layer_precisions(self, swap_order: list[int]) -> dict[int, str]:
        """``{layer: precision}`` of the quantized layers, in swap order (empty segments contribute nothing)."""
        out: dict[int, str] = {}
        start = 0
        for seg in self.segments:
            end = layers_at(seg.percent, len(swap_order))
            for layer in swap_order[start:end]:
                out[layer] = seg.precision
            start = max(start, end)
        return out


def _fmt(pct: float) -> str:
    return f"{pct:g}"


def layers_at(percent: float, num_layers: int) -> int:
    """Layers a percentage of the swap order covers: floor, like MorphController.max_quantized_layers."""
    return math.floor(percent / 100 * num_layers + 1e-9)


def parse_level(text: str) -> Level:
    segments = []
    for part in text.strip().split("+"):
        m = _SEGMENT.match(part.strip())
        if m is None:
            raise LevelSpecError(f"level {text!r}: expected PRECISION@PERCENT[+PRECISION@PERCENT...], e.g. int4@50")
        precision, pct = m.group(1), float(m.group(2))
        if precision not in LEVEL_PRECISIONS:
            raise LevelSpecError(f"level {text!r}: precision {precision!r} is not a ladder precision; "
                                 f"choose from {', '.join(LEVEL_PRECISIONS)}")
        if not 0 < pct <= 100:
            raise LevelSpecError(f"level {text!r}: percentage {_fmt(pct)} is outside (0, 100]")
        segments.append(Segment(precision, pct))
    pcts = [s.percent for s in segments]
    if pcts != sorted(set(pcts)):
        raise LevelSpecError(f"level {text!r}: segment percentages must increase ({', '.join(map(_fmt, pcts))})")
    if len({s.precision for s in segments}) != len(segments):
        raise LevelSpecError(f"level {text!r}: a precision appears in two segments")
    return Level(tuple(segments))


def parse_levels(value: str) -> tuple[str, ...] | None:
    """``--levels``: "default" -> None (use :func:`default_levels`), "none" -> (), else canonical names."""
    value = value.strip()
    if value == DEFAULT:
        return None
    if value in (NONE, ""):
        return ()
    names = [parse_level(part).name for part in value.split(",") if part.strip()]
    if not names:
        raise LevelSpecError("no level given")
    return tuple(dict.fromkeys(names))


def default_levels() -> tuple[str, ...]:
    """The levels the dynamic modes of policy/modes.py can reach (see the module docstring)."""
    out: list[str] = []
    for mode in MODES.values():
        if mode.strategy != "dynamic" or not mode.ladder:
            continue
        cap = mode.max_quantized_fraction * 100
        out += [str(Segment(mode.ladder[0], q)) for q in QUARTILES if q <= cap + 1e-9]
        out += [str(Segment(step, cap)) for step in mode.ladder[1:]]
    ordered = sorted(dict.fromkeys(out), key=lambda n: (parse_level(n).segments[-1].percent,
                                                        LEVEL_PRECISIONS.index(parse_level(n).precisions[0])))
    return tuple(ordered)


def reaching_modes(layer_precisions: dict[int, str], swap_order: list[int]) -> list[str]:
    """Modes whose controller can hold exactly this configuration (dynamic: in swap order, under the cap,
    later ladder steps only once the cap is reached and taken from the front of the order; static: all layers)."""
    n = len(swap_order)
    count = len(layer_precisions)
    prefix = swap_order[:count]
    if sorted(prefix) != sorted(layer_precisions):
        return []
    steps = [layer_precisions[layer] for layer in prefix]
    out = []
    for name, mode in MODES.items():
        if mode.strategy == "off" or not mode.ladder or any(r not in mode.ladder for r in steps):
            continue
        cap = math.floor(mode.max_quantized_fraction * n + 1e-9)
        if mode.strategy == "static":
            if count == n and set(steps) == {mode.ladder[0]}:
                out.append(name)
            continue
        idx = [mode.ladder.index(r) for r in steps]
        if count > cap or idx != sorted(idx, reverse=True):
            continue  # beyond the cap, or a milder ladder step ahead of a harsher one in swap order
        if max(idx) > 0 and count != cap:
            continue  # layers move down the ladder only once the cap is reached
        out.append(name)
    return out


def plan_levels(names: list[str], swap_order: list[int],
                skipped: list[dict[str, str]]) -> tuple[list[tuple[str, Level, dict[int, str]]], list[dict[str, str]]]:
    """The levels to export, each with its ``{layer: precision}``, and ``skipped`` plus the ones left out (a segment
    covering no layer, or the same layers as an earlier level), each with its reason."""
    planned: list[tuple[str, Level, dict[int, str]]] = []
    skipped = list(skipped)
    seen: dict[tuple, str] = {}
    for name in names:
        level = parse_level(name)
        layer_precisions = level.layer_precisions(swap_order)
        key = tuple(sorted(layer_precisions.items()))
        empty = [str(s) for s in level.segments if layers_at(s.percent, len(swap_order)) <= 0]
        if not layer_precisions or empty:
            skipped.append({"level": name,
                            "reason": f"{', '.join(empty) or name} covers 0 of {len(swap_order)} layers"})
        elif key in seen:
            skipped.append({"level": name, "reason": f"same layers as {seen[key]}"})
        else:
            seen[key] = name
            planned.append((name, level, layer_precisions))
    return planned, skipped


def level_entry(level: Level, layer_precisions: dict[int, str], swap_order: list[int]) -> dict[str, Any]:
    """A level's manifest entry before its export: segments with their layers, ``{layer: precision}``, the modes
    that reach it."""
    return {
        "segments": [{"precision": s.precision, "percent": int(s.percent) if s.percent.is_integer() else s.percent,
                      "layers": [l for l, p in layer_precisions.items() if p == s.precision]}
                     for s in level.segments],
        "layers": {str(l): p for l, p in layer_precisions.items()},
        "num_quantized": len(layer_precisions),
        "reached_by_modes": reaching_modes(layer_precisions, swap_order),
    }


# ------------------------------------------------------------------------- TensorRT-LLM byte accounting

# TensorRT-LLM llama module -> (out_features, in_features) as functions of the model config.
TRTLLM_LINEARS: dict[str, Any] = {
    "attention.qkv": lambda c: (c.q_size + 2 * c.kv_size, c.hidden_size),
    "attention.dense": lambda c: (c.hidden_size, c.q_size),
    "mlp.fc": lambda c: (c.intermediate_size, c.hidden_size),     # gate_proj (activation side)
    "mlp.gate": lambda c: (c.intermediate_size, c.hidden_size),   # up_proj
    "mlp.proj": lambda c: (c.hidden_size, c.intermediate_size),   # down_proj
}
"""The five linears of a TensorRT-LLM llama layer as modelopt 0.47 exports them (q/k/v fused, gate and up
not merged for weight-only formats)."""


MODELOPT_SCALE_BYTES = 4
"""modelopt writes every weights_scaling_factor in fp32."""


def linear_bytes(out_features: int, in_features: int, precision: str, elt: int, group_size: int) -> int:
    """Bytes of one linear's tensors in a modelopt 0.47 TensorRT-LLM checkpoint (bias excluded).

    full: weight [N, K] in the checkpoint dtype; a level precision: the format registry's TensorRT-LLM tensors
    with fp32 scaling factors (int8 W8A16: int8 [N, K] + weights_scaling_factor [N]; int4 W4A16_AWQ: int4 packed
    two per int8 [N/2, K] + weights_scaling_factor [N, K/group] + prequant_scaling_factor [K] in the checkpoint
    dtype)."""
    if precision == "full":
        return out_features * in_features * elt
    if precision not in LEVEL_PRECISIONS:
        raise ValueError(f"no TensorRT-LLM level byte accounting for {precision!r}; level precisions: "
                         f"{', '.join(LEVEL_PRECISIONS)}")
    from serve.model.quantized_linear.registry import trtllm_tensor_bytes  # noqa: PLC0415 - torch, only when counting

    return sum(trtllm_tensor_bytes(precision, out_features, in_features, elt, group_size=group_size,
                                   scale_bytes=MODELOPT_SCALE_BYTES))


def layer_linear_bytes(config: Any, precision: str, elt: int, group_size: int) -> int:
    return sum(linear_bytes(*shape(config), precision, elt, group_size) for shape in TRTLLM_LINEARS.values())


def checkpoint_weight_bytes(config: Any, layer_precisions: dict[int, str], elt: int, group_size: int) -> int:
    """Expected bytes of all tensors in rank0.safetensors: vocab embedding and lm_head (modelopt writes
    both, tied or not), final and per-layer RMSNorm weights, q/k/v biases if any, and the linears."""
    h = config.hidden_size
    total = 2 * config.vocab_size * h * elt + h * elt + config.num_layers * 2 * h * elt
    if config.attention_bias:
        total += config.num_layers * (config.q_size + 2 * config.kv_size) * elt
    for layer in range(config.num_layers):
        total += layer_linear_bytes(config, layer_precisions.get(layer, "full"), elt, group_size)
    return total


def quantized_modules(layer_precisions: dict[int, str]) -> dict[str, str]:
    """``{"transformer.layers.3.attention.qkv": "int4", ...}``: the modules a level's checkpoint quantizes."""
    return {f"transformer.layers.{layer}.{module}": precision
            for layer, precision in sorted(layer_precisions.items()) for module in TRTLLM_LINEARS}
