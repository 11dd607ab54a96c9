"""MorphServe's Prometheus metrics, named once: both front ends export what this table lists.

The Triton model (serve/triton/metrics.py, through the Python backend's custom-metrics API) and the Dynamo
worker (serve/dynamo/metrics.py, as exposition text on its system port) read this table, so a metric is
added in one place and has the same name, type and help text behind either front end.

- Engine metrics come from ``LLMEngine.stats()`` (an ``EngineStats``): a gauge is set to the field
  ``stats_key``; a counter follows that field's running total.
- Request metrics (latency histograms, the finish-reason and prompt-token counters) come from the request
  tracker (serve/request_tracker.py), which both front ends feed with the engine's outputs per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class EngineMetric:
    name: str
    kind: Literal["gauge", "counter"]
    help: str
    stats_key: str


ENGINE_METRICS: tuple[EngineMetric, ...] = (
    EngineMetric("morphserve_kv_cache_usage_perc", "gauge", "KV-cache usage: used / total blocks (0-1).",
                 "kv_cache_usage_perc"),
    EngineMetric("morphserve_kv_blocks_used", "gauge", "KV-cache blocks in use.", "kv_blocks_used"),
    EngineMetric("morphserve_kv_blocks_total", "gauge",
                 "KV-cache blocks in the pool now (grows when layers are quantized).", "kv_blocks_total"),
    EngineMetric("morphserve_kv_blocks_base", "gauge", "KV-cache blocks with every layer at full precision.",
                 "kv_blocks_base"),
    EngineMetric("morphserve_num_requests_running", "gauge", "Requests in the running batch.", "num_running"),
    EngineMetric("morphserve_num_requests_waiting", "gauge", "Requests waiting to be scheduled.", "num_waiting"),
    EngineMetric("morphserve_engine_healthy", "gauge",
                 "1 while the engine serves; 0 after repeated failed iterations (requests are refused).", "healthy"),
    EngineMetric("morphserve_swaps_total", "counter", "Layers swapped to a quantized variant.", "swaps_total"),
    EngineMetric("morphserve_restores_total", "counter", "Layers restored to a milder variant or full precision.",
                 "restores_total"),
    EngineMetric("morphserve_num_preemptions_total", "counter",
                 "Running requests preempted (KV blocks freed, recomputed later).", "num_preemptions"),
    EngineMetric("morphserve_prefix_cache_queries_total", "counter",
                 "Prompt tokens looked up in the prefix cache at admission.", "prefix_cache_queries"),
    EngineMetric("morphserve_prefix_cache_hits_total", "counter",
                 "Prompt tokens served from the prefix cache (their KV reused, not recomputed).", "prefix_cache_hits"),
    EngineMetric("morphserve_generation_tokens_total", "counter", "Generated tokens.", "num_generated_tokens"),
    EngineMetric("morphserve_memory_held_bytes", "gauge", "Bytes the engine holds (budget minus what it gave back).",
                 "memory_held_bytes"),
    EngineMetric("morphserve_memory_yielded_bytes", "gauge",
                 "Bytes given back to the device or host under outside pressure.", "memory_yielded_bytes"),
    EngineMetric("morphserve_memory_outside_free_bytes", "gauge",
                 "Free memory outside the engine as its pressure source reads it.", "memory_outside_free_bytes"),
    EngineMetric("morphserve_memory_yields_total", "counter", "Yield steps (layers or KV extents given back).",
                 "memory_yields_total"),
    EngineMetric("morphserve_memory_reclaims_total", "counter", "Yielded transitions taken back.",
                 "memory_reclaims_total"),
    EngineMetric("morphserve_kv_blocks_8bit", "gauge",
                 "KV-cache blocks the KV-precision rung holds in 8 bits (the rest of kv_blocks_total are full "
                 "precision, or all 8-bit with kv_cache_dtype int8/fp8).", "kv_blocks_8bit"),
    EngineMetric("morphserve_kv_precision_conversions_total", "counter",
                 "Free full-precision KV slots turned into 8-bit blocks (conversions).",
                 "kv_precision_conversions_total"),
    EngineMetric("morphserve_kv_precision_reverts_total", "counter",
                 "8-bit KV extents turned back into full-precision slots.", "kv_precision_reverts_total"),
    EngineMetric("morphserve_kv_precision_blocks_rewritten_total", "counter",
                 "Running sequences' full-precision KV blocks re-written as 8-bit blocks in place.",
                 "kv_precision_blocks_rewritten_total"),
    EngineMetric("morphserve_kv_precision_bytes_gained", "gauge",
                 "Full-precision KV bytes the KV-precision rung's extra blocks stand for.",
                 "kv_precision_bytes_gained"),
    # self-speculative decoding, named after vLLM's vllm:spec_decode_* series
    EngineMetric("morphserve_spec_decode_num_drafts_total", "counter",
                 "Sequence drafts verified (self-speculative decoding).", "spec_decode_num_drafts"),
    EngineMetric("morphserve_spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
                 "spec_decode_num_draft_tokens"),
    EngineMetric("morphserve_spec_decode_num_accepted_tokens_total", "counter",
                 "Draft tokens the full-precision verification accepted.", "spec_decode_num_accepted_tokens"),
    EngineMetric("morphserve_spec_decode_draft_acceptance_rate", "gauge",
                 "Accepted over proposed draft tokens so far (0 before any draft).",
                 "spec_decode_draft_acceptance_rate"),
    EngineMetric("morphserve_spec_decode_num_steps_total", "counter", "Engine iterations that drafted.",
                 "spec_decode_num_steps"),
    # the step-cost table checked while serving (serve/morph/cost_check.py, policy/cost_drift.py)
    EngineMetric("morphserve_step_cost_probes_total", "counter",
                 "Probes of the step-cost table timed while serving.", "step_cost_probes"),
    EngineMetric("morphserve_step_cost_corrections_total", "counter",
                 "Step-cost tables measured again while serving because quiet probes said the table was off.",
                 "step_cost_corrections"),
    # the quality meter (serve/engine/quality_meter.py, docs/quality.md): sampled positions of running requests
    # compared with full precision on the same context while layers are quantized or KV is 8-bit
    EngineMetric("morphserve_quality_agreement", "gauge",
                 "Top-1 next-token agreement with full precision over the quality meter's window of samples (unset "
                 "before the first sample).", "quality_agreement"),
    EngineMetric("morphserve_quality_agreement_lower", "gauge",
                 "Wilson lower bound of that agreement at the policy's quality_confidence (what quality_floor reads).",
                 "quality_agreement_lower"),
    EngineMetric("morphserve_quality_divergence", "gauge",
                 "Mean total variation distance between the served and the full-precision next-token distributions "
                 "over the window (0-1).", "quality_divergence"),
    EngineMetric("morphserve_quality_samples_total", "counter", "Positions the quality meter compared.",
                 "quality_samples_total"),
    EngineMetric("morphserve_quality_meter_seconds_total", "counter",
                 "Seconds the quality meter spent on full-precision reference forwards.",
                 "quality_meter_seconds_total"),
    EngineMetric("morphserve_tokens_quantized_layers_total", "counter",
                 "Generated tokens served while some decoder layer was quantized (of generation_tokens_total).",
                 "tokens_quantized_layers_total"),
    EngineMetric("morphserve_tokens_kv_8bit_total", "counter",
                 "Generated tokens served to requests reading 8-bit KV blocks (of generation_tokens_total).",
                 "tokens_kv_8bit_total"),
)
LAYERS_QUANTIZED = EngineMetric("morphserve_layers_quantized", "gauge",
                                "Decoder layers currently held in each quantized precision.", "layers_quantized")
"""One series per precision (label ``precision``), from ``EngineStats.layers_quantized``."""


def stat_value(stats: Any, key: str) -> float | None:
    """The ``EngineStats`` field ``key`` as a number (a bool as 0/1), None when the engine does not report it."""
    value = getattr(stats, key, None)
    return None if value is None else float(value)


@dataclass(frozen=True)
class RequestHistogram:
    """A per-request latency histogram (seconds), observed by the request tracker; ``label`` names its one label,
    if any (one series per value)."""
    name: str
    help: str
    buckets: tuple[float, ...]
    label: str | None = None


@dataclass(frozen=True)
class RequestCounter:
    """A per-request counter, incremented by the request tracker; ``label`` names its one label, if any."""
    name: str
    help: str
    label: str | None = None


# Buckets (seconds): vLLM's, with finer low buckets for small models on CPU.
TIME_TO_FIRST_TOKEN = RequestHistogram(
    "morphserve_time_to_first_token_seconds", "Time from request arrival at the front end to its first token.",
    (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0,
     40.0, 80.0, 160.0))
INTER_TOKEN_LATENCY = RequestHistogram(
    "morphserve_inter_token_latency_seconds", "Gap between consecutive tokens of a request.",
    (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0))
TIER_INTER_TOKEN_LATENCY = RequestHistogram(
    "morphserve_tier_inter_token_latency_seconds",
    "Gap between consecutive tokens of a request, by the request's SLO tier (0 = strict): the TBT promise per tier.",
    INTER_TOKEN_LATENCY.buckets, label="tier")
E2E_REQUEST_LATENCY = RequestHistogram(
    "morphserve_e2e_request_latency_seconds", "Time from request arrival at the front end to its final response.",
    (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0))
REQUEST_QUEUE_TIME = RequestHistogram(
    "morphserve_request_queue_time_seconds", "Time from arrival at the engine to first scheduling.",
    (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0))
REQUEST_HISTOGRAMS: tuple[RequestHistogram, ...] = (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, TIER_INTER_TOKEN_LATENCY,
                                                    E2E_REQUEST_LATENCY, REQUEST_QUEUE_TIME)
REQUESTS_FINISHED = RequestCounter("morphserve_requests_finished_total",
                                   "Finished requests by finish reason (cancelled, timeout, overloaded included).",
                                   label="finish_reason")
PROMPT_TOKENS = RequestCounter("morphserve_prompt_tokens_total", "Prompt tokens of finished requests.")
