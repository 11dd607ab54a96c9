"""The cost rule: does a quantize step pay for itself on this machine? Pure arithmetic on measured costs.

A quantize step of ``k`` layers to precision ``p`` frees ``k x gain`` KV blocks and changes every later
step's time by ``delta(n) = k x (cost_p(n) - cost_from(n))`` at ``n`` tokens per step (measured,
``policy/costs.py``; negative where the quantized kernel is faster).

* Quantized kernels not slower at the current step (``delta <= 0``): the step costs nothing, take it
  (the controller then behaves exactly as the cost-blind MorphServe controller).
* Memory pressure (waiting prompts need more blocks than are free, or KV above its high mark): the freed
  blocks admit ``n_admit`` more of the waiting requests (their average need each), whose prompts add work
  to the steps: a step of ``x`` tokens (the last batch) becomes one of
  ``x' = min(budget, x + n_admit x prompt tokens each)``. Tokens per second before ``x / T(x)``, after
  ``x' / (T(x') + delta(x'))``, with ``T`` the step time estimated from the same measurements for the
  current configuration. The step is taken only if throughput after exceeds throughput before: the KV
  gained must buy more tokens per second than the slowdown, which every running request pays on every
  step, takes away. A batch already at its token budget gains nothing from more KV (the queue is waiting
  on compute), so there a slower kernel is refused. No waiting request (KV merely above its mark) means nothing is
  gained now; running requests short of blocks are handled by quantize-before-preempt, which always pays
  (the alternative throws away a request's KV cache and recomputes it).
* Compute pressure (requests queue, TTFT targets near, yet the blocks they need are free): quantizing
  helps only if the quantized kernel is faster at the tokens of the current step; a slower one is never
  taken there.
* Ladder: among the mode's precisions, the one with the least slowdown per freed block (averaged over
  the measured decode batch sizes) comes first; a later ladder step is kept only if it frees more blocks than
  every earlier one (a ladder step must shrink the layer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .costs import StepCosts
from .precisions import FULL
from .telemetry import Telemetry

DECODE_TOKENS_MAX = 32
"""Token counts up to this one are decode batches (the ladder is ranked on them); above, prefill chunks."""


@dataclass(frozen=True)
class Verdict:
    pays: bool
    reason: str


def cost_ladder(candidates: Sequence[str], costs: StepCosts, extents: Mapping[str, int]) -> tuple[str, ...]:
    """The mode's precisions ordered by measured slowdown per freed KV block, deeper ladder steps only if smaller."""
    usable = [p for p in candidates if p in costs.layer_s and extents.get(p, 0) > 0]
    decode = [n for n in costs.token_counts if n <= DECODE_TOKENS_MAX] or list(costs.token_counts)

    def score(p: str) -> tuple[float, int]:
        per_block = sum(costs.slowdown_s(p, n) for n in decode) / len(decode) / extents[p]
        return per_block, -extents[p]

    ladder: list[str] = []
    for p in sorted(usable, key=score):
        if all(extents[p] > extents[q] for q in ladder):
            ladder.append(p)
    return tuple(ladder)


def step_tokens(t: Telemetry) -> int:
    """Tokens the current step runs: the last batch's when known, else one per running decode."""
    return t.step_tokens or max(t.num_running, 1)


def requests_admitted(t: Telemetry, blocks_added: int) -> int:
    """How many more waiting requests the added blocks let in, each needing the waiting prompts' average
    (all of them once the blocks cover what they need together)."""
    if not t.num_waiting or t.blocks_needed_waiting <= 0:
        return 0
    need = math.ceil(t.blocks_needed_waiting / t.num_waiting)
    free = t.kv_blocks_free
    after = t.num_waiting if free + blocks_added >= t.blocks_needed_waiting else (free + blocks_added) // need
    return max(0, min(t.num_waiting, after) - min(t.num_waiting, free // need))


def memory_step_pays(t: Telemetry, costs: StepCosts, precision: str, from_precision: str, k: int,
                     gain: int) -> Verdict:
    """Memory pressure: do the blocks freed admit enough requests to outweigh the slower steps?"""
    x = step_tokens(t) if t.num_running or t.step_tokens else 0
    admitted = requests_admitted(t, k * gain)
    prompt = math.ceil(t.blocks_needed_waiting / t.num_waiting) * t.block_tokens if t.num_waiting else 0
    x_after = x + admitted * prompt
    if t.step_token_budget:
        x_after = min(x_after, max(t.step_token_budget, x))
    delta_now = k * costs.slowdown_s(precision, max(x, 1), from_precision)
    delta_after = k * costs.slowdown_s(precision, max(x_after, 1), from_precision)
    if delta_now <= 0 and delta_after <= 0:
        return Verdict(True, f"{from_precision}->{precision} is not slower here ({delta_now * 1e3:+.2f} ms/step "
                             f"at {max(x, 1)} tokens)")
    quantized = dict(t.quantized_layers)
    before = x / costs.step_s(x, t.num_layers, quantized) if x else 0.0
    after = x_after / (costs.step_s(x_after, t.num_layers, quantized) + delta_after) if x_after else 0.0
    arithmetic = (f"{k} layer(s) {from_precision}->{precision} free {k * gain} blocks -> admit {admitted} of "
                  f"{t.num_waiting} waiting; step {x} -> {x_after} tokens at {before:.1f} -> {after:.1f} tok/s "
                  f"({delta_after * 1e3:+.2f} ms/step)")
    return Verdict(after > before, arithmetic)


def compute_step_pays(t: Telemetry, costs: StepCosts, precision: str, from_precision: str, k: int) -> Verdict:
    """Compute pressure: only a precision that is faster at the current step's tokens helps."""
    n = step_tokens(t)
    delta = k * costs.slowdown_s(precision, n, from_precision)
    verdict = "faster" if delta < 0 else "slower or equal"
    return Verdict(delta < 0, f"no block deficit (compute pressure): {k} layer(s) {from_precision}->{precision} "
                              f"{verdict} at {n} tokens ({delta * 1e3:+.2f} ms/step)")


def layer_is_slower(t: Telemetry, costs: StepCosts, precision: str, milder: str | None) -> bool:
    """True if a layer at ``precision`` makes the current step slower than at its milder ladder step."""
    return costs.slowdown_s(precision, step_tokens(t), milder or FULL) > 0
