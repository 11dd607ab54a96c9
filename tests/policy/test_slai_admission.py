"""SLAI's admission order (policy/slai_admission.py): urgent prompts by deadline, the rest shortest first, late
ones last; tier and preemption first."""

from __future__ import annotations

from policy.slai_admission import LATE, ON_TIME, URGENT, admission_class, admission_key


def order(now: float, prompts: dict[str, tuple], **kw) -> list[str]:
    """prompts: name -> (priority, preempted, remaining prompt tokens, arrival, TTFT target)."""
    return sorted(prompts, key=lambda n: admission_key(now, *prompts[n], **kw))


def test_classes_by_the_share_of_the_target_left() -> None:
    assert admission_class(1.0, arrival=0.0, ttft_target=4.0, urgent_share=0.5, late_last=True) == ON_TIME
    assert admission_class(2.5, arrival=0.0, ttft_target=4.0, urgent_share=0.5, late_last=True) == URGENT
    assert admission_class(4.5, arrival=0.0, ttft_target=4.0, urgent_share=0.5, late_last=True) == LATE
    assert admission_class(4.5, arrival=0.0, ttft_target=4.0, urgent_share=0.5, late_last=False) == URGENT
    assert admission_class(3.9, arrival=0.0, ttft_target=4.0, urgent_share=0.0, late_last=True) == ON_TIME


def test_on_time_prompts_go_shortest_first_then_by_arrival() -> None:
    got = order(0.5, {"long": (1, False, 300, 0.0, 2.0), "short": (1, False, 20, 0.4, 2.0),
                      "short-early": (1, False, 20, 0.1, 2.0)})
    assert got == ["short-early", "short", "long"]


def test_urgent_prompts_go_first_by_deadline_late_ones_last_by_arrival() -> None:
    prompts = {"on-time": (1, False, 10, 1.9, 2.0), "urgent-a": (1, False, 300, 0.6, 2.0),
               "urgent-b": (1, False, 200, 0.8, 2.0), "late-2": (1, False, 5, 0.4, 1.0),
               "late-1": (1, False, 50, 0.2, 1.0)}
    assert order(2.0, prompts) == ["urgent-a", "urgent-b", "on-time", "late-1", "late-2"]
    # without late_last a prompt past its deadline is the most urgent of all (earliest deadline first)
    assert order(2.0, prompts, late_last=False) == ["late-1", "late-2", "urgent-a", "urgent-b", "on-time"]


def test_tier_then_preempted_come_before_any_deadline() -> None:
    prompts = {"tier1-late": (1, False, 10, 0.0, 1.0), "tier0-on-time": (0, False, 400, 2.0, 2.0),
               "tier1-resumed": (1, True, 30, 1.0, 2.0)}
    assert order(2.5, prompts) == ["tier0-on-time", "tier1-resumed", "tier1-late"]
