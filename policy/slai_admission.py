"""SLAI's admission order: which waiting prompt is admitted next.

Within a tier (0 = strict, first) and after previously preempted sequences (their first token is out already):

1. **urgent**: a prompt with less than ``urgent_share`` of its TTFT target left before its deadline (arrival + the
   target) goes by deadline, earliest first, so shortest-first cannot starve a long prompt past its target;
2. **the rest that can still meet their target**: shortest remaining prompt first (the least work before a first
   token: what keeps mean TTFT low), then arrival;
3. **late**: a prompt already past its deadline goes after every prompt that can still meet one (``late_last``), in
   arrival order. Its target is lost whatever the order; admitting it ahead of the others spends the blocks and the
   budget that would keep another request within its target. Without ``late_last`` it stays urgent (earliest
   deadline first, so late ones lead).

A late prompt still gets served: as soon as nothing that can meet its target waits (a burst drains), and the
engine's request deadlines and shedding bound how long anything waits.

Pure: stdlib only; times come in as arguments.
"""

from __future__ import annotations

URGENT, ON_TIME, LATE = 0, 1, 2


def admission_class(now: float, arrival: float, ttft_target: float, urgent_share: float, late_last: bool) -> int:
    left = arrival + ttft_target - now
    if left < 0 and late_last:
        return LATE
    return URGENT if left < urgent_share * ttft_target else ON_TIME


def admission_key(now: float, priority: int, preempted: bool, remaining_prompt: int, arrival: float,
                  ttft_target: float, urgent_share: float = 0.5, late_last: bool = True) -> tuple:
    """Sort key of a waiting prompt (smallest admitted first); the rules are the module docstring's."""
    if preempted:
        return priority, 0, 0, 0.0, arrival
    cls = admission_class(now, arrival, ttft_target, urgent_share, late_last)
    primary = {URGENT: arrival + ttft_target, ON_TIME: float(remaining_prompt), LATE: arrival}[cls]
    return priority, 1, cls, primary, arrival
