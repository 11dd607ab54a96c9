"""The engine's Prometheus metrics, named once: both front ends export them from ``LLMEngine.stats()``.

The Triton model (serve/triton/metrics.py, through the Python backend's custom-metrics API) and the Dynamo
worker (serve/dynamo/metrics.py, as exposition text on its system port) read this table, so a metric is
added in one place and has the same name, type and help text behind either front end. A gauge is set to
``stats[key]``; a counter follows the running total ``stats[key]``. Per-request latency histograms and the
finish-reason counter are the front ends' own (they see requests, the engine's stats do not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
    EngineMetric("morphserve_memory_yields_total", "counter", "Yield steps (layers or KV chunks given back).",
                 "memory_yields_total"),
    EngineMetric("morphserve_memory_reclaims_total", "counter", "Yielded transitions taken back.",
                 "memory_reclaims_total"),
)
LAYERS_QUANTIZED = EngineMetric("morphserve_layers_quantized", "gauge",
                                "Decoder layers currently held in each quantized precision.", "layers_quantized")
"""One series per precision (label ``precision``), from ``stats["layers_quantized"]``."""


def stat_value(stats: dict, key: str) -> float | None:
    """``stats[key]`` as a number (a bool as 0/1), None when the engine does not report it."""
    value = stats.get(key)
    return None if value is None else float(value)
