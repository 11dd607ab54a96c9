"""From the load's records, the fault's window and the frontend's log: one fault's numbers, and the median of
its repeats.

Phases (:func:`in_phase`): ``before`` holds the requests that finished before the fault began, ``during``
those in flight at some point between the fault and the cluster's recovery (or the fault's removal if it never
recovered), ``after`` those that started after recovery. TTFT is the client's: from the first try of a request
to its first token (client retries included). Throughput counts the tokens of answered requests that ended in
the phase's time span, per second of it. End-to-end latency (``e2e_p95_s``) shows what TTFT cannot: a stream that
stalled after its first token.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.dynamo_faults.faults import Window
from bench.dynamo_faults.load import Record
from serve.dynamo.frontend_log import Attempt, response_id
from workload.latency import percentiles


def p95(values: list[float]) -> float | None:
    """The 95th percentile by the method every report here uses (workload.latency.percentiles)."""
    got = percentiles(values, (95,))
    return None if got is None else got[0]


def migrated(rec: Record, attempts: dict[str, list[Attempt]]) -> bool:
    return any(len(attempts.get(response_id(r), [])) > 1 for r in rec.response_ids)


def longest_gap(records: list[Record], lo: float, hi: float) -> float:
    """The longest stretch of [lo, hi] in which no request finished with an answer (what clients saw as outage)."""
    ends = sorted(r.end for r in records if r.outcome == "answered" and lo <= r.end <= hi)
    marks = [lo, *ends, hi]
    return max(b - a for a, b in zip(marks, marks[1:]))


def in_phase(rec: Record, phase: str, start: float, until: float) -> bool:
    """before: finished before the fault began; during: in flight at some point of [start, until); after: started
    once the cluster had recovered."""
    end = rec.end or float("inf")
    if phase == "before":
        return end < start
    if phase == "during":
        return rec.start < until and end >= start
    return rec.start >= until


def summarize(records: list[Record], window: Window, t0: float, t_end: float,
              attempts: dict[str, list[Attempt]], probe: dict[str, Any],
              expected: dict[int, str] | None = None) -> dict[str, Any]:
    mine = [r for r in records if t0 <= r.start <= t_end]
    until = window.recovered if window.recovered is not None else window.end
    phases = {"before": (t0, window.start), "during": (window.start, until), "after": (until, t_end)}
    answered = [r for r in mine if r.outcome == "answered"]
    out: dict[str, Any] = {
        "requests": len(mine),
        "answered": len(answered),
        "migrated": sum(migrated(r, attempts) for r in answered),
        "retried": sum(r.tries > 1 for r in answered),
        "failed": sum(r.outcome == "failed" for r in mine),
        "lost": sum(r.outcome == "lost" for r in mine),
        "lost_detail": {d: sum(r.outcome == "lost" and r.detail == d for r in mine) for d
                        in ("hung", "truncated", "wrong")},
        "failed_errors": sorted({r.detail for r in mine if r.outcome == "failed"})[:5],
        "lost_examples": [{"prompt": r.prompt, "detail": r.detail, "tries": r.tries,
                           "at_s": round(r.start - window.start, 2),
                           "text": r.text, "expected": (expected or {}).get(r.prompt),
                           "routes": {rid: [a.__dict__ for a in attempts.get(response_id(rid), [])] for rid
                                      in r.response_ids}}
                          for r in mine if r.outcome == "lost"][:3],
        "fault_s": round(window.end - window.start, 2),
        "outage_s": None if window.recovered is None else round(window.recovered - window.start, 2),
        "recover_after_removal_s": None if window.recovered is None
        else round(max(0.0, window.recovered - window.end), 2),
        "longest_gap_s": round(longest_gap(mine, window.start, until), 2),
        "ttft_p95_s": {}, "e2e_p95_s": {}, "throughput_tok_s": {}, "requests_by_phase": {},
        "stale_routes": probe["stale_routes"], "probe_overlap_blocks": probe["overlap_blocks"],
        "registrations_clean_after_s": (None if window.clean is None else round(window.clean - window.start, 2)),
        "notes": window.notes,
    }
    for name, (lo, hi) in phases.items():
        members = [r for r in answered if in_phase(r, name, window.start, until)]
        value = p95([r.ttft for r in members if r.ttft is not None])
        out["ttft_p95_s"][name] = None if value is None else round(value, 3)
        e2e = p95([r.end - r.start for r in members])
        out["e2e_p95_s"][name] = None if e2e is None else round(e2e, 3)
        ended = sum(r.tokens for r in answered if lo <= r.end < hi)
        out["throughput_tok_s"][name] = round(ended / (hi - lo), 2) if hi > lo else None
        out["requests_by_phase"][name] = sum(in_phase(r, name, window.start, until) for r in mine)
    return out


def median_of(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every number over the repeats (nested dicts too); counts of lost and failed are summed
    as well, so one bad repeat cannot hide behind two good ones."""
    def merge(values: list[Any]) -> Any:
        if all(isinstance(v, dict) for v in values):
            return {k: merge([v.get(k) for v in values]) for k in values[0]}
        nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return round(statistics.median(nums), 3) if nums and len(nums) == len(values) else None
    keys = ("requests", "answered", "migrated", "retried", "failed", "lost", "fault_s", "outage_s",
            "recover_after_removal_s", "longest_gap_s", "registrations_clean_after_s", "ttft_p95_s", "e2e_p95_s",
            "throughput_tok_s", "stale_routes")
    med = {k: merge([r[k] for r in repeats]) for k in keys}
    med["lost_total"] = sum(r["lost"] for r in repeats)
    med["failed_total"] = sum(r["failed"] for r in repeats)
    return med
