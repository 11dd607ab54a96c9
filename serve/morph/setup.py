"""Sizing the KV pool from the memory budget and wiring the layer bank + morph runtime into an engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from policy import PolicyConfig
from serve.config import EngineConfig, parse_size
from serve.memory.block_pool import BlockPool
from serve.memory.budget import MemoryLedger, resolve_budget
from serve.model.layers import PROJECTIONS, projection_key
from serve.model.linear import LinearOp
from serve.model.llama import LlamaModel
from serve.model.rtn import choose_int4_block_size, quantize_linear_rtn
from serve.morph.layer_bank import LayerBank, quantized_layer
from serve.morph.runtime import MorphRuntime
from serve.morph.scheduler_view import IdleSchedulerView

VariantSource = Callable[[int, str], Mapping[str, LinearOp]]


@dataclass
class MorphPlan:
    precisions: list[str]
    swap_order: list[int]
    variant_source: VariantSource


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


def build_memory(config: EngineConfig, model: LlamaModel, bytes_per_block: int, plan: MorphPlan | None,
                 policy: PolicyConfig | None) -> tuple[BlockPool, MemoryLedger, LayerBank | None]:
    layer_bytes = [layer.nbytes for layer in model.layers]
    weights = model.non_layer_nbytes + sum(layer_bytes)
    reserve = parse_size(config.memory_reserve)
    bank = None
    headroom = 0
    max_extra = 0
    if plan is not None and policy is not None and policy.strategy != "off":
        variants = {i: {p: quantized_layer(model.layers[i], plan.variant_source(i, p), p) for p in plan.precisions}
                    for i in range(len(model.layers))}
        bank = LayerBank(model, variants)
        smallest = min(bank.nbytes(0, p) for p in plan.precisions)
        largest_q = max(bank.nbytes(0, p) for p in plan.precisions)
        # one staging copy is in flight at a time (MorphRuntime queues the rest of a decision); the extra
        # block covers a restore, whose removed chunk is up to one block smaller than the bytes it needs
        headroom = largest_q + bytes_per_block
        max_extra = len(model.layers) * ((layer_bytes[0] - smallest) // bytes_per_block)
    if config.device_memory is not None:
        budget = resolve_budget(model.device, config.device_memory, 0)
        kv_bytes = budget - reserve - weights - headroom
        if kv_bytes < bytes_per_block:
            raise ValueError(
                f"device memory {config.device_memory} leaves no room for the KV cache: weights "
                f"{weights / 2**20:.1f} MiB + reserve {reserve / 2**20:.1f} MiB + swap staging {headroom / 2**20:.1f} MiB "
                f"need at least {(weights + reserve + headroom + bytes_per_block) / 2**20:.1f} MiB")
        base_blocks = kv_bytes // bytes_per_block
        if config.num_kv_blocks is not None:
            base_blocks = min(base_blocks, config.num_kv_blocks)
    else:
        base_blocks = config.num_kv_blocks or max(1, parse_size(config.kv_cache_memory) // bytes_per_block)
        budget = weights + reserve + headroom + base_blocks * bytes_per_block
    pool = BlockPool(base_blocks, max_blocks=base_blocks + max_extra)
    # The staging headroom is not part of the reserve: it is what `ledger.available` hands to swap copies.
    ledger = MemoryLedger(budget=budget, reserve=reserve, non_layer_bytes=model.non_layer_nbytes,
                          layer_bytes=layer_bytes, kv_blocks=base_blocks, bytes_per_block=bytes_per_block)
    ledger.check()
    return pool, ledger, bank


def build_runtime(policy: PolicyConfig, plan: MorphPlan, bank: LayerBank, pool: BlockPool, ledger: MemoryLedger,
                  block_size: int, clock=None) -> MorphRuntime:
    kwargs = {"clock": clock} if clock is not None else {}
    runtime = MorphRuntime(policy, plan.swap_order, bank, pool, ledger, block_size, **kwargs)
    if policy.strategy == "static":
        decision = runtime.controller.decide(runtime.telemetry(runtime.clock(), IdleSchedulerView()))
        runtime.apply_now(decision)
    return runtime
