"""The engine's memory for every mode and every device: the memory knobs resolved into a budget
(serve/engine/memory_budget.py), the arena's arithmetic from it (serve/memory/sizing.py), the KV pool (the KV-precision
rung's ids above everything), the device's arena, layer bank and KV cache, and the base pool mapped. The server's device
allocates (serve/engine/torch_device.py); the planner's counts bytes (sim/device.py); the arithmetic between is this
module's, once.

Arena layout (slots of one KV block each, in the configured ``kv_cache_dtype``: at full precision, or 8-bit codes
with their scales, about a quarter of an fp32 block; serve/model/kv_format.py; see serve/memory/arena.py):
``[layer 0 | layer 1 | ... | layer L-1 | staging | base KV]``. A layer region holds the layer's full
weights (R slots); staging holds the largest variant (only when the mode morphs); every other slot is a
KV block of the base pool. The pool's logical capacity bound is what the arena could ever give (base +
every region's head at the smallest variant); nothing is allocated for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from policy import PolicyConfig
from serve.config import EngineConfig
from serve.engine.memory_budget import memory_budget
from serve.memory.arena import Arena, SlotRange
from serve.memory.block_pool import BlockPool
from serve.memory.budget import MemoryLedger
from serve.memory.sizing import ArenaPlan, plan_arena
from serve.model.kv_cache import KVBlocks
from serve.model.kv_format import KVLayout
from serve.model.model_config import ModelConfig
from serve.morph.layer_bank import MorphBank
from serve.morph.plan import MorphPlan


@dataclass(frozen=True)
class LayerSizes:
    """A model's bytes as the arena holds them: each layer's full weights, its quantized variants by precision
    (None when the mode does not morph), and what lies outside the arena (embeddings, norms, LM head)."""

    full: list[int]
    variants: list[dict[str, int]] | None
    non_arena: int


class MemoryDevice(Protocol):
    """What the memory's assembly asks of a device (the rest of what an engine is assembled on:
    serve/engine/assembly.py ``EngineDevice``)."""

    model_config: ModelConfig
    dtype: torch.dtype
    memory_kind: str  # "cuda" or "cpu": how device_memory="auto" is read (serve/memory/budget.py)

    def device_memory_bytes(self, text: str) -> int:
        """``device_memory`` in bytes: a size, or a fraction of this device's memory."""
        ...

    def kv_block_bytes(self, config: EngineConfig) -> int:
        """One KV block (an arena slot) in the config's ``kv_cache_dtype``; a clear error for one it cannot serve."""
        ...

    def layer_sizes(self, morphing: MorphPlan | None) -> LayerSizes:
        """The model's bytes in the arena (``morphing``: the plan when the mode morphs, else None)."""
        ...

    def place(self, arena: ArenaPlan, morphing: MorphPlan | None,
              releasable: bool) -> tuple[Arena | None, MorphBank | None]:
        """The arena with the full weights in their regions, and the layer bank when the mode morphs."""
        ...

    def check_kv_rung(self, kv_format: str) -> None:
        """A clear error when the KV-precision rung's 8-bit format cannot run here."""
        ...

    def kv_cache(self, config: EngineConfig, arena: Arena | None, max_blocks: int,
                 rung: KVLayout | None) -> KVBlocks:
        """The KV cache over the arena for ``max_blocks`` logical blocks (``rung``: its 8-bit layout beside)."""
        ...


@dataclass
class EngineMemory:
    arena: Arena | None  # None: the planner's (nothing is allocated)
    pool: BlockPool
    ledger: MemoryLedger
    kv: KVBlocks
    bank: MorphBank | None
    base: SlotRange


def build_memory(config: EngineConfig, device: MemoryDevice, policy: PolicyConfig,
                 plan: MorphPlan | None) -> EngineMemory:
    budget = memory_budget(config, device.memory_kind, device.model_config.max_position_embeddings,
                           device.device_memory_bytes)
    slot = device.kv_block_bytes(config)
    morphing = plan if plan is not None and policy.strategy != "off" else None
    sizes = device.layer_sizes(morphing)
    arena_plan = plan_arena(budget, slot, sizes.full, sizes.variants, sizes.non_arena)
    # On CUDA only a VMM-built arena can give segments back; built when the operator armed yield (memory_floor).
    arena, bank = device.place(arena_plan, morphing, releasable=morphing is not None and budget.releasable)
    rung = kv_rung_layout(config, device, policy)
    # the rung's extents take logical ids above everything else: at most the 8-bit blocks of every KV slot (the base
    # pool's and the layer extents': the rung converts both); the extents' blocks lie in disjoint bytes
    rung_ids = 0 if rung is None else -(-arena_plan.max_blocks * slot // rung.block_bytes) + 1
    pool = BlockPool(arena_plan.base_blocks, max_blocks=arena_plan.max_blocks + rung_ids,
                     kv_format=config.kv_cache_dtype)
    kv = device.kv_cache(config, arena, pool.max_blocks, rung)
    kv.map_blocks(0, list(range(arena_plan.base.start, arena_plan.base.end)))
    return EngineMemory(arena, pool, arena_plan.ledger(), kv, bank, arena_plan.base)


def kv_rung_layout(config: EngineConfig, device: MemoryDevice, policy: PolicyConfig) -> KVLayout | None:
    """The 8-bit block layout of the KV-precision rung (``PolicyConfig.kv_rung``; serve/engine/kv_rung.py) when it
    runs: a dynamic mode over a full-precision KV cache. A clear error for a format the device cannot serve."""
    if policy.kv_rung is None or policy.strategy != "dynamic":
        return None
    if config.kv_cache_dtype != "auto":
        raise ValueError(f"the KV rung (kv_rung={policy.kv_rung}) writes 8-bit blocks into a full-precision KV cache; "
                         f"kv_cache_dtype {config.kv_cache_dtype} is 8-bit already")
    device.check_kv_rung(policy.kv_rung)
    return KVLayout.of(device.model_config, config.block_size, device.dtype, policy.kv_rung)
