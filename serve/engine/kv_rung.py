"""The KV-precision rung: a resource manager ahead of the morph runtime that answers KV pressure by writing new
blocks in 8 bits, before any layer is quantized (``PolicyConfig.kv_rung``; its rule is policy/kv_rung.py). It lives
beside the seam it plugs into (serve/resource_seam.py) and is appended ahead of the morph runtime in
serve/engine/assembly.py; what it reads of the morph runtime (the blocks its next layer swap would add) arrives in its
constructor as a ``LayerSwaps``.

How: the cache holds full-precision blocks and, over the same arena bytes, a grid of 8-bit blocks
(serve/model/kv_cache.py). Converting takes free full-precision blocks out of service (``BlockPool.retire``): the
base pool's, and the extents a layer swap added (so every layer the morph runtime quantizes under pressure gives 3.75x
the blocks its full-precision extent would; that extent then leaves only after the conversion over it is reverted,
LIFO), and adds the 8-bit blocks lying wholly inside their bytes as a new pool extent (``quantized``):
block p of the 8-bit grid is bytes ``[p * B8, (p + 1) * B8)`` of the arena, so a run of slots ``[a, b)`` (``S`` bytes
each) holds the 8-bit blocks ``ceil(a S / B8) .. floor(b S / B8) - 1``: 3 or 4 per slot on SmolLM2 (S / B8 = 3.75).
Nothing is copied (the slots were free). New allocations take the lowest free ids, so full-precision blocks still go
first and the 8-bit ones when they run out: under pressure new KV is written in 8 bits. Reverting (calm, the newest
conversion's extent entirely free and the pool's newest: extents leave LIFO, the morph runtime's too) removes the extent
and puts the slots back. A sequence's block table may then mix formats: the decode kernels take batches of one
format (fp32 or int8) and a batch mixing them goes to the mixed kernel (attention_mixed_avx2.cpp; fp8 codes: the
dense path, gather, dequantize, SDPA, which reads any table). 8-bit blocks live until freed.

When free slots are not enough the rung converts running sequences' cold blocks in place (the rule says how many):
blocks whose every token is computed, at full precision, held by one sequence, oldest first (``cold_blocks``). They are
retired with the free slots of the same conversion, every one read and quantized before any 8-bit block of the new
extent is written (the extent lies in their bytes), each written into one of the extent's blocks; the pool moves the
hold (``BlockPool.move_holds``) and the scheduler repoints the table (``Scheduler.replace_blocks``).

Prefix cache: under ``exact`` a chain that starts at full precision registers no 8-bit block (nor any later block of
its sequence: they attend to 8-bit KV; a converted block's hash ends, and a KV-aware router hears it removed), and a
chain whose first block is 8-bit is keyed under the pool's 8-bit root (``BlockPool.cache_root_8bit``, looked up when
the full-precision chain finds nothing: serve/memory/kv_cache_manager.py); under ``preserve`` 8-bit blocks are shared
as any other (a converted block keeps its hash).
The arena's partition (the ledger, in slots) does not change: retired slots stay KV bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from policy import PolicyConfig
from policy.kv_rung import KVRungDecision, KVRungRule, KVRungTelemetry
from serve.logging_setup import get_logger
from serve.memory.block_pool import BlockPool
from serve.model.kv_cache import Q8_BLOCK, PagedKVCache
from serve.resource_seam import ResourceManagerBase, SchedulerView

log = get_logger("morphserve.kv_rung")


@runtime_checkable
class RunningBlocks(Protocol):
    """What the rung needs of the scheduler to convert running sequences' blocks (serve/engine/scheduler.py)."""

    def cold_full_blocks(self) -> list[int]: ...

    def replace_blocks(self, moves: dict[int, int]) -> None: ...


class LayerSwaps(Protocol):
    """What the rung reads of layer swapping (the morph runtime's ``next_swap_blocks``) to weigh its price."""

    def next_swap_blocks(self, precision: str) -> int:
        """The KV blocks the next layer quantized to ``precision`` would add (0: no layer is left to quantize)."""
        ...


@dataclass
class Conversion:
    owner: str
    retired: list[int]  # full-precision block ids out of service (free slots, and running blocks re-written as 8-bit)
    blocks_8bit: list[int]  # the 8-bit blocks (physical, in the 8-bit grid) in their bytes: extent ``owner``


@dataclass(frozen=True)
class KVRungStats:
    """The rung's snapshot (``EngineStats.resources["kv_precision"]``)."""

    kv_cache_dtype: str
    kv_blocks_8bit: int
    slots_converted: int
    conversions_total: int
    reverts_total: int
    bytes_gained: int  # full-precision bytes the net extra blocks would take
    blocks_rewritten_total: int = 0  # running sequences' blocks re-written as 8-bit

    def engine_fields(self) -> dict[str, Any]:
        return {"kv_blocks_8bit": self.kv_blocks_8bit, "kv_precision_conversions_total": self.conversions_total,
                "kv_precision_reverts_total": self.reverts_total, "kv_precision_bytes_gained": self.bytes_gained,
                "kv_precision_blocks_rewritten_total": self.blocks_rewritten_total}


def blocks_8bit_in(slot_runs: list[tuple[int, int]], slot_bytes: int, block_8bit_bytes: int) -> list[int]:
    """The 8-bit blocks wholly inside the byte ranges of the slot runs ``[a, b)``."""
    blocks_8bit: list[int] = []
    for a, b in slot_runs:
        blocks_8bit.extend(range(-(-a * slot_bytes // block_8bit_bytes), b * slot_bytes // block_8bit_bytes))
    return blocks_8bit


def runs(slots: list[int]) -> list[tuple[int, int]]:
    """Sorted slot numbers as maximal runs ``[a, b)``."""
    out: list[tuple[int, int]] = []
    for s in sorted(slots):
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], s + 1)
        else:
            out.append((s, s + 1))
    return out


class KVPrecisionRung(ResourceManagerBase):
    name = "kv_precision"
    grows_pool = True

    def __init__(self, rule: KVRungRule, pool: BlockPool, kv: PagedKVCache, prefix_cache: str = "exact",
                 layers: LayerSwaps | None = None, layer_precision: str = "int4",
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``layers``: layer swapping, whose next swap to ``layer_precision`` the rule prices its own conversion
        against; None: no layer swapping."""
        if not kv.mixes_formats:
            raise ValueError("the KV rung needs a cache holding full-precision and 8-bit blocks")
        self.rule, self.pool, self.kv, self.clock = rule, pool, kv, clock
        self.layers, self.layer_precision = layers, layer_precision
        self.slot_bytes = kv.full.layout.block_bytes
        self.block_8bit_bytes = kv.q8.layout.block_bytes
        self.conversions: list[Conversion] = []
        self.conversions_total = self.reverts_total = self.blocks_rewritten_total = 0
        self.last: KVRungDecision | None = None
        pool.register_quantized = prefix_cache == "preserve"

    # ---- state ---------------------------------------------------------------------------------------------------
    @property
    def kv_blocks_8bit(self) -> int:
        return sum(len(c.blocks_8bit) for c in self.conversions)

    @property
    def slots_converted(self) -> int:
        return sum(len(c.retired) for c in self.conversions)

    def cold_blocks(self, scheduler: SchedulerView | None) -> list[int]:
        """Running sequences' blocks the rung may re-write as 8-bit, oldest first: every token computed (never one
        being written), at full precision (the base pool's or a layer extent's), one holder (a prefix shared by
        several sequences is left alone)."""
        if not isinstance(scheduler, RunningBlocks):
            return []
        return [b for b in scheduler.cold_full_blocks() if self.pool.holders(b) == 1 and not self.pool.is_quantized(b)]

    def telemetry(self, now: float, scheduler: SchedulerView | None = None) -> KVRungTelemetry:
        t = self._telemetry(now, scheduler)
        return replace(t, cold_blocks=len(self.cold_blocks(scheduler))) if self.rule.under_pressure(t) else t

    def _telemetry(self, now: float, scheduler: SchedulerView | None = None) -> KVRungTelemetry:
        top = self.conversions[-1] if self.conversions else None
        top_free = top is not None and self.pool.extents[-1].owner == top.owner and self.pool.extent_is_free(top.owner)
        layer_blocks = self.layers.next_swap_blocks(self.layer_precision) if self.layers is not None else 0
        return KVRungTelemetry(
            now_s=now, kv_blocks_total=self.pool.num_blocks, kv_blocks_used=self.pool.num_used,
            free_full_slots=self.pool.num_free_full,
            blocks_per_slot=self.slot_bytes / self.block_8bit_bytes, kv_blocks_8bit=self.kv_blocks_8bit,
            top_free=top_free,
            top_blocks=len(top.blocks_8bit) if top else 0, top_slots=len(top.retired) if top else 0,
            blocks_needed_waiting=scheduler.blocks_needed_by_waiting() if scheduler is not None else 0,
            layer_extent_blocks=layer_blocks, layer_precision=self.layer_precision)

    # ---- the seam ------------------------------------------------------------------------------------------------
    def before_schedule(self, scheduler: SchedulerView) -> KVRungDecision:
        decision = self.rule.decide(self.telemetry(self.clock(), scheduler))
        self.apply(decision, scheduler)
        return decision

    def cover_shortfall(self, scheduler: SchedulerView, blocks: int) -> int:
        """The scheduler is ``blocks`` short: convert the free full-precision slots that cover it (some may be free
        while the pool lacks more than they are), then running sequences' cold blocks for the rest (the rule says how
        many); returns the blocks added."""
        if blocks <= 0:
            return 0
        before = self.pool.num_free
        t = replace(self._telemetry(self.clock(), scheduler), cold_blocks=len(self.cold_blocks(scheduler)))
        self.apply(self.rule.for_shortfall(t, blocks), scheduler)
        return max(0, self.pool.num_free - before)

    def apply(self, decision: KVRungDecision, scheduler: SchedulerView | None = None) -> None:
        """Carry out ``decision``; converting running sequences' blocks needs the scheduler that holds them."""
        self.last = decision
        if decision.action == "convert":
            cold = self.cold_blocks(scheduler)[: decision.blocks] if decision.blocks > 0 else []
            self._convert(decision.slots, cold, scheduler, decision.reason)
        elif decision.action == "revert":
            self._revert(decision.reason)

    def _convert(self, slots: int, cold: list[int], scheduler: SchedulerView | None, reason: str) -> None:
        """Retire the ``slots`` highest free full-precision blocks and the running blocks ``cold`` and add the 8-bit
        blocks in their bytes as an extent; each cold block's KV is re-written (quantized) into the extent's first
        blocks, its holder repointed there and its hold moved (serve/memory/block_pool.py ``move_holds``)."""
        ids = self.pool.free_full_ids()[-slots:] if slots > 0 else []
        physical = [self.kv.physical_slot(i) for i in ids + cold]
        blocks_8bit = blocks_8bit_in(runs(physical), self.slot_bytes, self.block_8bit_bytes)
        if len(blocks_8bit) <= len(physical):
            log.info("kv_rung_skipped", slots=len(ids), blocks=len(cold), blocks_8bit=len(blocks_8bit),
                     reason="too few 8-bit blocks fit")
            return
        # read and quantize every cold block before any 8-bit block (in the same bytes) is written
        self.kv.quantize_blocks(physical[len(ids):], blocks_8bit[: len(cold)])
        owner = f"kv8:{self.conversions_total}"
        if ids:
            self.pool.retire(ids)
        extent = self.pool.add_extent(owner, len(blocks_8bit), quantized=True)
        self.kv.map_blocks(extent.start, blocks_8bit, Q8_BLOCK)
        if cold:
            moves = {old: extent.start + k for k, old in enumerate(cold)}
            self.pool.move_holds(moves)
            assert isinstance(scheduler, RunningBlocks)  # cold blocks come from it
            scheduler.replace_blocks(moves)
        self.conversions.append(Conversion(owner, ids + cold, blocks_8bit))
        self.conversions_total += 1
        self.blocks_rewritten_total += len(cold)
        log.info("kv_convert", slots=len(ids), running_blocks=len(cold), blocks_8bit=len(blocks_8bit),
                 kv_blocks_total=self.pool.num_blocks, reason=reason)

    def _revert(self, reason: str) -> None:
        top = self.conversions[-1]
        extent = self.pool.remove_extent(top.owner)
        self.kv.unmap_blocks(extent.start, extent.num_blocks)
        self.pool.unretire(top.retired)
        self.conversions.pop()
        self.reverts_total += 1
        log.info("kv_revert", slots=len(top.retired), blocks_8bit=len(top.blocks_8bit),
                 kv_blocks_total=self.pool.num_blocks,
                 reason=reason)

    def extra_reachable_blocks(self, base_blocks: int, num_blocks: int) -> tuple[int, str]:
        """None promised: the rung converts only free slots, so a request cannot count on it (admission)."""
        return 0, ""

    def resource_stats(self) -> KVRungStats:
        gained = self.kv_blocks_8bit - self.slots_converted
        return KVRungStats(self.kv.q8.layout.kv_cache_dtype, self.kv_blocks_8bit, self.slots_converted,
                           self.conversions_total, self.reverts_total, gained * self.slot_bytes,
                           self.blocks_rewritten_total)

    def is_at_rest(self) -> bool:
        return not self.conversions


def kv_blocks_per_slot(kv: PagedKVCache) -> float:
    """The 8-bit blocks one full-precision slot's bytes hold (3.75 on SmolLM2): what a layer extent's freed slot
    becomes under pressure once the rung converts it (the morph controller counts a swap so)."""
    return kv.full.layout.block_bytes / kv.q8.layout.block_bytes


def build_kv_rung(policy: PolicyConfig, pool: BlockPool, kv: PagedKVCache, prefix_cache: str,
                  layers: LayerSwaps | None, clock: Callable[[], float]) -> KVPrecisionRung:
    """The rung (``PolicyConfig.kv_rung``) over the engine's pool and mixed-format cache, weighing its price against
    the next layer swap to the mode's first rung (while layers are left to quantize)."""
    rule = KVRungRule(policy.kv_rung, policy.kv_high, policy.kv_low, policy.restore_persist_s)
    return KVPrecisionRung(rule, pool, kv, prefix_cache, layers, policy.ladder[0], clock=clock)
