"""SLAI's iteration token budget from the tightest running TBT target: a batch may take no longer than the earliest
running decode can wait, so prefill chunks never stretch an iteration past a decode's deadline.

The step-time model is fitted on the scheduler's own measured batches (``fit_step_time``: duration ~ a + b x tokens,
least squares over the recent window; with too little spread in token counts, the mean cost per token), so it
follows the device (CPU steps, a GPU's, the planner's virtual clock alike). ``token_budget`` gives the most tokens
whose predicted duration still ends before ``earliest deadline - now``, never fewer than the decodes that must run
plus ``min_progress`` prompt tokens (admission keeps moving when no budget can meet a deadline: TTFT would otherwise
grow without bound), never more than the configured budget. ``must_run_now`` says which decodes cannot wait for the
next iteration at the predicted length of this one.

Pure: stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepFit:
    base_s: float       # a: what a batch costs whatever its size (the LM head, Python, launches)
    per_token_s: float  # b: what each scheduled token adds

    def predict(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens


def fit_step_time(samples: Sequence[tuple[int, float]], min_points: int = 4) -> StepFit | None:
    """(tokens, seconds) of recent batches -> a + b x tokens; None before ``min_points`` batches were measured."""
    if len(samples) < min_points:
        return None
    n = len(samples)
    mx = sum(t for t, _ in samples) / n
    my = sum(d for _, d in samples) / n
    sxx = sum((t - mx) ** 2 for t, _ in samples)
    if sxx > 0:
        b = sum((t - mx) * (d - my) for t, d in samples) / sxx
        a = my - b * mx
        if b > 0 and a >= 0:
            return StepFit(a, b)
    return StepFit(0.0, my / mx) if mx > 0 else None


def token_budget(now: float, deadlines: Sequence[float], fit: StepFit | None, max_tokens: int, decodes: int,
                 min_progress: int) -> tuple[int, str]:
    """The iteration's token budget and why (module docstring). ``deadlines``: the running decodes' (last token +
    TBT target) on the engine clock; ``decodes``: the decode tokens this iteration must hold."""
    if not deadlines or fit is None:
        return max_tokens, "no running decode, or no measured batch yet: the configured budget"
    slack = min(deadlines) - now
    fits = math.floor((slack - fit.base_s) / fit.per_token_s + 1e-9) if fit.per_token_s > 0 else max_tokens
    floor = min(max_tokens, decodes + min_progress)
    budget = max(floor, min(max_tokens, fits))
    why = (f"tightest decode has {slack * 1e3:.0f} ms; a batch costs {fit.base_s * 1e3:.1f} ms + "
           f"{fit.per_token_s * 1e6:.0f} us/token -> {budget} tokens")
    return budget, why + (" (floor: decodes + minimum prompt progress)" if budget == floor and fits < floor else "")


def must_run_now(now: float, deadline: float, predicted_s: float) -> bool:
    """A decode whose deadline falls before this iteration and the next would end, at ``predicted_s`` each."""
    return deadline <= now + 2 * predicted_s
