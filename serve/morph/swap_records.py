"""What the morph runtime keeps about its swaps: the stack of transitions (each owning a KV extent or given back to
the system), the copy in flight, the counters its metrics read, and the typed snapshot it reports to the engine."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from serve.memory.arena import SlotRange
from serve.morph.layer_bank import CopyJob


@dataclass
class Transition:
    layer: int
    from_precision: str
    to_precision: str
    owner: str          # the KV extent's owner id in the pool ("" when the swap freed no whole slot)
    blocks: int
    slots: SlotRange    # the arena slots the extent's blocks occupy (where the milder variant's bytes were)
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


@dataclass(frozen=True)
class MorphResourceStats:
    """The morph runtime's snapshot (``EngineStats.resources["morph"]``): layers per quantized precision, the
    model's configuration signature, transitions, and the memory-yield state."""

    layers_quantized: dict[str, int]
    swaps_total: int
    restores_total: int
    configuration: str
    yielded_bytes: int
    yield_request_bytes: int
    yields_total: int
    reclaims_total: int
    outside_free_bytes: int | None
    outside_source: str

    def memory_yield(self) -> dict[str, Any]:
        """The yield state as the operator's control answers it (and ``EngineStats.memory_yield``)."""
        return {"yielded_bytes": self.yielded_bytes, "yield_request_bytes": self.yield_request_bytes,
                "yields_total": self.yields_total, "reclaims_total": self.reclaims_total,
                "outside_free_bytes": self.outside_free_bytes, "outside_source": self.outside_source}

    def engine_fields(self) -> dict[str, Any]:
        """The flat ``EngineStats`` fields (and so the metric catalogue's series) this manager fills."""
        return {"layers_quantized": dict(self.layers_quantized), "swaps_total": self.swaps_total,
                "restores_total": self.restores_total, "memory_yield": self.memory_yield(),
                "memory_yielded_bytes": self.yielded_bytes, "memory_yields_total": self.yields_total,
                "memory_reclaims_total": self.reclaims_total, "memory_outside_free_bytes": self.outside_free_bytes}
