"""What a worker tells Dynamo about itself: live KV capacity/usage (the router's input and the worker's
``dynamo_component_total_blocks`` gauge), and the catalogue's metrics (serve/metrics_catalogue.py) bridged into
the worker's ``/metrics`` as exposition text: the engine's gauges and counters from ``EngineStats``, and the
request tracker's latency histograms and finish-reason counter (``RequestMetrics``), the names the Triton
model exports too.

The model card's ``total_kv_blocks`` is fixed at registration; a morph transition changes the pool, so the
live value goes through Dynamo's snapshot publisher after every engine step whose KV numbers changed
(every iteration that allocated or freed blocks, every swap/restore and pool resize).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from policy.precisions import QUANTIZED_PRECISIONS
from serve.engine.stats import EngineStats
from serve.logging_setup import get_logger
from serve.metrics_catalogue import (
    ENGINE_METRICS,
    LAYERS_QUANTIZED,
    PROMPT_TOKENS,
    REQUEST_HISTOGRAMS,
    REQUESTS_FINISHED,
    RequestHistogram,
    stat_value,
)

log = get_logger("morphserve.dynamo.metrics")


@dataclass(frozen=True)
class KvSnapshot:
    used_blocks: int
    total_blocks: int

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


class CapacityPublisher:
    """An engine step listener: publishes the KV snapshot when it changed.

    ``stats`` is ``LLMEngine.stats`` (None while there is no engine); ``publish(snapshot)`` hands it to Dynamo
    (set once the runtime attaches its publisher; until then snapshots are only remembered).
    """

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats
        self._lock = threading.Lock()
        self._publish: Callable[[KvSnapshot], None] | None = None
        self.last: KvSnapshot | None = None
        self.last_stats: EngineStats | None = None
        self.published = 0

    def attach(self, publish: Callable[[KvSnapshot], None]) -> None:
        with self._lock:
            self._publish = publish
            self.last = None  # publish the current state on the next step
        self.on_step()

    def on_step(self) -> None:
        """Called from the engine thread; never raises (the engine loop must keep serving)."""
        try:
            stats = self._stats()
            if stats is None:
                return
            snap = KvSnapshot(int(stats.kv_blocks_used), int(stats.kv_blocks_total))
            with self._lock:
                self.last_stats = stats
                if self._publish is None or snap == self.last:
                    return
                self._publish(snap)
                self.last = snap
                self.published += 1
        except Exception as exc:  # noqa: BLE001
            log.warning("kv_snapshot_publish_failed", error=f"{type(exc).__name__}: {exc}")


PRECISIONS = QUANTIZED_PRECISIONS  # one series per precision, 0 when none is quantized to it


def _labels(labels: Mapping[str, str], extra: Mapping[str, str] | None = None) -> str:
    items = {**labels, **(extra or {})}
    if not items:
        return ""
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in items.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def exposition(stats: EngineStats, labels: Mapping[str, str] | None = None) -> str:
    """Prometheus text for the engine's metrics (the names the Triton model exports too)."""
    labels = dict(labels or {})
    lines: list[str] = []
    for m in ENGINE_METRICS:  # the catalogue the Triton model exports too (serve/metrics_catalogue.py)
        value = stat_value(stats, m.stats_key)
        if value is None:
            continue
        lines += [f"# HELP {m.name} {m.help}", f"# TYPE {m.name} {m.kind}", f"{m.name}{_labels(labels)} {value:g}"]
    quantized = stats.layers_quantized or {}
    lines += [f"# HELP {LAYERS_QUANTIZED.name} {LAYERS_QUANTIZED.help}", f"# TYPE {LAYERS_QUANTIZED.name} gauge"]
    for precision in sorted(set(PRECISIONS) | set(quantized)):
        lines.append(f"morphserve_layers_quantized{_labels(labels, {'precision': precision})} "
                     f"{int(quantized.get(precision, 0))}")
    return "\n".join(lines) + "\n"


class RequestMetrics:
    """The request tracker's sink on a Dynamo worker (serve/request_tracker.py): the catalogue's request
    histograms and counters kept in memory, rendered with the engine's metrics on every scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # per histogram and label value (None: unlabelled): observations per bucket (the last: above every bound), sum
        self._counts: dict[tuple[str, str | None], list[int]] = {
            (h.name, None): [0] * (len(h.buckets) + 1) for h in REQUEST_HISTOGRAMS if h.label is None}
        self._sums: dict[tuple[str, str | None], float] = {key: 0.0 for key in self._counts}
        self._finished: dict[str, int] = {}
        self._prompt_tokens = 0

    def observe(self, metric: RequestHistogram, value: float, label: str | None = None) -> None:
        index = next((i for i, bound in enumerate(metric.buckets) if value <= bound), len(metric.buckets))
        key = (metric.name, label if metric.label else None)
        with self._lock:
            counts = self._counts.setdefault(key, [0] * (len(metric.buckets) + 1))
            counts[index] += 1
            self._sums[key] = self._sums.get(key, 0.0) + value

    def count_finished(self, reason: str, prompt_tokens: int) -> None:
        with self._lock:
            self._finished[reason] = self._finished.get(reason, 0) + 1
            self._prompt_tokens += max(0, prompt_tokens)

    def exposition(self, labels: Mapping[str, str] | None = None) -> str:
        """Prometheus text: each histogram's cumulative buckets, sum and count; the counters."""
        labels = dict(labels or {})
        lines: list[str] = []
        with self._lock:
            for h in REQUEST_HISTOGRAMS:
                lines += [f"# HELP {h.name} {h.help}", f"# TYPE {h.name} histogram"]
                values = sorted(v for name, v in self._counts if name == h.name and v is not None)
                for value in values if h.label else [None]:
                    series = {**labels, h.label: value} if h.label else labels
                    cumulative = 0
                    for bound, count in zip([*map(str, h.buckets), "+Inf"], self._counts[(h.name, value)]):
                        cumulative += count
                        lines.append(f"{h.name}_bucket{_labels(series, {'le': bound})} {cumulative}")
                    lines += [f"{h.name}_sum{_labels(series)} {self._sums[(h.name, value)]!r}",
                              f"{h.name}_count{_labels(series)} {cumulative}"]
            lines += [f"# HELP {REQUESTS_FINISHED.name} {REQUESTS_FINISHED.help}",
                      f"# TYPE {REQUESTS_FINISHED.name} counter"]
            lines += [f"{REQUESTS_FINISHED.name}{_labels(labels, {REQUESTS_FINISHED.label or 'reason': reason})} {n}"
                      for reason, n in sorted(self._finished.items())]
            lines += [f"# HELP {PROMPT_TOKENS.name} {PROMPT_TOKENS.help}", f"# TYPE {PROMPT_TOKENS.name} counter",
                      f"{PROMPT_TOKENS.name}{_labels(labels)} {self._prompt_tokens}"]
        return "\n".join(lines) + "\n"
