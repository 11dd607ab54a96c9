"""Prefix caching: exact block ids and holds in the pool, hash chains, and engines that reuse cached KV and
still produce exactly the tokens of an engine that recomputes everything (and of transformers)."""

from __future__ import annotations

import pytest
import torch

from policy import MorphDecision
from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.memory.block_pool import BlockPool, BlockPoolError
from serve.memory.prefix_hash import extend_block_hashes
from tests.memory.test_kv_accounting import assert_exact_accounting
from tests.morph.test_morph import FakeClock, morph_engine
from tests.morph_support import morph

H = [bytes([i]) * 32 for i in range(8)]  # stand-in content hashes


# ---- the pool --------------------------------------------------------------------------------------
def test_a_freed_registered_block_stays_cached_until_plain_free_blocks_run_out():
    pool = BlockPool(6)
    a = pool.allocate(3)
    pool.register(a[0], H[0])
    pool.register(a[1], H[1])
    pool.free(a)
    assert (pool.num_free, pool.num_cached, pool.num_used) == (6, 2, 0)
    assert pool.lookup([H[0], H[1], H[2]]) == [0, 1]
    assert pool.lookup([H[1]]) == [1] and pool.lookup([H[2], H[0]]) == []
    assert pool.allocate(4) == [2, 3, 4, 5]          # never-cached blocks first
    assert pool.lookup([H[0], H[1]]) == [0, 1]
    assert pool.allocate(1) == [1]                   # then the cache, tail block of the sequence first
    assert pool.lookup([H[0], H[1]]) == [0]          # block 1 was evicted: its hash is gone
    pool.check_invariants()


def test_take_shares_a_block_and_the_last_holder_frees_it():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.register(a[0], H[0])
    pool.take([a[0]])                                # a second sequence with the same first block
    pool.free(a)                                     # the first one finishes
    assert (pool.num_used, pool.num_cached) == (1, 0)
    pool.free([a[0]])
    assert (pool.num_used, pool.num_cached) == (0, 1)
    pool.take([a[0]])                                # a cached block is taken back out of the cache
    assert (pool.num_used, pool.num_cached) == (1, 0)
    with pytest.raises(BlockPoolError, match="no registered prefix"):
        pool.take([a[1]])
    pool.free([a[0]])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free([a[0]])
    pool.check_invariants()


def test_the_first_block_registered_for_a_hash_keeps_it():
    pool = BlockPool(4)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.register(a[0], H[0])
    pool.register(b[0], H[0])                         # same content computed twice: no second entry
    pool.register(a[0], H[1])                         # a block keeps its first hash
    assert pool.lookup([H[0]]) == a and pool.lookup([H[1]]) == []
    pool.free(b)
    assert pool.num_cached == 0                      # b holds no registered prefix: plain free
    with pytest.raises(BlockPoolError, match="not in use"):
        pool.register(b[0], H[2])
    pool.check_invariants()


def test_clear_cache_forgets_every_prefix_and_bumps_the_epoch():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.register(a[0], H[0])
    pool.register(a[1], H[1])
    pool.free([a[1]])
    pool.clear_cache()
    assert pool.cache_epoch == 1 and pool.num_cached == 0 and pool.lookup([H[0]]) == []
    assert (pool.num_free, pool.num_used) == (3, 1)  # the in-use block stays in use, the cached one is free
    pool.free([a[0]])
    assert pool.num_cached == 0
    pool.check_invariants()


def test_cached_blocks_do_not_pin_a_kv_extent():
    pool = BlockPool(2, max_blocks=6)
    pool.add_extent("layer-3", 2)
    a = pool.allocate(4)
    pool.register(a[3], H[3])
    pool.free(a)
    assert pool.num_cached == 1 and pool.extent_is_free("layer-3")
    pool.remove_extent("layer-3")                      # the cached block in it is evicted with it
    assert (pool.num_blocks, pool.num_free, pool.num_cached) == (2, 2, 0) and pool.lookup([H[3]]) == []
    pool.check_invariants()


# ---- the hashes -------------------------------------------------------------------------------------
def test_block_hashes_name_the_whole_prefix_and_the_epoch():
    a = extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7], 2, 3, root=b"")
    assert len(a) == 3 and len(set(a)) == 3
    assert extend_block_hashes([], [1, 2, 3, 4, 9, 9], 2, 3, root=b"")[:2] == a[:2]
    assert extend_block_hashes([], [0, 2, 3, 4, 5, 6], 2, 3, root=b"")[1] != a[1]   # block 1 depends on block 0
    assert extend_block_hashes([], [1, 2, 3, 4, 5, 6], 2, 3, root=b"1")[0] != a[0]
    grown = extend_block_hashes(a[:1], [1, 2, 3, 4, 5, 6], 2, 3, root=b"")            # extends in place
    assert grown == a
    with pytest.raises(ValueError, match="not full"):
        extend_block_hashes([], [1, 2, 3], 2, 2, root=b"")


# ---- engines ----------------------------------------------------------------------------------------
def _engine(loaded, caching: bool, **kw) -> LLMEngine:
    cfg = {"num_kv_blocks": 64, "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8, **kw}
    return LLMEngine(EngineConfig(enable_prefix_caching=caching, **cfg), loaded=loaded)


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def test_a_repeated_prompt_reuses_its_blocks_and_yields_the_same_tokens(tiny):
    prompt = [(17 * j) % 900 + 10 for j in range(23)]
    ref = _engine(tiny, caching=False).generate([prompt], GREEDY)[0]["token_ids"]
    e = _engine(tiny, caching=True)
    first = e.generate([prompt], GREEDY)[0]["token_ids"]
    assert e.stats().prefix_cache_hits == 0
    # all 23 prompt tokens and 11 of the 12 outputs went into the KV: 34 tokens = 8 full blocks, now cached
    assert e.pool.num_cached == 8 and e.pool.num_used == 0
    second = e.generate([prompt], GREEDY)[0]["token_ids"]
    s = e.stats()
    assert first == ref and second == ref
    assert s.prefix_cache_hits == 20 and s.prefix_cache_queries == 46   # 5 full blocks before the last token
    assert_exact_accounting(e)


def test_concurrent_requests_share_a_common_prefix_exactly(tiny):
    system = [(13 * j) % 700 + 20 for j in range(12)]                       # 3 full blocks
    prompts = [system + [100 + i, 200 + i, 300 + i] for i in range(4)]
    ref = _engine(tiny, caching=False).generate(prompts, GREEDY)
    e = _engine(tiny, caching=True)
    e.generate([system + [5, 6]], SamplingParams(max_tokens=1))            # warms the 3 shared blocks
    got = e.generate(prompts, GREEDY)
    assert [g["token_ids"] for g in got] == [r["token_ids"] for r in ref]
    assert e.stats().prefix_cache_hits == 4 * 12
    assert_exact_accounting(e)


def test_prefix_caching_off_never_looks_up(tiny):
    e = _engine(tiny, caching=False)
    prompt = list(range(40, 60))
    e.generate([prompt, prompt], GREEDY)
    s = e.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.kv_blocks_cached) == (0, 0, 0)


def _hits(e: LLMEngine) -> int:
    return e.stats().prefix_cache_hits


def test_exact_serves_a_block_only_under_the_configuration_that_computed_it(tiny):
    e = morph_engine(tiny, "performance", blocks=40)             # prefix_cache_across_morph="exact" (default)
    prompt = [(7 * j) % 500 + 30 for j in range(17)]             # 4 full blocks of 4 looked up; token 17 computes
    full = e.generate([prompt], GREEDY)[0]["token_ids"]
    cached = e.pool.num_cached
    assert cached > 0
    morph(e).apply_now(MorphDecision("quantize", (0,), "int4", "test"))
    assert e.pool.num_cached == cached and e.pool.cache_epoch == 0  # kept, not forgotten
    e.generate([prompt], GREEDY)
    assert _hits(e) == 0                                         # computed again with the int4 layer
    e.generate([prompt], GREEDY)
    assert _hits(e) == 16                                        # the int4 configuration's own blocks
    morph(e).apply_now(MorphDecision("restore", (0,), None, "test"))
    assert morph(e).config_signature() == "f" * tiny.config.num_layers
    again = e.generate([prompt], GREEDY)[0]["token_ids"]
    assert _hits(e) == 32                                        # full precision's blocks, cached before the swap
    assert again == full                                         # and exactly the tokens they gave then
    assert_exact_accounting(e)


def test_a_request_computed_across_a_transition_registers_nothing_after_it(tiny):
    e = morph_engine(tiny, "performance", blocks=40)              # 32-token prefill chunks, blocks of 4
    prompt = [(11 * j) % 500 + 30 for j in range(80)]
    e.add_request(prompt, SamplingParams(max_tokens=1))
    e.step()                                                     # tokens 0-31 at full precision: 8 blocks
    assert len(e.pool.registered_hashes()) == 8
    morph(e).apply_now(MorphDecision("quantize", (0,), "int4", "test"))
    e.step()                                                     # tokens 32-63 with the int4 layer
    morph(e).apply_now(MorphDecision("restore", (0,), None, "test"))
    while e.has_unfinished_requests():                           # 64-79 at full precision again, but they
        e.step()                                                 # attend to KV the int4 layer computed
    assert len(e.pool.registered_hashes()) == 8
    e.generate([prompt], GREEDY)
    assert _hits(e) == 32                                        # only the first chunk's blocks serve
    assert_exact_accounting(e)


def test_preserve_serves_cached_blocks_under_any_configuration(tiny):
    e = LLMEngine(EngineConfig(num_kv_blocks=40, block_size=4, max_num_batched_tokens=32, max_num_seqs=16,
                               morph_mode="performance", max_model_len=256, prefix_cache_across_morph="preserve",
                               policy_overrides={"persist_iters": 1, "restore_persist_s": 5.0, "cost_aware": False}),
                  loaded=tiny, clock=FakeClock())
    prompt = [(7 * j) % 500 + 30 for j in range(17)]
    e.generate([prompt], GREEDY)
    morph(e).apply_now(MorphDecision("quantize", (0,), "int4", "test"))
    e.generate([prompt], GREEDY)
    assert _hits(e) == 16                                        # the full-precision blocks serve the int4 model
    assert_exact_accounting(e)


def test_reset_prefix_cache_forgets_every_configuration(tiny):
    e = morph_engine(tiny, "performance", blocks=40)
    prompt = [(7 * j) % 500 + 30 for j in range(17)]
    e.generate([prompt], GREEDY)
    e.reset_prefix_cache()
    assert e.pool.num_cached == 0 and e.pool.cache_epoch == 1
    e.generate([prompt], GREEDY)
    assert _hits(e) == 0
    assert_exact_accounting(e)


def test_a_prefix_hit_on_the_real_model_still_matches_transformers(smollm, smollm_hf):
    ids = smollm.tokenizer.encode("The old lighthouse keeper climbed the spiral stairs every evening, counting "
                                  "the steps aloud while the wind rattled the windows.")
    with torch.inference_mode():
        x = torch.tensor([ids])
        want = smollm_hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16,
                                  min_new_tokens=16)[0, len(ids):].tolist()
    e = LLMEngine(EngineConfig(num_kv_blocks=64), loaded=smollm)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert e.generate([ids], params)[0]["token_ids"] == want
    assert e.generate([ids], params)[0]["token_ids"] == want
    assert e.stats().prefix_cache_hits == (len(ids) - 1) // 16 * 16 > 0
