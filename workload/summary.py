"""Morph events from a server log -> the layer configurations a run served, and the tokens generated in each.

One schema for the morph summary that the Triton benchmark and the offline replay both report.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from policy import PRECISION_CODE

MORPH_EVENTS = ("swap", "restore", "kv_shrink")


@dataclass
class MorphSummary:
    """The "morph" block of a result: what the engine did to its shape during a run. One schema whether it
    comes from the in-process engine (bench.replay) or from a server's log and metrics (bench.triton);
    None means the source does not report the figure."""

    swaps: int
    restores: int
    max_quantized_layers: int
    final_quantized_layers: int | None
    time_weighted_quantized_share: float
    kv_capacity_base_tokens: int | None
    kv_capacity_max_tokens: int | None
    mean_swap_ms: dict[str, float]
    preemptions: int | None
    extra: dict[str, object] = field(default_factory=dict)  # source-specific counts, e.g. events found in a log

    def as_dict(self) -> dict:
        return {"swaps": self.swaps, "restores": self.restores, **self.extra,
                "max_quantized_layers": self.max_quantized_layers,
                "final_quantized_layers": self.final_quantized_layers,
                "time_weighted_quantized_share": self.time_weighted_quantized_share,
                "kv_capacity_tokens": {"base": self.kv_capacity_base_tokens, "max": self.kv_capacity_max_tokens},
                "mean_swap_ms": self.mean_swap_ms, "preemptions": self.preemptions}


def time_weighted_quantized_share(timeline: Sequence[Mapping], num_layers: int, duration_s: float) -> float:
    """Mean over time of quantized layers / layers (each timeline sample holds until the next one)."""
    if duration_s <= 0 or num_layers <= 0:
        return 0.0
    weighted = sum(a["quantized_layers"] / num_layers * (b["t"] - a["t"]) for a, b in zip(timeline, timeline[1:]))
    return weighted / duration_s





def parse_morph_events(log_text: str) -> list[dict]:
    """The morph runtime's swap / restore / kv_shrink JSON lines from a server log, in log order.

    Triton's own lines and other JSON events are skipped; a truncated last line is ignored.
    """
    events = []
    for line in log_text.splitlines():
        line = line.strip()
        if not line.startswith("{") or '"event"' not in line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("event") in MORPH_EVENTS:
            events.append(rec)
    return events


def _epoch(ts: object) -> float | None:
    if not isinstance(ts, str):
        return None
    try:
        return dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def config_changes(events: Sequence[Mapping], num_layers: int,
                   tokens_at_epoch: Callable[[float], float] | None = None) -> list[tuple[int, str]]:
    """(tokens served, configuration signature after the event) per swap/restore/kv_shrink event.

    Uses the event's "config" and "tokens_served" fields when present. Without "config" the signature
    is rebuilt by applying each swap/restore (layer -> to_precision) to an all-full start; without
    "tokens_served" the count is interpolated at the event's timestamp with ``tokens_at_epoch`` (events
    it cannot place are dropped).
    """
    sig = ["f"] * num_layers
    out: list[tuple[int, str]] = []
    for e in events:
        if e.get("event") in ("swap", "restore") and isinstance(e.get("layer"), int) and 0 <= e["layer"] < num_layers:
            sig[e["layer"]] = PRECISION_CODE.get(str(e.get("to_precision")), "?")
        config = e.get("config") if isinstance(e.get("config"), str) else "".join(sig)
        sig = list(config) if len(config) == num_layers else sig
        tokens = e.get("tokens_served")
        if not isinstance(tokens, int):
            ts = _epoch(e.get("timestamp"))
            if tokens_at_epoch is None or ts is None:
                continue
            tokens = int(round(tokens_at_epoch(ts)))
        out.append((tokens, config))
    return out


def tokens_by_config(changes: Sequence[tuple[int, str]], initial: str, start_tokens: int,
                     end_tokens: int) -> dict[str, int]:
    """Tokens generated in each configuration within [start_tokens, end_tokens).

    ``changes`` are (tokens served when the configuration changed, new configuration) in order; the
    configuration before the first change is ``initial``. Counts are clipped to the window.
    """
    out: dict[str, int] = {}
    bounds = [(0, initial), *changes]
    for k, (t_from, config) in enumerate(bounds):
        t_to = bounds[k + 1][0] if k + 1 < len(bounds) else max(end_tokens, t_from)
        lo, hi = max(t_from, start_tokens), min(t_to, end_tokens)
        if hi > lo:
            out[config] = out.get(config, 0) + (hi - lo)
    return out


def morph_summary(events: Sequence[Mapping], timeline: Sequence[Mapping], final: Mapping | None, num_layers: int,
                  duration_s: float, block_size: int) -> dict:
    """The bench.replay "morph" fields, from the server's events, sampled metrics and final scrape."""
    swaps = [e for e in events if e.get("event") == "swap"]
    restores = [e for e in events if e.get("event") == "restore"]
    counts = [sum(1 for c in str(e.get("config", "")) if c not in "f?") for e in events if e.get("config")]
    max_q = max([*counts, *(p["quantized_layers"] for p in timeline)], default=0)
    base_blocks = None
    if swaps and isinstance(swaps[0].get("kv_blocks_total"), int):
        base_blocks = swaps[0]["kv_blocks_total"] - int(swaps[0].get("blocks_added") or 0)
    kv_caps = [p["kv_capacity_tokens"] for p in timeline] + ([final["kv_capacity_tokens"]] if final else [])
    kv_caps += [int(e["kv_blocks_total"]) * block_size for e in events if isinstance(e.get("kv_blocks_total"), int)]
    base = base_blocks * block_size if base_blocks is not None else (kv_caps[0] if kv_caps else None)
    swap_ms: dict[str, list[float]] = {}
    for e in [*swaps, *restores]:
        if isinstance(e.get("time_ms"), (int, float)):
            swap_ms.setdefault(f"{e.get('from_precision')}->{e.get('to_precision')}", []).append(float(e["time_ms"]))
    return MorphSummary(
        swaps=(final or {}).get("swaps", len(swaps)),
        restores=(final or {}).get("restores", len(restores)),
        max_quantized_layers=max_q,
        final_quantized_layers=(final or {}).get("quantized_layers"),
        time_weighted_quantized_share=time_weighted_quantized_share(timeline, num_layers, duration_s),
        kv_capacity_base_tokens=base,
        kv_capacity_max_tokens=max(kv_caps, default=None),
        mean_swap_ms={k: round(sum(v) / len(v), 3) for k, v in swap_ms.items()},
        preemptions=None,  # not exported by the server's metrics
        extra={"swap_events_in_log": len(swaps), "restore_events_in_log": len(restores)},
    ).as_dict()
