"""What a worker tells Dynamo about itself: live KV capacity/usage (the router's input and the worker's
``dynamo_component_total_blocks`` gauge) and the morph gauges, bridged into the worker's ``/metrics``.

The model card's ``total_kv_blocks`` is fixed at registration; a morph transition changes the pool, so the
live value goes through Dynamo's snapshot publisher after every engine step whose KV numbers changed
(every iteration that allocated or freed blocks, every swap/restore and pool resize).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from serve.logging_setup import get_logger
from serve.metrics_catalogue import ENGINE_METRICS, LAYERS_QUANTIZED, stat_value

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

    ``stats`` is ``LLMEngine.stats``; ``publish(snapshot)`` hands it to Dynamo (set once the runtime
    attaches its publisher; until then snapshots are only remembered).
    """

    def __init__(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self._stats = stats
        self._lock = threading.Lock()
        self._publish: Callable[[KvSnapshot], None] | None = None
        self.last: KvSnapshot | None = None
        self.last_stats: Mapping[str, Any] = {}
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
            if not stats:
                return
            snap = KvSnapshot(int(stats["kv_blocks_used"]), int(stats["kv_blocks_total"]))
            with self._lock:
                self.last_stats = stats
                if self._publish is None or snap == self.last:
                    return
                self._publish(snap)
                self.last = snap
                self.published += 1
        except Exception as exc:  # noqa: BLE001
            log.warning("kv_snapshot_publish_failed", error=f"{type(exc).__name__}: {exc}")


PRECISIONS = ("int8", "int4", "fp8")


def _labels(labels: Mapping[str, str], extra: Mapping[str, str] | None = None) -> str:
    items = {**labels, **(extra or {})}
    if not items:
        return ""
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in items.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def exposition(stats: Mapping[str, Any], labels: Mapping[str, str] | None = None) -> str:
    """Prometheus text for the morph gauges (the names the Triton model exports too)."""
    labels = dict(labels or {})
    lines: list[str] = []
    for m in ENGINE_METRICS:  # the catalogue the Triton model exports too (serve/metrics_catalogue.py)
        value = stat_value(stats, m.stats_key)
        if value is None:
            continue
        lines += [f"# HELP {m.name} {m.help}", f"# TYPE {m.name} {m.kind}", f"{m.name}{_labels(labels)} {value:g}"]
    quantized = stats.get("layers_quantized") or {}
    lines += [f"# HELP {LAYERS_QUANTIZED.name} {LAYERS_QUANTIZED.help}", f"# TYPE {LAYERS_QUANTIZED.name} gauge"]
    for precision in sorted(set(PRECISIONS) | set(quantized)):
        lines.append(f"morphserve_layers_quantized{_labels(labels, {'precision': precision})} "
                     f"{int(quantized.get(precision, 0))}")
    return "\n".join(lines) + "\n"
