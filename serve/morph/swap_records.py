"""What the morph runtime keeps about its swaps: the stack of transitions (each owning a KV chunk or given back to
the system), the copy in flight, and the counters its metrics read."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from serve.memory.arena import SlotRange
from serve.morph.layer_bank import CopyJob


@dataclass
class Transition:
    layer: int
    from_precision: str
    to_precision: str
    owner: str          # the KV chunk's owner id in the pool ("" when the swap freed no whole slot)
    blocks: int
    slots: SlotRange    # the arena slots the chunk's blocks occupy (where the milder variant's bytes were)
    yielded: bool = False  # the slots were given back to the system instead of the KV pool


@dataclass
class PendingSwap:
    kind: str           # "quantize" | "yield" | "restore" | "reclaim"
    layer: int
    target: str
    job: CopyJob
    reason: str
    started: float


@dataclass
class MorphStats:
    swaps: int = 0
    restores: int = 0
    yields: int = 0
    reclaims: int = 0
    failed_copies: int = 0
    swap_ms: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
