"""Repeated-run verdicts: each figure as the median of N runs with its spread, written ``median [min-max]``.

A single run on a shared machine moves by more than the differences between modes (the README's P95 TTFT
moved 0.3-0.5 s between two runs of one command), so the tools that compare modes run each N times,
interleaved by mode so a load change hits every mode alike, and report medians with the spread.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# (label, path into a replay result, scale, digits) of the figures a repeated replay reports.
FIGURES: tuple[tuple[str, tuple[str, ...], float, int], ...] = (
    ("P50 TTFT (s)", ("ttft_s", "p50"), 1, 3),
    ("P95 TTFT (s)", ("ttft_s", "p95"), 1, 3),
    ("P99 TTFT (s)", ("ttft_s", "p99"), 1, 3),
    ("mean TPOT (ms)", ("tpot_s", "mean"), 1e3, 1),
    ("SLO violation %", ("slo", "violation_rate"), 100, 1),
    ("goodput (req/s)", ("goodput_rps",), 1, 3),
    ("output tok/s", ("output_tok_s",), 1, 1),
    ("swaps", ("morph", "swaps"), 1, 0),
    ("restores", ("morph", "restores"), 1, 0),
    ("max quantized layers", ("morph", "max_quantized_layers"), 1, 0),
    ("quantized share %", ("morph", "time_weighted_quantized_share"), 100, 1),
    ("preemptions", ("morph", "preemptions"), 1, 0),
)


def median_call_us(fn: Callable[[], object], calls: int = 50, warmup: int = 3) -> float:
    """Median wall time of ``calls`` calls of ``fn`` (after ``warmup`` untimed ones), in microseconds: the
    microbenchmarks' cell."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, min, max and count (None when no run had the figure)."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def span(median: float, low: float, high: float, digits: int = 1, kind: str = "f") -> str:
    """``median [low-high]``: the one way the bench tools write a figure with its spread over runs (``kind``: a
    format type, ``"f"`` or ``"%"``)."""
    return f"{median:.{digits}{kind}} [{low:.{digits}{kind}}-{high:.{digits}{kind}}]"


def cell(values: Sequence[float], digits: int = 1, kind: str = "f") -> str:
    """``median [min-max]`` of runs (just the value for one run; n/a for none)."""
    if not values:
        return "n/a"
    med = statistics.median(values)
    return span(med, min(values), max(values), digits, kind) if len(values) > 1 else f"{med:.{digits}{kind}}"


def _get(result: Mapping[str, Any], path: Sequence[str]) -> float | None:
    value: Any = result
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return float(value) if isinstance(value, (int, float)) else None


def figure_values(runs: Sequence[Mapping[str, Any]], path: Sequence[str], scale: float = 1) -> list[float]:
    return [v * scale for r in runs if (v := _get(r, path)) is not None]


def summarize_runs(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, dict[str, dict]]:
    """``{mode: [result, ...]}`` -> ``{mode: {figure label: spread}}`` in the figures' own units."""
    return {mode: {label: spread(figure_values(rs, path, scale)) for label, path, scale, _ in FIGURES}
            for mode, rs in runs.items()}


def repeated_table(runs: Mapping[str, Sequence[Mapping[str, Any]]],
                   figures: Sequence[tuple[str, tuple[str, ...], float, int]] = FIGURES,
                   pick: Callable[[str], bool] = lambda label: True) -> str:
    """Markdown: one row per mode, each figure as ``median [min-max]`` over the runs."""
    chosen = [f for f in figures if pick(f[0])]
    lines = ["| mode | runs | " + " | ".join(f[0] for f in chosen) + " |", "|---|---:|" + "---:|" * len(chosen)]
    for mode, rs in runs.items():
        cells = [cell(figure_values(rs, path, scale), digits) for _, path, scale, digits in chosen]
        lines.append(f"| {mode} | {len(rs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
