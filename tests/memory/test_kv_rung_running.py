"""The KV-precision rung converting running sequences' blocks in place (serve/engine/kv_rung.py): a cold full block is
re-written as an 8-bit block inside the bytes it frees, its holder repointed, its slot retired. A request whose early
blocks are converted mid-decode continues as a reference that rounds exactly those positions at that step; the prefix
cache and the KV events a router hears stay consistent; blocks and bytes stay exact under random load."""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy.kv_rung import KVRungDecision
from serve.engine.kv_rung import KVPrecisionRung
from serve.engine.sampling_params import SamplingParams
from serve.model.kv_cache import Q8_BLOCK
from serve.model.kv_format import dequantize, quantize
from tests.memory.test_kv_accounting import assert_exact_accounting
from tests.morph.test_morph import FakeClock, assert_memory_exact, morph_engine, run_random_load_to_base
from tests.morph_support import morph

CALM = {"kv_high": 1.0, "queue_delay_high_s": 1e9, "restore_persist_s": 1e9}
"""Policy overrides under which nothing acts by itself while the pool has a free block (the tests drive the rung)."""


def _rung(e) -> KVPrecisionRung:
    rung = e.resource_manager(KVPrecisionRung)
    assert rung is not None
    return rung


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x [B, kv_heads, T, head_dim]`` as int8 blocks hold it (the writer's per token-head scales)."""
    rows = x.transpose(1, 2)
    codes, scales = quantize(rows.reshape(-1, *rows.shape[2:]), "int8")
    return dequantize(codes, scales, "int8", x.dtype).view(rows.shape).transpose(1, 2)


def _rounds_prefix_at(prefix: int, at: int):
    """A transformers DynamicCache that, once ``at`` positions are cached (before position ``at`` is appended),
    rounds the K/V of positions ``0 .. prefix - 1`` in place, in every layer: what the rung does to those blocks."""
    from transformers import DynamicCache  # noqa: PLC0415

    class Cache(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            if layer_idx < len(self.layers) and self.get_seq_length(layer_idx) >= at:
                layer = self.layers[layer_idx]
                if not getattr(layer, "rounded", False):
                    layer.keys[:, :, :prefix] = _round_trip(layer.keys[:, :, :prefix])
                    layer.values[:, :, :prefix] = _round_trip(layer.values[:, :, :prefix])
                    layer.rounded = True
            return super().update(k, v, layer_idx, *args, **kwargs)

    return Cache()


def test_running_blocks_converted_mid_decode_continue_as_a_reference_rounding_them_at_that_step(tiny):
    """Three steps into decoding (positions 0-10 stored), the rung re-writes the request's two full blocks (positions
    0-7; block 16, being written, is not cold) as 8-bit blocks in their own bytes. (1) The greedy tokens equal
    transformers' with a cache that rounds exactly positions 0-7 when position 11 is next. (2) Layer 0's K/V read back
    rounded at 0-7 and unrounded from 8 on. (3) Its table points at the 8-bit blocks; the old slots are retired."""
    from serve.model.hf_reference import hf_llama  # noqa: PLC0415

    prompt = [(7 * j) % 4000 + 10 for j in range(8)]
    e = morph_engine(tiny, "performance", blocks=20, kv_rung="int8", **CALM)
    rung = _rung(e)
    held = e.pool.allocate(14)  # the prompt lands in blocks 14, 15
    tokens: list[int] = []
    e.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True),
                  callback=lambda o: tokens.extend(o.new_token_ids))
    for _ in range(4):
        e.step()
    seq = e.scheduler.running[0]
    at = seq.num_computed_tokens
    assert at == 11 and seq.block_ids == [14, 15, 16] and rung.cold_blocks(e.scheduler) == [14, 15]
    rung.apply(KVRungDecision("convert", 0, "test", blocks=2), e.scheduler)
    new = seq.block_ids[:2]
    assert rung.blocks_rewritten_total == 2 and all(e.pool.is_quantized(b) for b in new) and seq.block_ids[2] == 16
    assert sorted(e.pool._retired) == [14, 15] and e.pool.holders(14) == 0 and e.pool.holders(new[0]) == 1
    assert bool((e.kv.block_format[new] == Q8_BLOCK).all())
    assert_memory_exact(e)
    e.pool.check_invariants()  # (the held blocks belong to no sequence: exact accounting is the other tests')
    blocks: list[int] = []
    while e.has_unfinished_requests():
        blocks = list(seq.block_ids) or blocks
        e.step()
        assert_memory_exact(e)
    assert blocks[:2] == new and not any(e.pool.is_quantized(b) for b in blocks[2:])
    assert morph(e).stats.swaps == 0 and e.scheduler.num_preemptions == 0
    hf = hf_llama(tiny, attn_implementation="eager", for_generation=True)
    with torch.inference_mode():
        x = torch.tensor([prompt])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                          cache=_rounds_prefix_at(8, at))[0, 8:].tolist()
        assert tokens == ref
        seen = prompt + tokens[:-1]
        plain = _rounds_prefix_at(0, 10**9)
        hf(torch.tensor([seen]), cache=plain, use_cache=True)
    ids = torch.tensor(blocks)
    k, v = (t[0, : len(seen)] for t in e.kv.read_blocks(0, e.kv.block_map[ids].view(1, -1),
                                                         e.kv.block_format[ids].view(1, -1)))
    pk, pv = (t[0].transpose(0, 1) for t in (plain.layers[0].keys, plain.layers[0].values))
    rk, rv = (_round_trip(t[None].transpose(1, 2))[0].transpose(0, 1) for t in (pk[:8], pv[:8]))
    assert (k[:8] - rk).abs().max() < 1e-5 and (v[:8] - rv).abs().max() < 1e-5
    assert (k[8:] - pk[8:]).abs().max() < 1e-5 and (k[:8] - pk[:8]).abs().max() > 1e-3
    e.pool.free(held)


class Recorder:
    """What a KV-aware router hears (serve/memory/block_pool.py ``CacheEvents``): the hashes stored and removed."""

    def __init__(self) -> None:
        self.stored: list[bytes] = []
        self.removed: list[bytes] = []


def _recorder(pool):
    rec = Recorder()

    class Hooks:
        def stored(self, block_hash, parent, tokens, root):
            rec.stored.append(block_hash)

        def removed(self, block_hash):
            rec.removed.append(block_hash)

        def root_changed(self, root):
            pass

        def cleared(self, root):
            pass

    pool.events = Hooks()
    return rec


def test_a_converted_registered_block_ends_its_prefix_under_exact_and_keeps_it_under_preserve(tiny):
    """A request's registered first block (positions 0-3) is converted mid-decode. exact: its hash is removed (the
    router hears it), the request registers nothing more (its later blocks attend to 8-bit KV) and a second request
    with the same prompt finds no prefix. preserve: the hash follows the 8-bit block (nothing to tell the router) and
    the second request takes it."""
    prompt = [(3 * j) % 4000 + 10 for j in range(9)]
    found = {}
    for policy in ("exact", "preserve"):
        e = morph_engine(tiny, "performance", blocks=30, kv_rung="int8", **CALM)
        e.config.prefix_cache_across_morph = policy
        e.pool.register_quantized = policy == "preserve"
        rec = _recorder(e.pool)
        e.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        e.step()  # prompt: blocks 0, 1 full and registered, block 2 holds position 8
        seq = e.scheduler.running[0]
        first = seq.block_ids[0]
        h0 = e.pool._hash_of[first]
        assert rec.stored[:2] == [h0, e.pool._hash_of[seq.block_ids[1]]]
        _rung(e).apply(KVRungDecision("convert", 0, "test", blocks=1), e.scheduler)
        new = seq.block_ids[0]
        assert new != first and e.pool.is_quantized(new)
        if policy == "exact":
            assert rec.removed == [h0] and h0 not in e.pool.registered_hashes() and seq.hash_root is None
        else:
            assert rec.removed == [] and e.pool._block_of[h0] == new and seq.hash_root is not None
        stored_before = len(rec.stored)
        for _ in range(4):
            e.step()
            assert_exact_accounting(e)
        assert (len(rec.stored) == stored_before) == (policy == "exact")  # block 2 filled at position 11
        e.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        e.step()
        second = e.scheduler.running[-1]
        found[policy] = second.block_ids[0] == new
        while e.has_unfinished_requests():
            e.step()
            assert_exact_accounting(e)
            assert_memory_exact(e)
    assert found == {"exact": False, "preserve": True}


def test_shared_blocks_and_blocks_being_written_are_never_converted(tiny):
    """Two requests share a cached prefix block (two holders): the rung lists neither it nor any block not yet full."""
    prompt = [(5 * j) % 4000 + 10 for j in range(9)]
    e = morph_engine(tiny, "performance", blocks=30, kv_rung="int8", **CALM)
    e.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    e.step()
    e.add_request(prompt + [99], SamplingParams(max_tokens=6, ignore_eos=True))
    e.step()
    a, b = e.scheduler.running
    assert a.block_ids[:2] == b.block_ids[:2] and e.pool.holders(a.block_ids[0]) == 2
    assert _rung(e).cold_blocks(e.scheduler) == []
    _rung(e).apply(KVRungDecision("convert", 0, "test", blocks=4), e.scheduler)
    assert _rung(e).blocks_rewritten_total == 0 and _rung(e).conversions_total == 0


def test_pressure_rewrites_running_blocks_when_no_free_slot_is_left(tiny):
    """No free full-precision slot, usage at kv_high: the rule converts just enough cold running blocks to bring
    usage back to the middle of the band, with no layer swap and no preemption, and every token still comes."""
    clock = FakeClock()
    e = morph_engine(tiny, "performance", blocks=24, clock=clock, kv_rung="int8", kv_high=0.9, kv_low=0.5,
                     queue_delay_high_s=1e9, restore_persist_s=1e9)
    outs = {}
    for i in range(3):
        e.add_request([(13 * i + j) % 4000 + 10 for j in range(24)], SamplingParams(max_tokens=12, ignore_eos=True),
                      callback=lambda o, i=i: outs.setdefault(i, []).extend(o.new_token_ids))
    rung = _rung(e)
    while e.has_unfinished_requests():
        e.step()
        clock.t += 0.05
        assert_memory_exact(e)
        assert_exact_accounting(e)
    assert rung.blocks_rewritten_total > 0, rung.last
    assert morph(e).stats.swaps == 0 and e.scheduler.num_preemptions == 0
    assert all(len(v) == 12 for v in outs.values())
    assert e.stats().kv_precision_blocks_rewritten_total == rung.blocks_rewritten_total


request = st.tuples(st.integers(4, 40), st.integers(1, 16), st.integers(0, 30), st.sampled_from([None, 2, 5, 11]))


def _forced_conversions(e, seed: int):
    """Before some steps, the rung converts 1-3 running blocks whatever the pressure (as a shortfall would)."""
    rng = random.Random(seed)
    rung = _rung(e)

    def before_step(step: int) -> None:
        if rng.random() < 0.3:
            rung.apply(KVRungDecision("convert", rng.choice([0, 0, 1]), "test", blocks=rng.randint(1, 3)), e.scheduler)
    return before_step


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request, min_size=1, max_size=12), mode=st.sampled_from(["default", "performance", "accuracy"]),
       blocks=st.integers(16, 40), seed=st.integers(0, 1000), scheduler=st.sampled_from(["fcfs", "slai"]),
       prefix_cache=st.sampled_from(["exact", "preserve"]))
def test_random_load_converting_running_blocks_keeps_memory_and_blocks_exact(tiny, reqs, mode, blocks, seed, scheduler,
                                                                             prefix_cache):
    """tests/morph/test_morph.py's random load (arrivals, aborts, shared prefixes with hits, preemption) with the rung
    re-writing running blocks at random steps, beside its own conversions and layer swaps: arena, ledger, conversions
    and every block's holders exact after every step; back at the base pool and full precision at the end."""
    clock = FakeClock()
    e = morph_engine(tiny, mode, blocks=blocks, clock=clock, scheduler=scheduler, kv_rung="int8",
                     persist_iters=1 + seed % 3, restore_persist_s=float(seed % 4))
    e.config.prefix_cache_across_morph = prefix_cache
    _rung(e).pool.register_quantized = prefix_cache == "preserve"
    run_random_load_to_base(e, clock, reqs, seed, shared_prefix=8, before_step=_forced_conversions(e, seed))
    assert e.pool.num_retired == 0 and _rung(e).is_at_rest()


def test_a_fixed_random_load_rewrites_running_blocks_through_preemption_hits_and_aborts(tiny):
    """One fixed load of the test above that is known to exercise everything at once (so the randomized test cannot
    pass by never converting): running blocks re-written, preemptions, prefix hits and aborts all happen."""
    clock = FakeClock()
    e = morph_engine(tiny, "accuracy", blocks=16, clock=clock, kv_rung="int8", persist_iters=2, restore_persist_s=1.0)
    reqs = [(17, 15, 4, None), (21, 15, 3, None), (29, 6, 6, 5), (18, 14, 1, None), (32, 13, 4, 5), (22, 16, 6, None),
            (17, 16, 1, 5), (33, 6, 5, None), (15, 15, 0, 2), (34, 6, 6, 2)]
    run_random_load_to_base(e, clock, reqs, 3, shared_prefix=8, before_step=_forced_conversions(e, 3))
    stats = e.stats()
    assert _rung(e).blocks_rewritten_total > 0 and e.scheduler.num_preemptions > 0
    assert e.scheduler.kv_cache_manager.prefix_hit_tokens > 0 and stats.kv_precision_blocks_rewritten_total > 0
