"""Sizing the arena from the memory budget and wiring weights, KV pool, layer bank and morph runtime.

Arena layout (slots of one KV block each, see serve/memory/arena.py):
``[layer 0 | layer 1 | ... | layer L-1 | staging | base KV]``. A layer region holds the layer's full
weights (R slots); staging holds the largest variant (only when the mode morphs); every other slot is a
KV block of the base pool. The pool's logical capacity bound is what the arena could ever give (base +
every region's head at the smallest variant); nothing is allocated for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import time

import torch

from policy import FULL, PolicyConfig, StepCosts
from serve.config import EngineConfig
from serve.memory.arena import ALIGN, Arena, SlotRange
from serve.memory.block_pool import BlockPool
from serve.memory.budget import MemoryLedger, auto_budget, resolve_budget
from serve.memory.pressure import PressureSource
from serve.memory.sizing import plan_arena
from serve.model.kv_cache import PagedKVCache, block_shape, kv_bytes_per_block
from serve.model.layers import PROJECTIONS, projection_key
from serve.model.engine_dir import open_model
from serve.model.linear import LinearOp
from serve.model.llama import DecoderLayer, LlamaModel
from serve.model.loader import LoadedModel
from serve.model.quantized_linear import REGISTRY
from serve.model.rtn import choose_int4_block_size, quantize_linear_rtn
from serve.model.step_costs import load_or_measure
from serve.morph.layer_bank import LayerBank, host_copy, quantized_layer
from serve.morph.placement import arena_nbytes, remap
from serve.morph.runtime import MorphRuntime
from serve.morph.scheduler_view import IdleSchedulerView
from serve.logging_setup import get_logger

log = get_logger("morphserve.morph")

VariantSource = Callable[[int, str], Mapping[str, LinearOp]]

# Compute capability each quantized CUDA kernel needs (the format registry's rows).
MIN_CUDA_CAPABILITY = {precision: fmt.min_cuda_capability for precision, fmt in REGISTRY.items()}


@dataclass
class MorphPlan:
    precisions: list[str]
    swap_order: list[int]
    variant_source: VariantSource
    engine_dir: Path | None = None  # where step_costs.json may already hold this machine's measured costs


@dataclass
class EngineMemory:
    arena: Arena
    pool: BlockPool
    ledger: MemoryLedger
    kv: PagedKVCache
    bank: LayerBank | None
    base: SlotRange


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


def _host_bank(model: LlamaModel, plan: MorphPlan) -> dict[int, dict[str, object]]:
    """Every layer at every planned precision, full included, in host memory (pinned on CUDA)."""
    host = {}
    for i, layer in enumerate(model.layers):
        full = layer if model.device.type == "cpu" else host_copy(layer, model.device)  # CPU: the loaded tensors
        variants = {p: host_copy(quantized_layer(layer, plan.variant_source(i, p), p), model.device)
                    for p in plan.precisions}
        host[i] = {FULL: full, **variants}
    return host


def build_memory(config: EngineConfig, model: LlamaModel, plan: MorphPlan | None,
                 policy: PolicyConfig | None) -> EngineMemory:
    config = auto_budget(config, model.device.type, model.config.max_position_embeddings)  # device_memory="auto"
    slot = kv_bytes_per_block(model.config, config.block_size, model.dtype)
    if slot % ALIGN:
        raise ValueError(f"a KV block of {slot} bytes is not a multiple of {ALIGN}; choose another block_size")
    morphing = plan is not None and policy is not None and policy.strategy != "off"
    if morphing:
        check_device_supports(model.device, plan.precisions)
    host = _host_bank(model, plan) if morphing else None
    norms = sum(layer.input_norm.nbytes + layer.post_attention_norm.nbytes for layer in model.layers)
    variants = None
    if host is not None:
        variants = [{p: arena_nbytes(v) for p, v in per_layer.items() if p != FULL} for per_layer in host.values()]
    sizes = plan_arena(config, slot, [arena_nbytes(layer) for layer in model.layers], variants,
                       model.non_layer_nbytes + norms, lambda text: resolve_budget(model.device, text, 0))
    # On CUDA only a VMM-built arena can give segments back; built when the operator armed yield (memory_floor).
    arena = Arena(sizes.arena_slots, slot, model.device, releasable=morphing and config.memory_floor is not None)
    for i, r in enumerate(sizes.regions):  # full weights move into their regions; the originals are dropped
        model.layers[i] = remap(model.layers[i], arena.allocator(r).place)
    base_range = sizes.base
    bank = LayerBank(model, arena, sizes.regions, sizes.staging, host) if host is not None else None
    pool = BlockPool(sizes.base_blocks, max_blocks=sizes.max_blocks)
    kv = PagedKVCache(model.config, config.block_size, arena.slots_as(model.dtype, block_shape(model.config, config.block_size)),
                      pool.max_blocks)
    kv.map_blocks(0, list(range(base_range.start, base_range.end)))
    ledger = sizes.ledger()
    return EngineMemory(arena, pool, ledger, kv, bank, base_range)


def cost_inputs(model: LlamaModel, bank: LayerBank) -> tuple[dict[str, DecoderLayer], tuple[int, int, int], LinearOp]:
    """What step costs are measured on: layer 0 at every precision the bank holds (the very objects the
    engine serves, fused as it fuses them), the linears' input widths, and the LM head. On CUDA the bank's
    sources are pinned host copies, so each is copied to the device for the measurement (and dropped after)."""
    cfg = model.config
    shape = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    layers = {p: bank.host[0][p] for p in (FULL, *sorted(bank.precisions))}
    if model.device.type != "cpu":
        layers = {p: remap(layer, lambda t: t.to(model.device)) for p, layer in layers.items()}
    return layers, shape, model.head


def step_costs(model: LlamaModel, bank: LayerBank, engine_dir: Path | None) -> StepCosts:
    """This machine's per-precision layer step costs for the cost-aware controller: from the engine
    directory's step_costs.json or the per-machine cache when they match this machine, else measured now
    (short) and cached."""
    layers, shape, head = cost_inputs(model, bank)
    t0 = time.perf_counter()
    costs, source = load_or_measure(layers, shape, model.device, model.dtype, head=head, engine_dir=engine_dir)
    log.info("step_costs", source=source, seconds=round(time.perf_counter() - t0, 3), device=costs.device,
             ratios={p: [round(costs.ratio(p, n), 3) for n in costs.token_counts] for p in costs.precisions},
             token_counts=list(costs.token_counts))
    return costs


def build_runtime(policy: PolicyConfig, plan: MorphPlan, memory: EngineMemory, block_size: int,
                  clock=None, costs: StepCosts | None = None, prefix_cache: str = "exact",
                  pressure: PressureSource | None = None) -> MorphRuntime:
    """The morph runtime; a cost-aware dynamic mode gets this machine's step costs (``costs`` or looked up)."""
    kwargs = {"clock": clock} if clock is not None else {}
    assert memory.bank is not None
    if costs is None and policy.cost_aware and policy.strategy == "dynamic":
        costs = step_costs(memory.bank.model, memory.bank, plan.engine_dir)
    runtime = MorphRuntime(policy, plan.swap_order, memory.bank, memory.pool, memory.ledger, memory.kv, block_size,
                           costs=costs, prefix_cache=prefix_cache, pressure=pressure, **kwargs)
    if policy.strategy == "static":
        decision = runtime.controller.decide(runtime.telemetry(runtime.clock(), IdleSchedulerView()))
        runtime.apply_now(decision)
    return runtime


def morph_precisions(config: EngineConfig, policy: PolicyConfig) -> list[str]:
    """The variants the layer bank holds: the mode's ladder plus any extra asked for. Holding only what the
    mode can use keeps host memory down and the staging headroom (sized for the largest variant) small."""
    names = [p.strip() for p in config.morph_precisions.split(",") if p.strip()]
    return sorted(set(names) | set(policy.ladder))


def resolve_plan(config: EngineConfig, policy: PolicyConfig, weights: Mapping[str, torch.Tensor], num_layers: int,
                 plan: MorphPlan | None) -> MorphPlan | None:
    """The plan this mode runs on: an engine directory's, reduced to the variants the mode uses (ValueError when
    one it needs was not built), or round-to-nearest variants made on the fly for a dynamic or static mode
    without one; None when nothing morphs."""
    if policy.strategy != "off" and plan is None:
        return rtn_plan(weights, num_layers, morph_precisions(config, policy), config.int4_group_size)
    if plan is not None:  # an engine dir may hold more variants (fp8) than this mode uses
        wanted = morph_precisions(config, policy)
        missing = [p for p in policy.ladder if p not in plan.precisions]
        if missing:
            raise ValueError(f"engine {config.model} lacks the {missing} variants that morph mode "
                             f"{config.morph_mode!r} needs (built: {plan.precisions})")
        plan.precisions = [p for p in plan.precisions if p in wanted]
    return plan


def load_model_and_plan(config: EngineConfig) -> tuple[LoadedModel, MorphPlan | None]:
    """An engine directory (manifest.json) brings its LIS order and prebuilt variants; anything else loads plain."""
    loaded, ed = open_model(config.model)
    if ed is None:
        return loaded, None
    return loaded, MorphPlan(list(ed.precisions), list(ed.swap_order), ed.layer_variant, engine_dir=ed.root)

