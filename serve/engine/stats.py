"""``EngineStats``: what ``LLMEngine.stats()`` reports, one typed snapshot taken under the engine lock.

The front ends read it field by field: the metric catalogue (serve/metrics_catalogue.py) names a field per
engine metric, the Dynamo worker publishes ``kv_blocks_used`` / ``kv_blocks_total`` as its live capacity,
and ``as_dict()`` gives the JSON form (the worker's ``morph_state`` control, logs, bench outputs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineStats:
    # KV pool (blocks; ``kv_blocks_total`` grows when layers are quantized, ``kv_blocks_base`` does not)
    kv_blocks_total: int
    kv_blocks_used: int
    kv_cache_usage_perc: float
    kv_blocks_cached: int
    kv_blocks_base: int
    block_size: int
    # scheduling
    scheduler: str
    num_running: int
    num_waiting: int
    max_num_seqs: int
    num_scheduled_last_step: int  # the last iteration's batch; 0 once the engine is idle
    num_context_last_step: int    # of which prefill (context) chunks
    critical_decodes_unscheduled: int
    num_preemptions: int
    # running totals
    num_steps: int
    num_generated_tokens: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int     # prompt tokens served from it
    # the resource manager's (morphing): layers per quantized precision, transitions, memory yield state
    layers_quantized: dict[str, int]
    swaps_total: int
    restores_total: int
    memory_yield: dict[str, Any]
    # memory: the ledger's budget split, and the flat gauges the catalogue exports
    memory: dict[str, Any]
    memory_held_bytes: int
    memory_yielded_bytes: int
    memory_yields_total: int
    memory_reclaims_total: int
    # health
    healthy: bool
    failed_iterations: int
    last_step_error: str | None = None
    memory_outside_free_bytes: int | None = field(default=None)  # None: no pressure source reads it

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (every field; nested dicts copied)."""
        return dataclasses.asdict(self)


def memory_gauges(ledger: dict[str, Any], mem: dict[str, Any]) -> dict[str, Any]:
    """The flat memory numbers of ``EngineStats`` from the ledger (``MemoryLedger.as_dict()``) and the resource
    manager's memory state: bytes held and given back, outside free memory, counts."""
    return {"memory_held_bytes": ledger["held"], "memory_yielded_bytes": mem.get("yielded_bytes", 0),
            "memory_yields_total": mem.get("yields_total", 0), "memory_reclaims_total": mem.get("reclaims_total", 0),
            "memory_outside_free_bytes": mem.get("outside_free_bytes")}
