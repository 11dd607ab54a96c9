"""The Triton model's Prometheus families (prefix ``morphserve_``) through the Python backend's custom
metrics API. ``pb_utils`` (triton_python_backend_utils, importable only inside the backend's stub) is
passed in, so this module imports without Triton."""

from __future__ import annotations

import threading
from typing import Any

from policy import QUANTIZED_PRECISIONS
from serve.metrics_catalogue import (
    ENGINE_METRICS,
    LAYERS_QUANTIZED,
    PROMPT_TOKENS,
    REQUEST_HISTOGRAMS,
    REQUESTS_FINISHED,
    RequestHistogram,
    stat_value,
)

# TensorRT-LLM's gauge families (tensorrtllm_backend's custom metrics reporter): label -> what we export.
# kv_cache_block_type: max = blocks in the pool now (it grows when layers are quantized), free, used,
# tokens_per = tokens per block, fraction = used / max.
# request_type: active = requests in the running batch, max = the cap on it (max_num_seqs), scheduled =
# sequences in the last iteration, context = of which prefill (context) chunks, waiting = queued.
TRTLLM_KV_TYPES = ("max", "free", "used", "tokens_per", "fraction")
TRTLLM_REQUEST_TYPES = ("active", "max", "scheduled", "context", "waiting")


class _Histogram:
    """A Prometheus histogram; falls back to ``<name>_sum``/``<name>_count`` counters when the Python
    backend has no HISTOGRAM kind (it has one in Triton 2.51)."""

    def __init__(self, pb: Any, families: list[Any], name: str, description: str, labels: dict[str, str],
                 buckets: list[float]) -> None:
        self._pb = pb
        if hasattr(self._pb.MetricFamily, "HISTOGRAM"):
            fam = self._pb.MetricFamily(name=name, description=description, kind=self._pb.MetricFamily.HISTOGRAM)
            families.append(fam)
            self._hist = fam.Metric(labels=labels, buckets=buckets)
            self._sum = self._count = None
        else:  # pragma: no cover - older Triton
            self._hist = None
            fs = self._pb.MetricFamily(name=f"{name}_sum", description=description, kind=self._pb.MetricFamily.COUNTER)
            fc = self._pb.MetricFamily(name=f"{name}_count", description=description,
                                       kind=self._pb.MetricFamily.COUNTER)
            families += [fs, fc]
            self._sum, self._count = fs.Metric(labels=labels), fc.Metric(labels=labels)

    def observe(self, value: float) -> None:
        if self._hist is not None:
            self._hist.observe(value)
        else:  # pragma: no cover
            self._sum.increment(value)
            self._count.increment(1)


class Metrics:
    """The model's Prometheus families (project prefix ``morphserve_``), fed from ``engine.stats()`` and,
    as the request tracker's sink (serve/request_tracker.py), from the per-request timings."""

    def __init__(self, pb_utils: Any, model_name: str, version: str) -> None:
        self._pb = pb_utils
        # MetricFamily objects must stay referenced: a collected family disappears from /metrics.
        self._families: list[Any] = []
        self._labels = {"model": model_name, "version": version}
        self._lock = threading.Lock()
        g = self._family_metric
        # the engine's metrics, from the one catalogue both front ends use (serve/metrics_catalogue.py)
        self._engine = {m.stats_key: (m, g(m.name, m.help, m.kind.upper())) for m in ENGINE_METRICS}
        self._engine["healthy"][1].set(1.0)
        self.prompt_tokens = g(PROMPT_TOKENS.name, PROMPT_TOKENS.help, "COUNTER")
        self._histograms = {h.name: _Histogram(self._pb, self._families, h.name, h.help, self._labels, list(h.buckets))
                            for h in REQUEST_HISTOGRAMS if h.label is None}
        self._labelled_histograms = {h.name: self._new_family(h.name, h.help, "HISTOGRAM")
                                     for h in REQUEST_HISTOGRAMS if h.label is not None}
        self._labelled_series: dict[tuple[str, str], Any] = {}
        self._layers_family = self._new_family(LAYERS_QUANTIZED.name, LAYERS_QUANTIZED.help, "GAUGE")
        self._layers: dict[str, Any] = {}
        for precision in QUANTIZED_PRECISIONS:  # present (at 0) from the start, for dashboards
            self._layers[precision] = self._layers_family.Metric(labels={**self._labels, "precision": precision})
            self._layers[precision].set(0.0)
        self._finished_family = self._new_family(REQUESTS_FINISHED.name, REQUESTS_FINISHED.help, "COUNTER")
        self._finished: dict[str, Any] = {}
        self._last_totals = {m.stats_key: 0.0 for m in ENGINE_METRICS if m.kind == "counter"}
        self._trtllm_kv = self._labelled("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics",
                                         "kv_cache_block_type", TRTLLM_KV_TYPES)
        self._trtllm_requests = self._labelled("nv_trt_llm_request_metrics", "TRT LLM request metrics",
                                               "request_type", TRTLLM_REQUEST_TYPES)

    def _labelled(self, name: str, description: str, label: str, values: tuple[str, ...]) -> dict[str, Any]:
        """One gauge family with one metric per value of ``label`` (all present from the start, at 0)."""
        fam = self._new_family(name, description, "GAUGE")
        out = {v: fam.Metric(labels={**self._labels, label: v}) for v in values}
        for m in out.values():
            m.set(0.0)
        return out

    def _new_family(self, name: str, description: str, kind: str) -> Any:
        fam = self._pb.MetricFamily(name=name, description=description, kind=getattr(self._pb.MetricFamily, kind))
        self._families.append(fam)
        return fam

    def _family_metric(self, name: str, description: str, kind: str) -> Any:
        return self._new_family(name, description, kind).Metric(labels=self._labels)

    def update_from_stats(self, stats: Any) -> None:
        """Copy ``engine.stats()`` (an ``EngineStats``) into the gauges; totals become counter increments."""
        with self._lock:
            for key, (metric, series) in self._engine.items():
                value = stat_value(stats, key)
                if value is None:
                    continue
                if metric.kind == "gauge":
                    series.set(value)
                elif value > self._last_totals[key]:  # a running total becomes counter increments
                    series.increment(value - self._last_totals[key])
                    self._last_totals[key] = value
            layers = dict(stats.layers_quantized or {})
            for precision in set(layers) | set(self._layers):
                m = self._layers.get(precision)
                if m is None:
                    m = self._layers[precision] = self._layers_family.Metric(
                        labels={**self._labels, "precision": str(precision)})
                m.set(float(layers.get(precision, 0)))
            self._update_trtllm(stats)

    def _update_trtllm(self, stats: Any) -> None:
        total, used = float(stats.kv_blocks_total), float(stats.kv_blocks_used)
        kv = {"max": total, "free": total - used, "used": used, "tokens_per": float(stats.block_size),
              "fraction": used / total if total else 0.0}
        for key, value in kv.items():
            self._trtllm_kv[key].set(value)
        requests = {"active": stats.num_running, "max": stats.max_num_seqs, "scheduled": stats.num_scheduled_last_step,
                    "context": stats.num_context_last_step, "waiting": stats.num_waiting}
        for key, value in requests.items():
            self._trtllm_requests[key].set(float(value))

    def observe(self, metric: RequestHistogram, value: float, label: str | None = None) -> None:
        """The request tracker's latency observations; a labelled histogram's series made at its value's first use."""
        if metric.label is None:
            self._histograms[metric.name].observe(value)
            return
        if label is None:  # a labelled histogram observed without its label: no series to put it in
            return
        with self._lock:
            series = self._labelled_series.get((metric.name, label))
            if series is None:
                series = self._labelled_series[(metric.name, label)] = self._labelled_histograms[metric.name].Metric(
                    labels={**self._labels, metric.label: label}, buckets=list(metric.buckets))
        series.observe(value)

    def count_finished(self, reason: str, prompt_tokens: int) -> None:
        """The request tracker's finished requests: one per request, by finish reason."""
        with self._lock:
            m = self._finished.get(reason)
            if m is None:
                m = self._finished[reason] = self._finished_family.Metric(
                    labels={**self._labels, REQUESTS_FINISHED.label: reason})
            m.increment(1)
            if prompt_tokens > 0:
                self.prompt_tokens.increment(prompt_tokens)
