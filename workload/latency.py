"""Client-side latency metrics with the definitions of ``vllm bench serve`` (vllm/benchmarks/serve.py).

Naming follows vLLM (not AIPerf, which calls vLLM's TPOT "ITL" and vLLM's ITL "ICL"):

- TTFT: first streamed token time - send time.
- TPOT: (E2EL - TTFT) / (num_output_tokens - 1), only for requests with more than one output token.
- ITL: every gap between consecutive streamed tokens (chunks), pooled over all requests.
- E2EL: last streamed token time - send time.
- Goodput: requests per second that complete and meet every SLO given.

Only completed requests enter the latency distributions; failed ones count in ``failed`` and as SLO
violations. Percentiles use numpy's default (linear interpolation); an empty distribution yields
``None`` for every statistic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 95, 99)


@dataclass
class RequestTiming:
    """What the client saw of one request, all times absolute seconds on one clock.

    ``token_times_s`` holds the receive time of each streamed token (or chunk);
    ``num_output_tokens`` is the number of generated tokens, which may exceed
    ``len(token_times_s)`` when a chunk carries several tokens (TPOT uses the token count, ITL the
    chunk gaps, as in vLLM). A request is *completed* when ``ok`` and at least one token arrived.
    """

    send_s: float
    token_times_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    ok: bool = True
    error: str | None = None

    def __post_init__(self) -> None:
        if self.num_output_tokens < 0:
            raise ValueError(f"num_output_tokens must be >= 0, got {self.num_output_tokens}")
        times = self.token_times_s
        if times and times[0] < self.send_s:
            raise ValueError(f"first token time {times[0]} is before send time {self.send_s}")
        if any(b < a for a, b in zip(times, times[1:])):
            raise ValueError("token_times_s must be non-decreasing")

    @property
    def completed(self) -> bool:
        return self.ok and bool(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.send_s if self.token_times_s else None

    @property
    def e2el_s(self) -> float | None:
        return self.token_times_s[-1] - self.send_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """None for single-token outputs, where time per output token is undefined."""
        if not self.token_times_s or self.num_output_tokens <= 1:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:])]


def percentiles(values: Sequence[float], pcts: Sequence[float] = PERCENTILES) -> list[float] | None:
    """``pcts`` percentiles of ``values`` by numpy's default (linear) method, the one every report here uses (the
    morph runtime's windows compute the same, serve/morph/latency_window.py); None when ``values`` is empty.
    ``statistics.quantiles`` (exclusive method) gives other p95s on small samples: do not use it for reports."""
    if len(values) == 0:
        return None
    return [float(x) for x in np.percentile(np.asarray(values, dtype=float), list(pcts))]


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """{p50, p95, p99, mean} of ``values`` (numpy linear percentiles); all None when empty."""
    keys = [f"p{p}" for p in PERCENTILES] + ["mean"]
    if len(values) == 0:
        return dict.fromkeys(keys)
    return dict(zip(keys, [*percentiles(values), float(np.mean(values))]))


def meets_slo(t: RequestTiming, slo_ttft_s: float, slo_tpot_s: float | None = None) -> bool:
    """Completed, TTFT <= slo_ttft_s and (when given, and defined) TPOT <= slo_tpot_s.

    A single-token request has no TPOT and passes the TPOT SLO (vLLM's goodput counts it as 0).
    """
    if not t.completed:
        return False
    ttft = t.ttft_s
    if ttft is None or ttft > slo_ttft_s:
        return False
    tpot = t.tpot_s
    return slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s


def summarize(
    timings: Sequence[RequestTiming],
    duration_s: float,
    slo_ttft_s: float,
    slo_tpot_s: float | None = None,
) -> dict:
    """Aggregate per-request timings of one benchmark run into vLLM-style metrics.

    ``duration_s`` is the run's wall time (first send to last completion, as vLLM measures it);
    rates are None when it is 0. The SLO violation rate is over ALL requests, failed ones counting
    as violations; None when there are no requests.
    """
    if duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    done = [t for t in timings if t.completed]
    good = sum(meets_slo(t, slo_ttft_s, slo_tpot_s) for t in timings)
    n = len(timings)
    return {
        "num_requests": n,
        "completed": len(done),
        "failed": n - len(done),
        "duration_s": duration_s,
        "ttft_s": distribution([t.ttft_s for t in done]),  # type: ignore[misc]
        "tpot_s": distribution([t.tpot_s for t in done if t.tpot_s is not None]),
        "itl_s": distribution([gap for t in done for gap in t.itls_s]),
        "e2el_s": distribution([t.e2el_s for t in done]),  # type: ignore[misc]
        "slo": {
            "ttft_s": slo_ttft_s,
            "tpot_s": slo_tpot_s,
            "violation_rate": (n - good) / n if n else None,
        },
        "goodput_rps": _rate(good, duration_s),
        "request_throughput_rps": _rate(len(done), duration_s),
        "output_tok_s": _rate(sum(t.num_output_tokens for t in done), duration_s),
    }


def by_tier(timings: Sequence[RequestTiming], tiers: Sequence[int], tbt_targets: Sequence[float]) -> dict:
    """The result's "tiers" block: per tier (str key, as in JSON) the same latency blocks as the top level,
    the request count, the TBT target(s) and whether the tier's P99 TBT (P99 of its token gaps, ITL) met
    the strictest of them."""
    if not len(timings) == len(tiers) == len(tbt_targets):
        raise ValueError("timings, tiers and tbt_targets must have one entry per request")
    out: dict[str, dict] = {}
    for tier in sorted(set(tiers)):
        idx = [i for i, t in enumerate(tiers) if t == tier]
        done = [timings[i] for i in idx if timings[i].completed]
        target = min(tbt_targets[i] for i in idx)
        itl = distribution([gap for t in done for gap in t.itls_s])
        out[str(tier)] = {
            "num_requests": len(idx), "completed": len(done),
            "ttft_s": distribution([t.ttft_s for t in done]),  # type: ignore[misc]
            "tpot_s": distribution([t.tpot_s for t in done if t.tpot_s is not None]),
            "itl_s": itl,
            "e2el_s": distribution([t.e2el_s for t in done]),  # type: ignore[misc]
            "tbt_slo_s": target,
            "tbt_p99_met": None if itl["p99"] is None else itl["p99"] <= target,
        }
    return out


def _rate(count: float, duration_s: float) -> float | None:
    return count / duration_s if duration_s > 0 else None


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------

_HEADER = (
    "| mode | completed/failed | P50 TTFT (s) | P95 TTFT (s) | P99 TTFT (s) | mean TPOT (ms) "
    "| P99 ITL (ms) | SLO violation % | goodput (req/s) | output tok/s |"
)


def markdown_table(rows: Mapping[str, Mapping]) -> str:
    """One Markdown row per mode from ``{mode: summarize(...) result}``; missing values show "n/a"."""
    lines = [_HEADER, "|" + "---|" * _HEADER.count(" | ") + "---|"]
    lines += [_row(mode, summary) for mode, summary in rows.items()]
    return "\n".join(lines) + "\n"


def _row(mode: str, s: Mapping) -> str:
    ttft = s.get("ttft_s") or {}
    tpot = s.get("tpot_s") or {}
    itl = s.get("itl_s") or {}
    violation = (s.get("slo") or {}).get("violation_rate")
    cells = [
        mode,
        f"{s.get('completed', 0)}/{s.get('failed', 0)}",
        _fmt(ttft.get("p50"), 1, 3),
        _fmt(ttft.get("p95"), 1, 3),
        _fmt(ttft.get("p99"), 1, 3),
        _fmt(tpot.get("mean"), 1000, 1),
        _fmt(itl.get("p99"), 1000, 1),
        _fmt(violation, 100, 1),
        _fmt(s.get("goodput_rps"), 1, 3),
        _fmt(s.get("output_tok_s"), 1, 1),
    ]
    return "| " + " | ".join(cells) + " |"


def _fmt(value: float | None, scale: float, digits: int) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"
