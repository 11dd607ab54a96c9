"""The slai scheduler, one rule per test, driven by a fake clock (no model, no threads, no timings)."""

from __future__ import annotations

import pytest

from serve.engine.sampling_params import SamplingParams
from serve.engine.sequence import Sequence, SequenceStatus
from serve.engine.slai import SlaiConfig, SlaiScheduler
from serve.engine.slo import RequestSLO
from serve.memory.block_pool import BlockPool

BS = 4  # tokens per KV block


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def req(name: str, prompt_len: int, tbt: float = 10.0, tier: int = 1, arrival: float = 0.0,
        ttft: float = 2.0) -> Sequence:
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100), arrival, None,  # type: ignore[arg-type]
                    slo=RequestSLO(ttft, tbt, tier))


def make(num_blocks: int = 100, budget: int = 64, max_seqs: int = 16, **cfg) -> tuple[SlaiScheduler, FakeClock]:
    clock = FakeClock()
    return SlaiScheduler(BlockPool(num_blocks), BS, max_seqs, budget, clock, SlaiConfig(**cfg)), clock


def run(s: SlaiScheduler, clock: FakeClock, duration: float) -> list[tuple[str, int]]:
    """One engine iteration: schedule, let `duration` pass, account, append a token to each sampled sequence."""
    out = s.schedule()
    clock.t += duration
    s.on_executed(out)
    for c in out.chunks:
        if c.samples:
            c.seq.token_ids.append(7)
    return [(c.seq.request_id, c.num_tokens) for c in out.chunks]


def three_decodes(**cfg) -> tuple[SlaiScheduler, FakeClock, dict[str, Sequence]]:
    """A, B, C prefilled together in a 0.1 s batch ending at t = 0.1; theta 1 -> LST = TBT target."""
    s, clock = make(theta=1.0, **cfg)
    seqs = {"A": req("A", 3, tbt=0.5), "B": req("B", 3, tbt=2.0), "C": req("C", 3, tbt=0.3)}
    for q in seqs.values():
        s.add(q)
    assert run(s, clock, 0.1) == [("A", 3), ("B", 3), ("C", 3)]
    return s, clock, seqs


def test_lst_is_last_token_plus_tbt_minus_theta_times_mean_batch() -> None:
    s, clock, q = three_decodes()
    assert s.mean_batch_s() == pytest.approx(0.1)
    assert [s.lst(q[n]) for n in "ABC"] == pytest.approx([0.5, 2.0, 0.3])
    clock.t = 0.2
    assert run(s, clock, 0.3) == [("C", 1), ("A", 1), ("B", 1)]  # nothing critical: all decodes in LST order
    # New last token at 0.5 for all three; mean batch (0.1 + 0.3) / 2 = 0.2; theta 1.
    assert [s.lst(q[n]) for n in "ABC"] == pytest.approx([0.8, 2.3, 0.6])


def test_critical_decodes_first_in_lst_order_then_prefills_then_relaxed_decodes() -> None:
    s, clock, q = three_decodes()
    s.add(req("W", 8, arrival=0.2))
    clock.t = 0.6  # A (LST 0.5) and C (0.3) are critical, B (2.0) is not
    assert run(s, clock, 0.1) == [("C", 1), ("A", 1), ("W", 8), ("B", 1)]


def test_budget_goes_to_critical_decodes_before_new_prefills() -> None:
    s, clock, q = three_decodes()
    s.add(req("W", 8, arrival=0.2))
    s.max_num_batched_tokens = 2
    clock.t = 0.6
    assert run(s, clock, 0.1) == [("C", 1), ("A", 1)]
    assert s.last_critical_unscheduled == 0
    s.max_num_batched_tokens = 5  # W's chunk takes what is left; B (not critical) gets nothing
    clock.t = 0.75                # C: 0.7 + 0.3 - 0.1 = 0.9, A: 1.1, B: 2.0 -> none critical
    assert run(s, clock, 0.1) == [("W", 5)]


def test_decode_cap_leaves_critical_decodes_out_and_reports_them() -> None:
    s, clock, q = three_decodes(max_decodes=1)
    clock.t = 0.6
    assert run(s, clock, 0.1) == [("C", 1)]
    assert s.last_critical_unscheduled == 1  # A was critical but over the cap
    assert s.slo_signals(clock.t) == (1, None)
    assert s.num_critical_unscheduled == 1


def test_partial_prefills_continue_before_new_admissions() -> None:
    s, clock = make(budget=6)
    s.add(req("long", 10))
    assert run(s, clock, 0.1) == [("long", 6)]
    s.add(req("short", 2, arrival=0.1))
    assert run(s, clock, 0.1) == [("long", 4), ("short", 2)]


def test_shortest_prompt_first_within_tier_and_strict_tier_first() -> None:
    s, clock = make(budget=16)
    for name, n, tier, t in [("t1-4", 4, 1, 0.0), ("t0-20", 20, 0, 0.1), ("t1-8", 8, 1, 0.2), ("t0-10", 10, 0, 0.3)]:
        s.add(req(name, n, tier=tier, arrival=t))
    # Tier 0 first (shortest first within it), the 20-token prompt chunked to what is left of the budget.
    assert run(s, clock, 0.1) == [("t0-10", 10), ("t0-20", 6)]
    assert run(s, clock, 0.1) == [("t0-20", 14), ("t1-4", 2)]


def test_equal_prompts_in_a_tier_go_in_arrival_order_and_preempted_first() -> None:
    s, clock = make(budget=8)
    s.add(req("late", 4, arrival=0.5))
    s.add(req("early", 4, arrival=0.1))
    resumed = req("resumed", 6, arrival=0.9)
    resumed.token_ids.append(7)  # it had produced a token before being preempted
    s.add(resumed)
    assert run(s, clock, 0.1) == [("resumed", 7), ("early", 1)]


@pytest.mark.parametrize("deadline_admission", [True, False])
def test_a_prompt_near_its_ttft_deadline_goes_first_and_one_past_it_last(deadline_admission: bool) -> None:
    s, clock = make(budget=48, deadline_admission=deadline_admission)
    s.add(req("long", 40, arrival=0.0, ttft=2.0))   # at t = 1.5 a quarter of its target is left: urgent
    s.add(req("short", 8, arrival=1.4, ttft=2.0))   # on time
    s.add(req("late", 4, arrival=0.0, ttft=1.0))    # past its deadline: its target is lost whatever runs
    clock.t = 1.5
    if deadline_admission:
        assert run(s, clock, 0.1) == [("long", 40), ("short", 8)]
    else:  # shortest first: the long prompt misses its target behind two it could have waited for
        assert run(s, clock, 0.1) == [("late", 4), ("short", 8), ("long", 36)]


def running_partial_prefill(s: SlaiScheduler, name: str, arrival: float) -> Sequence:
    """A 12-token prompt admitted with a 4-token first chunk (state set directly: under one fixed budget two
    partial prefills only coexist when blocks ran short, which is what these tests are about)."""
    p = req(name, 12, arrival=arrival)
    p.block_ids = s.pool.allocate(1)
    p.num_computed_tokens = 4
    p.status = SequenceStatus.RUNNING
    s.running.append(p)
    return p


def test_critical_decode_preempts_newest_partial_prefill() -> None:
    s, clock = make(num_blocks=3, budget=4)
    d = req("D", 4, tbt=1.0)
    s.add(d)
    assert run(s, clock, 0.1) == [("D", 4)]              # D: 1 block, its next token needs a second
    running_partial_prefill(s, "P1", 0.1)
    running_partial_prefill(s, "P2", 0.2)
    assert s.pool.num_free == 0
    clock.t = 5.0                                        # D is now critical and needs a block
    out = s.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["D"]
    assert [v.request_id for v in out.preempted] == ["P2"]  # newest partial prefill; P1 keeps its block
    assert [x.request_id for x in s.running] == ["D", "P1"] and s.waiting[0].request_id == "P2"
    assert s.waiting[0].num_computed_tokens == 0


def test_critical_decode_preempts_itself_when_no_prefill_holds_blocks() -> None:
    s, clock = make(num_blocks=1, budget=4)
    d = req("D", 4, tbt=1.0)
    s.add(d)
    run(s, clock, 0.1)
    clock.t = 5.0
    out = s.schedule()
    assert out.chunks == [] and out.preempted == [d]
    assert d.status is SequenceStatus.WAITING and d.block_ids == [] and s.pool.num_free == 1
    assert s.last_critical_unscheduled == 1


def test_relaxed_decode_without_a_block_waits_and_preempts_nobody() -> None:
    s, clock = make(num_blocks=4, budget=8)
    d = req("D", 4, tbt=100.0)
    s.add(d)
    run(s, clock, 0.1)                                   # D holds 1 of 4 blocks; its next token needs a 2nd
    s.add(req("P", 12, arrival=0.1))
    assert run(s, clock, 0.1) == [("P", 8)]              # 2 blocks to P; no budget left for D
    s.add(req("W", 4, arrival=0.2))
    s.max_num_batched_tokens = 12
    out = s.schedule()                                   # P's last chunk takes the last block
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("P", 4)]
    assert out.preempted == [] and d.status is SequenceStatus.RUNNING and len(d.block_ids) == 1


def test_when_nothing_else_can_run_the_earliest_decode_is_treated_as_critical() -> None:
    s, clock = make(num_blocks=3, budget=4)
    d = req("D", 4, tbt=100.0)
    s.add(d)
    run(s, clock, 0.1)
    s.max_num_batched_tokens = 8
    p = req("P", 12, arrival=0.1)
    s.add(p)
    assert run(s, clock, 0.1) == [("P", 8)]              # pool full: D 1 block, P 2
    out = s.schedule()                                   # P and D both need a block; idling helps nobody
    assert [c.seq.request_id for c in out.chunks] == ["D"] and out.preempted == [p]
    assert s.last_critical_unscheduled == 0


def test_dynamic_theta_follows_kv_usage() -> None:
    s, clock = make(num_blocks=25, budget=1, theta_low=1.5, theta_high=3.0, kv_threshold=0.96)
    d = req("D", 1, tbt=1.0)
    s.add(d)
    assert run(s, clock, 0.1) == [("D", 1)]              # last token 0.1, mean batch 0.1
    assert s.theta() == 1.5 and s.lst(d) == pytest.approx(0.1 + 1.0 - 0.15)
    s.add(req("W", 1, arrival=0.1))
    clock.t = 0.9
    held = s.pool.allocate(23)                           # 24/25 = 96 % used
    assert s.theta() == 3.0 and s.lst(d) == pytest.approx(0.1 + 1.0 - 0.3)
    assert [c.seq.request_id for c in s.schedule().chunks] == ["D"]  # critical at 0.9 >= 0.8: D takes the budget
    s.pool.free(held)
    s2, clock2 = make(num_blocks=25, budget=1, theta_low=1.5, theta_high=3.0)
    d2 = req("D", 1, tbt=1.0)
    s2.add(d2)
    run(s2, clock2, 0.1)
    s2.add(req("W", 1, arrival=0.1))
    clock2.t = 0.9                                       # low usage: LST 0.95 > 0.9, so W is admitted first
    assert [c.seq.request_id for c in s2.schedule().chunks] == ["W"]


def test_fixed_theta_ignores_kv_usage() -> None:
    s, _ = make(num_blocks=10, theta=4.0)
    s.pool.allocate(10)
    assert s.theta() == 4.0


def test_ttft_slack_of_waiting_requests() -> None:
    s, clock = make(budget=4)
    s.add(req("a", 4, ttft=2.0, arrival=0.0))
    s.add(req("b", 8, ttft=0.5, arrival=0.4))
    clock.t = 0.6
    assert s.slo_signals(clock.t) == (0, pytest.approx(0.3))  # b: 0.4 + 0.5 - 0.6
    run(s, clock, 0.1)                                    # a admitted (shorter prompt); b still waits
    assert s.slo_signals(clock.t)[1] == pytest.approx(0.2)


def test_running_and_budget_caps_hold_under_many_requests() -> None:
    s, clock = make(num_blocks=40, budget=10, max_seqs=4, theta=1.0)
    for i in range(12):
        s.add(req(f"r{i}", 3 + i % 5, tbt=0.2 + 0.1 * (i % 3), tier=i % 2, arrival=0.01 * i))
    for _ in range(40):
        out = s.schedule()
        assert out.num_tokens <= 10 and len(s.running) <= 4
        assert sum(1 for c in out.chunks if c.seq.is_decoding) <= 4
        clock.t += 0.1
        s.on_executed(out)
        for c in out.chunks:
            if c.samples:
                c.seq.token_ids.append(7)
                if c.seq.num_output_tokens >= 3:
                    s.finish(c.seq)
        s.pool.check_invariants()
    assert not s.has_work()


@pytest.mark.parametrize("kwargs, match", [
    ({"theta": -1.0}, "theta"), ({"theta_low": float("nan")}, "theta_low"), ({"kv_threshold": 0.0}, "kv_threshold"),
    ({"max_decodes": 0}, "max_decodes"), ({"window": 0}, "window"),
])
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SlaiConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"tbt_s": 0.0}, "tbt_slo_s"), ({"ttft_s": -1.0}, "ttft_slo_s"), ({"tbt_s": float("inf")}, "tbt_slo_s"),
    ({"priority": -1}, "priority"), ({"priority": 10}, "priority"), ({"priority": True}, "priority"),
])
def test_request_slo_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RequestSLO(**kwargs)
    with pytest.raises(TypeError, match="tbt_slo_s"):
        RequestSLO(tbt_s="fast")  # type: ignore[arg-type]


def test_request_slo_defaults_fill_only_the_gaps() -> None:
    assert RequestSLO(tbt_s=0.2).resolved(2.0, 1.0, 1) == RequestSLO(2.0, 0.2, 1)
    assert RequestSLO(priority=0).resolved(2.0, 1.0, 1) == RequestSLO(2.0, 1.0, 0)


def test_partial_prefill_short_of_blocks_preempts_only_newer_prefills() -> None:
    s, clock = make(num_blocks=3, budget=8)
    p1 = running_partial_prefill(s, "P1", 0.1)
    p2 = running_partial_prefill(s, "P2", 0.2)
    out = s.schedule()                                   # P1 needs 2 more blocks, 1 is free: P2 gives its one
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("P1", 8)] and out.preempted == [p2]
    assert len(p1.block_ids) == 3 and p2.block_ids == []


@pytest.mark.parametrize("tbt_budget", [True, False])
def test_a_prompt_never_stretches_an_iteration_past_the_tight_decodes_deadline(tbt_budget: bool) -> None:
    """Batches cost 10 ms + 1 ms per token (the clock advances so). A tight decode (TBT 0.15 s) runs; a 400-token
    prompt arrives. With the TBT budget every batch ends before the decode's deadline and the decode is in every
    batch, first; the prompt still makes progress. Without it (the rule this replaces) the prompt's 400-token chunk
    makes one batch 410 ms long: the decode misses its target."""
    s, clock = make(num_blocks=200, budget=512, theta=1.0, tbt_budget=tbt_budget)
    cost = lambda tokens: 0.01 + 0.001 * tokens  # noqa: E731
    tight = req("tight", 3, tbt=0.15)
    s.add(tight)
    gaps, last, batches = [], None, []
    for i in range(40):
        if i == 8:
            s.add(req("long", 400, tbt=5.0, arrival=clock.t))
        out = s.schedule()
        clock.t += cost(out.num_tokens)
        s.on_executed(out)
        batches.append([(c.seq.request_id, c.num_tokens) for c in out.chunks])
        for c in out.chunks:
            if c.samples:
                c.seq.token_ids.append(7)
                if c.seq is tight:
                    if last is not None:
                        gaps.append(clock.t - last)
                    last = clock.t
    if tbt_budget:
        assert max(gaps) <= 0.15 + 1e-9, (max(gaps), s.last_budget_reason)
        assert all(b and b[0][0] == "tight" for b in batches[1:]), batches  # the decode first, every batch
        assert any(name == "long" for b in batches for name, _ in b)        # the prompt made progress
    else:
        assert max(gaps) > 0.4, max(gaps)


@pytest.mark.parametrize("rule_on", [True, False])
def test_while_kv_binds_relaxed_decodes_run_before_prefills(rule_on: bool) -> None:
    """At KV usage >= kv_threshold a relaxed decode is not deferred behind a prefill chunk: the queue waits for
    blocks, not for budget, so deferring the decode only holds its blocks longer. Below it, it is deferred."""
    s, clock = make(num_blocks=20, budget=6, theta=1.0, kv_threshold=0.5, kv_bound_decodes_first=rule_on)
    d = req("D", 2, tbt=100.0)
    s.add(d)
    assert run(s, clock, 0.1) == [("D", 2)]              # D: 3 tokens in its one block
    s.add(req("L", 30, arrival=0.1))
    assert run(s, clock, 0.1) == [("L", 6)]              # 3 of 20 blocks used: D deferred, L takes the budget
    held = s.pool.allocate(8)                            # 11 of 20 used: KV binds
    assert s.kv_bound() is rule_on
    out = [(c.seq.request_id, c.num_tokens) for c in s.schedule().chunks]
    assert out == ([("D", 1), ("L", 5)] if rule_on else [("L", 6)])
    s.pool.free(held)


def test_an_admission_short_of_blocks_marks_kv_as_binding_until_one_succeeds() -> None:
    s, clock = make(num_blocks=6, budget=8, theta=1.0)
    s.add(req("D", 2, tbt=100.0))
    run(s, clock, 0.1)
    held = s.pool.allocate(4)                            # 5 of 6 used (83 %, under kv_threshold)
    s.add(req("W", 12, arrival=0.1))
    assert not s.kv_bound()
    assert run(s, clock, 0.1) == [("D", 1)]              # W's first chunk needs 2 blocks, 1 is free
    assert s.admission_short_of_blocks and s.kv_bound()
    s.pool.free(held)
    assert run(s, clock, 0.1) == [("D", 1), ("W", 7)]    # relaxed first while bound; then W fits
    assert not s.admission_short_of_blocks and not s.kv_bound()
