"""What a morphing engine morphs with: the plan (the variants per precision, the swap order, where they come from)
for an engine directory or quantized on the fly, reconciled with the mode; the variants of every layer in host
memory (the layer bank's sources); and the check that this GPU runs the plan's kernels."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from policy import FULL, PolicyConfig
from serve.model.engine_dir import open_model
from serve.model.layers import PROJECTIONS, projection_key
from serve.model.linear import LinearOp
from serve.model.llama import LlamaModel
from serve.model.loader import LoadedModel
from serve.model.quantized_layer import quantized_layer
from serve.model.quantized_linear import REGISTRY
from serve.model.rtn import choose_int4_block_size, quantize_linear_rtn
from serve.morph.layer_bank import host_copy

VariantSource = Callable[[int, str], Mapping[str, LinearOp]]

# Compute capability each quantized CUDA kernel needs (the format registry's rows).
MIN_CUDA_CAPABILITY = {precision: fmt.min_cuda_capability for precision, fmt in REGISTRY.items()}


@dataclass
class MorphPlan:
    precisions: list[str]
    swap_order: list[int]
    variant_source: VariantSource
    engine_dir: Path | None = None  # where step_costs.json may already hold this machine's measured costs


def rtn_plan(weights: Mapping[str, torch.Tensor], num_layers: int, precisions: list[str],
             group_size: int | None) -> MorphPlan:
    """Variants quantized on the fly with plain round-to-nearest (no engine directory, no profile)."""
    def source(i: int, precision: str) -> dict[str, LinearOp]:
        out = {}
        for proj in PROJECTIONS:
            w = weights[projection_key(i, proj) + ".weight"]
            g = group_size or choose_int4_block_size([w.shape[1]])
            out[proj] = quantize_linear_rtn(w, precision, g)
        return out
    return MorphPlan(precisions, list(range(num_layers)), source)


def check_device_supports(device: torch.device, precisions: list[str]) -> None:
    """Clear error before any work when a precision's CUDA kernel cannot run on this GPU."""
    if device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    bad = [p for p in precisions if cap < MIN_CUDA_CAPABILITY.get(p, (0, 0))]
    if bad:
        need = ", ".join(f"{p} needs sm{''.join(map(str, MIN_CUDA_CAPABILITY[p]))}+" for p in bad)
        raise ValueError(f"{torch.cuda.get_device_name(device)} is sm{cap[0]}{cap[1]}: {need}; "
                         "choose a mode whose ladder avoids them or another GPU")


def host_bank(model: LlamaModel, plan: MorphPlan) -> dict[int, dict[str, object]]:
    """Every layer at every planned precision, full included, in host memory (pinned on CUDA)."""
    host = {}
    for i, layer in enumerate(model.layers):
        full = layer if model.device.type == "cpu" else host_copy(layer, model.device)  # CPU: the loaded tensors
        variants = {p: host_copy(quantized_layer(layer, plan.variant_source(i, p), p), model.device)
                    for p in plan.precisions}
        host[i] = {FULL: full, **variants}
    return host


def morph_precisions(policy: PolicyConfig, extra: str) -> list[str]:
    """The variants the layer bank holds: the mode's ladder plus any extra asked for (``extra``: comma-separated,
    the engine's ``morph_precisions``). Holding only what the mode can use keeps host memory down and the staging
    headroom (sized for the largest variant) small."""
    names = [p.strip() for p in extra.split(",") if p.strip()]
    return sorted(set(names) | set(policy.ladder))


def resolve_plan(plan: MorphPlan | None, policy: PolicyConfig, precisions: list[str],
                 weights: Mapping[str, torch.Tensor], num_layers: int, int4_group_size: int | None,
                 source: str) -> MorphPlan | None:
    """The plan this mode runs on: an engine directory's (``plan``), reduced to ``precisions`` (ValueError when a
    variant the mode needs was not built; ``source`` names the engine), or round-to-nearest variants made on the
    fly for a dynamic or static mode without one; None when nothing morphs."""
    if policy.strategy != "off" and plan is None:
        return rtn_plan(weights, num_layers, precisions, int4_group_size)
    if plan is not None:  # an engine dir may hold more variants (fp8) than this mode uses
        missing = [p for p in policy.ladder if p not in plan.precisions]
        if missing:
            raise ValueError(f"engine {source} lacks the {missing} variants that morph mode "
                             f"{policy.mode!r} needs (built: {plan.precisions})")
        plan.precisions = [p for p in plan.precisions if p in precisions]
    return plan


def load_model_and_plan(model: str, level: str | None = None) -> tuple[LoadedModel, MorphPlan | None]:
    """An engine directory (manifest.json) brings its LIS order and prebuilt variants; anything else loads plain
    (``level``: one of the engine directory's morph-level checkpoints, served as it is)."""
    loaded, ed = open_model(model, level=level)
    if ed is None:
        return loaded, None
    return loaded, MorphPlan(list(ed.precisions), list(ed.swap_order), ed.layer_variant, engine_dir=ed.root)
