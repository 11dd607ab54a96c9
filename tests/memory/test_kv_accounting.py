"""Randomized arrivals, aborts, shared prompt prefixes and tight KV pools: block accounting stays exact after
every step (a block shared through the prefix cache is held once per sequence that uses it)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams


def assert_exact_accounting(engine: LLMEngine) -> None:
    pool, sched = engine.pool, engine.scheduler
    pool.check_invariants()
    holders = Counter(b for s in [*sched.running, *sched.waiting] for b in s.block_ids)
    for s in [*sched.running, *sched.waiting]:
        assert len(s.block_ids) == len(set(s.block_ids)), "a sequence holds a block twice"
    assert dict(holders) == pool._refs, "the pool's holds are not exactly the sequences' blocks"
    assert len(holders) == pool.num_used, "used blocks are not exactly the blocks sequences own"
    assert not holders.keys() & pool._free_set, "an owned block is also free"
    for s in sched.running:
        assert len(s.block_ids) * engine.config.block_size >= s.num_computed_tokens
    assert len(sched.running) <= engine.config.max_num_seqs


@pytest.fixture(scope="module")
def engines(tiny):
    cache = {}

    def get(blocks: int, budget: int, max_seqs: int) -> LLMEngine:
        key = (blocks, budget, max_seqs)
        if key not in cache:
            cache[key] = LLMEngine(EngineConfig(num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=budget,
                                                max_num_seqs=max_seqs), loaded=tiny)
        return cache[key]
    return get


request = st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 6), st.sampled_from([None, 0, 1, 3, 8]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request, min_size=1, max_size=10), blocks=st.integers(13, 40),
       budget=st.sampled_from([8, 16, 64]), max_seqs=st.sampled_from([2, 4, 16]), seed=st.integers(0, 2**16))
def test_accounting_exact_under_random_load(engines, reqs, blocks, budget, max_seqs, seed):
    engine = engines(blocks, budget, max_seqs)
    finished: dict[str, str] = {}
    plan = sorted(((arrive, i) for i, (_, _, arrive, _) in enumerate(reqs)))
    rids: dict[int, str] = {}
    step = 0
    while plan or engine.has_unfinished_requests():
        while plan and plan[0][0] <= step:
            _, i = plan.pop(0)
            n_prompt, max_tokens, _, _ = reqs[i]
            # requests with an even index share their first tokens (prefix-cache hits, shared blocks)
            prompt = [(seed + (31 * i if i % 2 else 0) + 7 * j) % 5000 + 10 for j in range(n_prompt)]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed + i, ignore_eos=True)
            rids[i] = engine.add_request(prompt, params,
                                         callback=lambda o: o.finished
                                         and finished.__setitem__(o.request_id, o.finish_reason.value))
        for i, (_, _, _, abort_at) in enumerate(reqs):
            if abort_at == step and i in rids:
                engine.abort_request(rids[i])
        engine.step()
        assert_exact_accounting(engine)
        step += 1
        assert step < 3000, "engine did not drain"
    assert engine.pool.num_used == 0 and engine.pool.num_free == engine.pool.num_blocks
    assert set(finished) == set(rids.values())
    for i, rid in rids.items():
        assert finished[rid] in ("length", "abort")
