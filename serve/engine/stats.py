"""``EngineStats``: what ``LLMEngine.stats()`` reports, one typed snapshot taken under the engine lock.

The front ends read it field by field: the metric catalogue (serve/metrics_catalogue.py) names a field per
engine metric, the Dynamo worker publishes ``kv_blocks_used`` / ``kv_blocks_total`` as its live capacity,
and ``as_dict()`` gives the JSON form (the worker's ``morph_state`` control, logs, bench outputs). The resource
managers' fields (layers, swaps, memory yield) come from their typed snapshots, never from the loop.
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
    # memory: the ledger's budget split and the bytes the engine holds
    memory: dict[str, Any]
    memory_held_bytes: int
    # health
    healthy: bool
    failed_iterations: int
    last_step_error: str | None = None
    # filled by the resource managers (ResourceStats.engine_fields(); serve/engine/resources.py); these defaults
    # are an engine that hosts none (mode off): no layer ever quantized, nothing given back
    layers_quantized: dict[str, int] = field(default_factory=dict)
    swaps_total: int = 0
    restores_total: int = 0
    memory_yield: dict[str, Any] = field(default_factory=dict)
    memory_yielded_bytes: int = 0
    memory_yields_total: int = 0
    memory_reclaims_total: int = 0
    memory_outside_free_bytes: int | None = None  # None: no pressure source reads it
    # the KV-precision rung (serve/engine/kv_rung.py): 8-bit blocks it added, conversions, running blocks re-written
    # as 8-bit, and the full-precision bytes its net extra blocks would take
    kv_blocks_8bit: int = 0
    kv_precision_conversions_total: int = 0
    kv_precision_reverts_total: int = 0
    kv_precision_blocks_rewritten_total: int = 0
    kv_precision_bytes_gained: int = 0
    # self-speculative decoding (serve/engine/spec_manager.py; vLLM's spec_decode names); 0: none drafted
    spec_decode_num_steps: int = 0            # iterations that drafted
    spec_decode_num_drafts: int = 0           # sequence drafts verified
    spec_decode_num_draft_tokens: int = 0     # draft tokens proposed
    spec_decode_num_accepted_tokens: int = 0  # of which the target agreed with
    spec_decode_draft_acceptance_rate: float = 0.0
    # the step-cost table checked while serving (serve/morph/cost_check.py): probes timed, tables measured again
    step_cost_probes: int = 0
    step_cost_corrections: int = 0
    # the quality meter (serve/engine/quality_meter.py): top-1 agreement with full precision over its window of
    # samples and Wilson's lower bound (None before a sample), mean total variation, samples, tokens served while
    # layers were quantized / to requests reading 8-bit KV, seconds spent on reference forwards
    quality_agreement: float | None = None
    quality_agreement_lower: float | None = None
    quality_divergence: float | None = None
    quality_samples_total: int = 0
    tokens_quantized_layers_total: int = 0
    tokens_kv_8bit_total: int = 0
    quality_meter_seconds_total: float = 0.0
    # every manager's own typed snapshot, by its name (e.g. resources["morph"]: MorphResourceStats)
    resources: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (every field; nested dicts copied)."""
        return dataclasses.asdict(self)


def resource_fields(resources: dict[str, Any]) -> dict[str, Any]:
    """The flat ``EngineStats`` fields the managers' snapshots fill; two managers filling one field is a bug."""
    fields: dict[str, Any] = {}
    for name, snapshot in resources.items():
        mine = snapshot.engine_fields()
        clash = sorted(set(mine) & set(fields))
        if clash:
            raise ValueError(f"resource manager {name!r} fills EngineStats fields {clash} another manager fills")
        unknown = sorted(set(mine) - _FIELD_NAMES)
        if unknown:
            raise ValueError(f"resource manager {name!r} fills fields EngineStats lacks: {unknown}")
        fields.update(mine)
    return fields


_FIELD_NAMES = {f.name for f in dataclasses.fields(EngineStats)}
