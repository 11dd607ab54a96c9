"""The KV-cache manager every scheduler shares (serve/memory/kv_cache_manager.py) and quantize before preempt on
the shortfall a scheduler actually meets: exact block ids, holds and prefix-hit counts; the shortfall hook
asked before a preemption, with FCFS's whole-pass deficit and with the deficit SLAI meets; a failing hook.
(SLAI engines that preempt with morphing off and serve the same workload without preemption when morphing,
as FCFS does: tests/memory/test_arena.py; random load under both schedulers with morphing:
tests/morph/test_morph.py.)"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from serve.engine.sampling_params import SamplingParams
from serve.engine.scheduler import Scheduler
from serve.engine.sequence import SequenceStatus
from serve.engine.slai import SlaiConfig, SlaiScheduler
from serve.memory.block_pool import BlockPool
from serve.memory.kv_cache_manager import KVBlockCounts, KVCacheManager
from tests.engine.test_slai import BS, req, run, running_partial_prefill
from tests.engine.test_slai import FakeClock as SchedulerClock
from tests.memory.test_kv_accounting import assert_exact_accounting
from tests.morph.test_morph import FakeClock, morph_engine
from tests.morph_support import morph


@dataclass(eq=False)
class Req:
    """The least a request needs to be for the manager (the engine's Sequence is one)."""

    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    hash_root: bytes | None = None
    kv_counts: KVBlockCounts = field(default_factory=KVBlockCounts)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def blocks_needed(self, num_new_tokens: int, block_size: int) -> int:
        return max(0, math.ceil((self.num_computed_tokens + num_new_tokens) / block_size) - len(self.block_ids))


def start(kv: KVCacheManager, r: Req, budget: int = 64) -> bool:
    """Admit ``r`` as a scheduler does (cached prefix, then new blocks for the rest) and compute it all."""
    hits = kv.get_computed_blocks(r)
    n = min(r.num_tokens - len(hits or ()) * kv.block_size, budget)
    if not kv.allocate_slots(r, n, hits):
        return False
    before = r.num_computed_tokens
    r.num_computed_tokens += n
    kv.cache_full_blocks(r, before)
    return True


# ---- the manager ------------------------------------------------------------------------------------
def test_a_starting_request_takes_the_cached_prefix_then_new_blocks_with_exact_ids_and_counts():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, 4, enable_caching=True)
    a = Req(list(range(10, 20)))                      # 10 tokens: 2 full blocks + 2 tokens
    assert kv.get_computed_blocks(a) == [] and start(kv, a)
    assert a.block_ids == [0, 1, 2] and (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (10, 0)
    b = Req(list(range(10, 18)) + [99, 98, 97])       # shares a's first 2 blocks
    assert kv.get_computed_blocks(b) == [0, 1]
    assert start(kv, b)
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 11
    assert pool._refs == {0: 2, 1: 2, 2: 1, 3: 1}
    assert (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (21, 8)
    # per request (TensorRT-LLM's per-request KV metrics): a reused nothing of its 3 prompt blocks, b 2 of its 3
    assert a.kv_counts == KVBlockCounts(reused=0, missed=3, new=3)
    assert b.kv_counts == KVBlockCounts(reused=2, missed=1, new=1)
    c = Req(list(range(10, 18)))                      # exactly a's 2 blocks: the last token is still computed
    assert kv.get_computed_blocks(c) == [0]
    kv.free(a)
    kv.free(b)
    assert (pool.num_used, pool.num_cached, a.block_ids, b.block_ids) == (0, 2, [], [])
    pool.check_invariants()


def test_no_lookup_without_caching_or_for_a_request_that_holds_blocks():
    kv = KVCacheManager(BlockPool(4), 4)
    r = Req([1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(r) is None and start(kv, r)
    assert (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (0, 0)
    cached = KVCacheManager(BlockPool(4), 4, enable_caching=True)
    assert cached.get_computed_blocks(Req([1, 2, 3], block_ids=[0])) is None


def test_an_allocation_that_does_not_fit_takes_nothing_and_counts_nothing():
    pool = BlockPool(3)
    kv = KVCacheManager(pool, 4, enable_caching=True)
    a = Req(list(range(10, 19)))                      # 3 blocks, 2 of them full and registered
    assert start(kv, a)
    kv.free(a)
    held = pool.allocate(1)                           # the never-cached block 2
    assert pool.num_cached == 2
    b = Req(list(range(10, 18)) + list(range(50, 60)))  # hits blocks 0, 1; needs 3 more
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    assert not kv.allocate_slots(b, b.num_tokens - 8, hits)
    assert (b.block_ids, b.num_computed_tokens) == ([], 0)
    assert pool.num_cached == 2 and pool._refs == {held[0]: 1}
    assert (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (9, 0)
    pool.check_invariants()


def test_the_shortfall_hook_covers_what_it_can_and_is_not_asked_again_in_a_step_it_failed():
    pool = BlockPool(2, max_blocks=20)
    asked: list[int] = []
    grow = [3, 0, 4]

    def hook(blocks: int) -> None:
        asked.append(blocks)
        if n := grow.pop(0):
            pool.add_extent(f"c{len(asked)}", n)

    kv = KVCacheManager(pool, 4, on_shortfall=hook)
    kv.begin_step()
    assert kv.cover_shortfall(2) and asked == []       # nothing short: the hook is not asked
    assert kv.cover_shortfall(5) and asked == [3] and pool.num_free == 5
    assert not kv.cover_shortfall(6) and asked == [3, 1]   # the hook added nothing
    assert not kv.cover_shortfall(6) and asked == [3, 1]   # not asked again in this step
    kv.begin_step()
    assert kv.cover_shortfall(6) and asked == [3, 1, 1] and pool.num_free == 9
    assert not KVCacheManager(BlockPool(2), 4).cover_shortfall(3)  # no hook: the scheduler preempts


# ---- the schedulers ---------------------------------------------------------------------------------
def three_decodes_each_short_of_a_block(scheduler: Scheduler, clock: SchedulerClock) -> None:
    for name in "ABC":
        scheduler.add(req(name, 4))                     # one full block each
    assert run(scheduler, clock, 0.1) == [("A", 4), ("B", 4), ("C", 4)]
    assert scheduler.pool.num_free == 0                 # each one's next token needs a second block


def growing_hook(pool: BlockPool, sizes: list[int], asked: list[int]):
    def hook(blocks: int) -> None:
        asked.append(blocks)
        pool.add_extent(f"extent{len(asked)}", sizes.pop(0))
    return hook


@pytest.mark.parametrize("grows, preempted", [(3, []), (1, ["C"])])
def test_fcfs_offers_the_whole_pass_shortfall_once_before_it_preempts(grows, preempted):
    """What the morph runtime used to compute ahead of FCFS (blocks_short_for_running): the blocks every running
    sequence's next chunk needs beyond the free ones, offered at the first one that does not fit."""
    pool, asked, clock = BlockPool(3, max_blocks=20), [], SchedulerClock()
    s = Scheduler(pool, BS, 16, 64, on_shortfall=growing_hook(pool, [grows], asked))
    three_decodes_each_short_of_a_block(s, clock)
    out = s.schedule()
    assert asked == [3]                                 # A, B and C need a block each, none is free
    assert [v.request_id for v in out.preempted] == preempted
    assert [c.seq.request_id for c in out.chunks] == [q for q in "ABC" if q not in preempted]
    assert s.num_preemptions == len(preempted)
    pool.check_invariants()


def test_slai_offers_the_shortfall_it_meets_before_it_preempts():
    """The scenario of test_slai's newest-partial-prefill preemption, with a hook that grows the pool by what it
    is asked: the critical decode's block, then the block P1's next chunk needs (it could preempt P2), and
    nobody is preempted. (FCFS's order, which the runtime used to simulate under every scheduler, gives 2 at once.)"""
    clock = SchedulerClock()
    pool, asked = BlockPool(3, max_blocks=20), []
    s = SlaiScheduler(pool, BS, 16, 4, clock, SlaiConfig(), on_shortfall=growing_hook(pool, [1, 1], asked))
    d = req("D", 4, tbt=1.0)
    s.add(d)
    assert run(s, clock, 0.1) == [("D", 4)]
    running_partial_prefill(s, "P1", 0.1)
    running_partial_prefill(s, "P2", 0.2)
    clock.t = 5.0                                       # D is critical and needs a block; none is free
    out = s.schedule()
    assert asked == [1, 1] and out.preempted == []
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("D", 1), ("P1", 3)] and len(d.block_ids) == 2
    assert [x.request_id for x in s.running] == ["D", "P1", "P2"]


def test_slai_does_not_ask_for_blocks_when_nobody_would_be_preempted():
    """A relaxed decode without a block waits (test_slai): the hook is not asked, as nothing is preempted
    (FCFS's order counts D's block too and would have quantized)."""
    clock, asked = SchedulerClock(), []
    pool = BlockPool(4, max_blocks=20)
    s = SlaiScheduler(pool, BS, 16, 8, clock, SlaiConfig(), on_shortfall=growing_hook(pool, [4], asked))
    d = req("D", 4, tbt=100.0)
    s.add(d)
    run(s, clock, 0.1)
    s.add(req("P", 12, arrival=0.1))
    assert run(s, clock, 0.1) == [("P", 8)]
    s.max_num_batched_tokens = 12
    out = s.schedule()                                  # P's last chunk takes the last block; D waits
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("P", 4)]
    assert asked == [] and out.preempted == [] and d.status is SequenceStatus.RUNNING


# ---- engines ----------------------------------------------------------------------------------------
# test_arena's quantize-instead-of-preemption case and test_morph's random load run under FCFS and SLAI alike.
def test_a_failing_shortfall_hook_is_a_morph_fault_and_the_scheduler_preempts(tiny):
    e = morph_engine(tiny, "performance", clock=FakeClock(), scheduler="slai", kv_high=1.0, queue_delay_high_s=1e9,
                     persist_iters=10_000)

    def broken(view, blocks):
        raise RuntimeError("injected cover failure")
    morph(e).cover_shortfall = broken  # type: ignore[method-assign]
    outs = e.generate([[(7 * i + j) % 4000 + 10 for j in range(8)] for i in range(4)],
                      SamplingParams(max_tokens=40, ignore_eos=True))
    assert [len(o["token_ids"]) for o in outs] == [40] * 4
    assert e.scheduler.num_preemptions > 0 and morph(e).stats.swaps == 0
    assert e.faults.failed_iterations >= 1 and "injected cover failure" in e.faults.last_error
    assert_exact_accounting(e)
