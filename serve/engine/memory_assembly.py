"""The engine's memory for every mode: the arena sized from the budget, the full weights placed in their regions,
the base KV pool and paged KV cache, and (when the mode morphs) the layer bank.

Arena layout (slots of one KV block each, in the configured ``kv_cache_dtype``: at full precision, or 8-bit codes
with their scales, about a quarter of an fp32 block; serve/model/kv_format.py; see serve/memory/arena.py):
``[layer 0 | layer 1 | ... | layer L-1 | staging | base KV]``. A layer region holds the layer's full
weights (R slots); staging holds the largest variant (only when the mode morphs); every other slot is a
KV block of the base pool. The pool's logical capacity bound is what the arena could ever give (base +
every region's head at the smallest variant); nothing is allocated for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from policy import FULL, PolicyConfig
from serve.config import EngineConfig
from serve.memory.arena import ALIGN, Arena, SlotRange
from serve.memory.block_pool import BlockPool
from serve.memory.budget import MemoryLedger, auto_budget, resolve_budget
from serve.memory.sizing import plan_arena
from serve.model.kv_cache import PagedKVCache, block_shape, kv_bytes_per_block
from serve.model.kv_format import check_kv_cache_dtype
from serve.model.llama import LlamaModel
from serve.morph.layer_bank import LayerBank
from serve.morph.placement import arena_nbytes, remap
from serve.morph.plan import MorphPlan, check_device_supports, host_bank


@dataclass
class EngineMemory:
    arena: Arena
    pool: BlockPool
    ledger: MemoryLedger
    kv: PagedKVCache
    bank: LayerBank | None
    base: SlotRange


def build_memory(config: EngineConfig, model: LlamaModel, plan: MorphPlan | None,
                 policy: PolicyConfig | None) -> EngineMemory:
    config = auto_budget(config, model.device.type, model.config.max_position_embeddings)  # device_memory="auto"
    check_kv_cache_dtype(config.kv_cache_dtype, model.device.type)
    slot = kv_bytes_per_block(model.config, config.block_size, model.dtype, config.kv_cache_dtype)
    if slot % ALIGN:
        raise ValueError(f"a KV block of {slot} bytes is not a multiple of {ALIGN}; choose another block_size")
    morphing = plan is not None and policy is not None and policy.strategy != "off"
    if morphing:
        check_device_supports(model.device, plan.precisions)
    host = host_bank(model, plan) if morphing else None
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
    pool = BlockPool(sizes.base_blocks, max_blocks=sizes.max_blocks, kv_format=config.kv_cache_dtype)
    if config.kv_cache_dtype == "auto":
        kv = PagedKVCache(model.config, config.block_size,
                          arena.slots_as(model.dtype, block_shape(model.config, config.block_size)), pool.max_blocks)
    else:
        kv = PagedKVCache.quantized(model.config, config.block_size, arena.buf, pool.max_blocks, config.kv_cache_dtype,
                                    model.dtype)
    kv.map_blocks(0, list(range(base_range.start, base_range.end)))
    ledger = sizes.ledger()
    return EngineMemory(arena, pool, ledger, kv, bank, base_range)


