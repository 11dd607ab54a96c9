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
from serve.model.kv_cache import BlockStore, PagedKVCache, block_shape, kv_bytes_per_block
from serve.model.kv_format import KVLayout, check_kv_cache_dtype
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
    rung = kv_rung_layout(config, model, policy)
    # the rung's chunks take logical ids above everything else: at most the 8-bit blocks of every KV slot (the base
    # pool's and the layer chunks': the rung converts both); the chunks' blocks lie in disjoint bytes
    rung_ids = 0 if rung is None else -(-sizes.max_blocks * slot // rung.block_bytes) + 1
    pool = BlockPool(sizes.base_blocks, max_blocks=sizes.max_blocks + rung_ids, kv_format=config.kv_cache_dtype)
    if config.kv_cache_dtype == "auto":
        kv = PagedKVCache(model.config, config.block_size,
                          arena.slots_as(model.dtype, block_shape(model.config, config.block_size)), pool.max_blocks,
                          None if rung is None else BlockStore.quantized(rung, arena.buf))
    else:
        kv = PagedKVCache.quantized(model.config, config.block_size, arena.buf, pool.max_blocks, config.kv_cache_dtype,
                                    model.dtype)
    kv.map_blocks(0, list(range(base_range.start, base_range.end)))
    ledger = sizes.ledger()
    return EngineMemory(arena, pool, ledger, kv, bank, base_range)




def kv_rung_layout(config: EngineConfig, model: LlamaModel, policy: PolicyConfig | None) -> KVLayout | None:
    """The 8-bit block layout of the KV-precision rung (``PolicyConfig.kv_rung``; serve/engine/kv_rung.py) when it
    runs: a dynamic mode over a full-precision KV cache. A clear error for a format the device cannot serve."""
    if policy is None or policy.kv_rung is None or policy.strategy != "dynamic":
        return None
    if config.kv_cache_dtype != "auto":
        raise ValueError(f"the KV rung (kv_rung={policy.kv_rung}) writes 8-bit blocks into a full-precision KV cache; "
                         f"kv_cache_dtype {config.kv_cache_dtype} is 8-bit already")
    check_kv_cache_dtype(policy.kv_rung, model.device.type)
    return KVLayout.of(model.config, config.block_size, model.dtype, policy.kv_rung)
