"""Wiring the morph runtime: this machine's per-precision step costs for the cost-aware controller (read or measured
on the layers the engine serves: ``step_costs``) and the runtime itself, which a static mode applies at once
(``build_runtime``, called by the engine's one assembly, serve/engine/assembly.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from policy import FULL, PolicyConfig, StepCosts
from policy.quality import QualitySource
from serve.logging_setup import get_logger
from serve.memory.block_pool import BlockPool
from serve.memory.budget import MemoryLedger
from serve.memory.pressure import PressureSource
from serve.model.kv_cache import KVBlocks
from serve.model.llama import LlamaModel
from serve.model.step_costs import load_or_measure
from serve.morph.layer_bank import LayerBank, MorphBank
from serve.morph.placement import remap
from serve.morph.runtime import MorphRuntime
from serve.resource_seam import IdleSchedulerView

log = get_logger("morphserve.morph")


def cost_inputs(model: LlamaModel, bank: LayerBank) -> tuple[dict[str, Any], tuple[int, int, int],
                                                             Callable[[torch.Tensor], torch.Tensor]]:
    """What step costs are measured on: on CPU every layer at every precision the bank holds (the very objects the
    engine serves, fused as it fuses them; timed one after the other, per layer), on CUDA layer 0, the linears'
    input widths, and the LM head as a step runs it
    (``LlamaModel.logits``: the int8 head blocks up to their row crossover, the fp32 head above). On CUDA the
    bank's sources are pinned host copies, so each is copied to the device for the measurement (and dropped
    after)."""
    cfg = model.config
    shape = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    precisions = (FULL, *sorted(bank.precisions))
    if model.device.type != "cpu":
        return {p: remap(bank.host[0][p], lambda t: t.to(model.device)) for p in precisions}, shape, model.logits
    # every layer, streamed as a step streams them: layer 0 repeated stays in cache and reads 0.5-1.7x a step's cost
    return {p: [bank.host[i][p] for i in sorted(bank.host)] for p in precisions}, shape, model.logits


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


def build_runtime(policy: PolicyConfig, swap_order: list[int], bank: MorphBank, pool: BlockPool,
                  ledger: MemoryLedger, kv: KVBlocks, block_size: int, clock: Callable[[], float],
                  costs: StepCosts | None = None, prefix_cache: str = "exact", pressure: PressureSource | None = None,
                  step_token_budget: int = 0, kv_blocks_per_freed_slot: float = 1.0,
                  quality: QualitySource | None = None) -> MorphRuntime:
    """The morph runtime over the engine's memory (``costs``: the cost-aware controller's step costs, None without
    them); a static mode applies its layers at once."""
    runtime = MorphRuntime(policy, swap_order, bank, pool, ledger, kv, block_size, clock=clock, costs=costs,
                           prefix_cache=prefix_cache, pressure=pressure, step_token_budget=step_token_budget,
                           kv_blocks_per_freed_slot=kv_blocks_per_freed_slot, quality=quality)
    if policy.strategy == "static":
        decision = runtime.controller.decide(runtime.telemetry(runtime.clock(), IdleSchedulerView()))
        runtime.apply_now(decision)
    return runtime
