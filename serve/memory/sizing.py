"""The arena's arithmetic, apart from any tensor: how a memory budget splits into layer regions, staging and KV.

``serve/engine/memory_assembly.py`` feeds it a ``MemoryBudget`` and the byte sizes of a model's layers and variants
(a loaded model's on the server's device, then allocated; sizes from a model's config on the planner's, allocated
nowhere). Both get the same
region, staging and base-pool sizes and the same ``MemoryLedger`` from the same lines, so a plan's KV
capacity is the engine's.

Layout in slots of one KV block each: ``[layer 0 | ... | layer L-1 | staging | base KV]``. A region holds a
layer's full weights (R slots, the largest layer's); staging holds the largest variant (only when the mode
morphs); every other slot is a KV block of the base pool. ``extra_blocks`` is the most the regions could
ever add to the pool: every layer at its smallest variant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from serve.memory.arena import SlotRange
from serve.memory.budget import MemoryBudget, MemoryLedger


def slots_for(nbytes: int, slot_bytes: int) -> int:
    return -(-nbytes // slot_bytes)


@dataclass(frozen=True)
class ArenaPlan:
    slot_bytes: int
    num_layers: int
    region_slots: int
    staging_slots: int
    base_blocks: int
    extra_blocks: int
    budget: int
    reserve: int
    non_arena_bytes: int

    @property
    def fixed_slots(self) -> int:
        return self.num_layers * self.region_slots + self.staging_slots

    @property
    def arena_slots(self) -> int:
        return self.fixed_slots + self.base_blocks

    @property
    def regions(self) -> list[SlotRange]:
        return [SlotRange(i * self.region_slots, self.region_slots) for i in range(self.num_layers)]

    @property
    def staging(self) -> SlotRange:
        return SlotRange(self.num_layers * self.region_slots, self.staging_slots)

    @property
    def base(self) -> SlotRange:
        return SlotRange(self.fixed_slots, self.base_blocks)

    @property
    def max_blocks(self) -> int:
        return self.base_blocks + self.extra_blocks

    def ledger(self) -> MemoryLedger:
        """The exact accounting of a freshly built arena: every layer at full precision."""
        ledger = MemoryLedger(budget=self.budget, reserve=self.reserve, non_arena_bytes=self.non_arena_bytes,
                              slot_bytes=self.slot_bytes, arena_slots=self.arena_slots,
                              layer_slots=[self.region_slots] * self.num_layers, staging_slots=self.staging_slots,
                              kv_blocks=self.base_blocks)
        ledger.check()
        return ledger


def plan_arena(budget: MemoryBudget, slot_bytes: int, layer_nbytes: Sequence[int],
               variant_nbytes: Sequence[Mapping[str, int]] | None, non_arena_bytes: int) -> ArenaPlan:
    """Size the arena. ``layer_nbytes[i]``: layer i's full weights as placed in the arena; ``variant_nbytes[i]``:
    its quantized variants by precision (None when the mode does not morph)."""
    num_layers = len(layer_nbytes)
    region = max(slots_for(n, slot_bytes) for n in layer_nbytes)
    staging = 0
    extra = 0
    if variant_nbytes is not None:
        staging = max(slots_for(n, slot_bytes) for per_layer in variant_nbytes for n in per_layer.values())
        extra = sum(region - min(slots_for(n, slot_bytes) for n in per_layer.values()) for per_layer in variant_nbytes)
    fixed = num_layers * region + staging
    total, base = budget_slots(budget, fixed, non_arena_bytes, slot_bytes)
    return ArenaPlan(slot_bytes=slot_bytes, num_layers=num_layers, region_slots=region, staging_slots=staging,
                     base_blocks=base, extra_blocks=extra, budget=total, reserve=budget.reserve_bytes,
                     non_arena_bytes=non_arena_bytes)


def budget_slots(budget: MemoryBudget, fixed: int, non_arena: int, slot: int) -> tuple[int, int]:
    """(budget bytes, base KV blocks): under a budget, what is left of it after the weights, staging and reserve
    (capped at ``kv_blocks``); without one, ``kv_blocks`` or ``kv_bytes`` of KV and the budget that needs."""
    reserve = budget.reserve_bytes
    if budget.budget_bytes is not None:
        base = (budget.budget_bytes - reserve - non_arena) // slot - fixed
        if base < 1:
            raise ValueError(
                f"device memory {budget.device_memory} leaves no room for the KV cache: weights and staging "
                f"{(fixed * slot + non_arena) / 2**20:.1f} MiB + reserve {reserve / 2**20:.1f} MiB need at least "
                f"{((fixed + 1) * slot + non_arena + reserve) / 2**20:.1f} MiB")
        if budget.kv_blocks is not None:
            base = min(base, budget.kv_blocks)
        return budget.budget_bytes, base
    base = budget.kv_blocks or max(1, budget.kv_bytes // slot)
    return non_arena + reserve + (fixed + base) * slot, base
