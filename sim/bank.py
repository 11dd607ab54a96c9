"""The layer bank without tensors: the real LayerBank's slot arithmetic over byte counts, copies on the virtual clock.

The morph runtime (serve/morph/runtime.py) runs unchanged on it (serve/morph/layer_bank.py ``MorphBank``): it asks
for slots, tails, host variants and copies, installs what a copy returns and maps KV blocks. Here a layer is its
precision; a host-to-device copy takes ``bytes / h2d_bandwidth`` of virtual time on one copy engine (copies queue behind
each other) and overlaps compute, as the CUDA copy stream does; waiting for it (``result()`` before it is done) moves
the clock to its end, as a host that waits would. A device-local copy (``copy_now``: moving the staged variant to the
region's tail at an iteration boundary) takes ``bytes / device bandwidth`` on the compute stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from policy import FULL
from serve.memory.arena import SlotRange
from serve.model.kv_cache import FULL_BLOCK, Q8_BLOCK
from serve.model.kv_format import KVLayout
from serve.morph.layer_bank import BankSlots
from sim.clock import VirtualClock


@dataclass
class SimLayer:
    precision: str
    nbytes: int = 0


@dataclass
class SimModel:
    layers: list[SimLayer] = field(default_factory=list)


class SimCopyJob:
    def __init__(self, clock: VirtualClock, ready_at: float, layer: SimLayer) -> None:
        self.clock = clock
        self.ready_at = ready_at
        self.layer = layer

    def done(self) -> bool:
        return self.clock() >= self.ready_at

    def result(self) -> SimLayer:
        self.clock.advance_to(self.ready_at)
        return self.layer


@dataclass(frozen=True)
class SimStore:
    """One KV format's blocks as the KV-precision rung reads them: only their layout (bytes, format)."""

    layout: KVLayout


class SimKV:
    """The paged KV cache's mapping calls; a plan stores no KV. With the KV-precision rung (``q8``: its 8-bit layout)
    it keeps what the rung's arithmetic needs (each logical block's physical slot) and which logical blocks are 8-bit
    (the step model's share of 8-bit KV); re-writing running blocks as 8-bit takes their bytes (read full, write
    8-bit) over the device bandwidth on the clock, as a device-local copy does."""

    def __init__(self, max_blocks: int = 0, full: KVLayout | None = None, q8: KVLayout | None = None,
                 clock: VirtualClock | None = None, d2d_bytes_per_s: float = 0.0) -> None:
        self.full = SimStore(full) if full is not None else None
        self.q8 = SimStore(q8) if q8 is not None else None
        self.block_map = [-1] * max_blocks
        self.is8 = bytearray(max_blocks)
        self.clock, self.d2d = clock, d2d_bytes_per_s
        self.blocks_8bit = 0

    @property
    def mixes_formats(self) -> bool:
        return self.full is not None and self.q8 is not None

    def map_blocks(self, logical_start: int, physical_slots: list[int], block_format: int = FULL_BLOCK) -> None:
        if not self.block_map:
            return
        for k, p in enumerate(physical_slots):
            self.block_map[logical_start + k] = p
            was, now = self.is8[logical_start + k], int(block_format == Q8_BLOCK)
            self.is8[logical_start + k] = now
            self.blocks_8bit += now - was

    def unmap_blocks(self, logical_start: int, count: int) -> None:
        if not self.block_map:
            return
        for i in range(logical_start, logical_start + count):
            self.block_map[i] = -1
            self.blocks_8bit -= self.is8[i]
            self.is8[i] = 0

    def physical_slot(self, logical_block: int) -> int:
        return self.block_map[logical_block]

    def quantize_blocks(self, sources: list[int], targets: list[int]) -> None:
        if sources and self.clock is not None and self.d2d > 0:
            self.clock.advance(len(sources) * (self.full.layout.block_bytes + self.q8.layout.block_bytes) / self.d2d)

    def share_8bit(self, block_ids: list[int]) -> float:
        """The share of ``block_ids`` that are 8-bit blocks (0 when none is)."""
        if not self.blocks_8bit or not block_ids:
            return 0.0
        is8 = self.is8
        return sum(is8[b] for b in block_ids) / len(block_ids)


class HeldArena:
    """The planner's arena gives nothing back (memory yield needs a device): ``can_release`` is False, as on an arena
    the operator did not arm."""

    can_release = False

    def release(self, r: SlotRange) -> int:
        raise ValueError("the planner's arena gives no memory back")

    def recommit(self, r: SlotRange) -> int:
        raise ValueError("the planner's arena gives no memory back")


class SimLayerBank(BankSlots):
    def __init__(self, nbytes: Sequence[Mapping[str, int]], regions: list[SlotRange], staging: SlotRange,
                 slot_bytes: int, clock: VirtualClock, h2d_bytes_per_s: float, d2d_bytes_per_s: float) -> None:
        # the real bank's slot arithmetic and installs (BankSlots); no tensors, threads or streams
        self.model = SimModel([SimLayer(FULL, per_layer[FULL]) for per_layer in nbytes])
        self.device = torch.device("meta")  # not CUDA: the runtime's NVML query answers None, as on CPU
        self.arena = HeldArena()
        self.regions = regions
        self.staging = staging
        self.slot_bytes = slot_bytes
        self._nbytes = [dict(per_layer) for per_layer in nbytes]
        self.host = {i: {p: SimLayer(p, n) for p, n in per_layer.items()} for i, per_layer in enumerate(self._nbytes)}
        self.clock = clock
        self.h2d = h2d_bytes_per_s
        self.d2d = d2d_bytes_per_s
        self._copy_engine_free_at = 0.0
        self.bytes_copied = 0

    def nbytes(self, i: int, precision: str) -> int:
        return self._nbytes[i][precision]

    def copy_async(self, src: SimLayer, dest: SlotRange) -> SimCopyJob:
        nbytes = src.nbytes
        start = max(self.clock(), self._copy_engine_free_at)
        self._copy_engine_free_at = start + nbytes / self.h2d
        self.bytes_copied += nbytes
        return SimCopyJob(self.clock, self._copy_engine_free_at, SimLayer(src.precision, nbytes))

    def copy_now(self, src: SimLayer, dest: SlotRange) -> SimLayer:
        self.clock.advance(src.nbytes / self.d2d)
        return SimLayer(src.precision, src.nbytes)

    def detached(self, i: int, precision: str) -> SimLayer:
        return self.host[i][precision]

    def resident_ranges(self, i: int) -> list[tuple[int, int]]:
        return []

    def shutdown(self) -> None:
        pass
