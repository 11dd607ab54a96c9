"""The KV-precision rung (serve/engine/kv_rung.py, ``--policy kv_rung=int8``): free full-precision slots become 8-bit
blocks under pressure, before layers are swapped, and come back when calm; blocks and bytes stay exact; a request
whose later blocks are 8-bit continues as a reference that rounds exactly those positions' K/V; under ``exact`` the
prefix cache never serves 8-bit KV to a full-precision chain (a chain that starts 8-bit is keyed apart)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy.kv_rung import KVRungDecision
from serve.engine.kv_rung import KVPrecisionRung
from serve.engine.sampling_params import SamplingParams
from serve.memory.block_pool import BlockPool, BlockPoolError
from serve.memory.prefix_hash import extend_block_hashes
from serve.metrics_catalogue import ENGINE_METRICS
from serve.model.kv_cache import Q8_BLOCK
from serve.model.kv_format import dequantize, quantize
from tests.memory.test_kv_accounting import assert_exact_accounting
from tests.morph.test_morph import (
    FakeClock,
    assert_memory_exact,
    drain_and_settle,
    morph_engine,
    run_random_load_to_base,
)
from tests.morph_support import morph

CALM = {"kv_high": 1.0, "queue_delay_high_s": 1e9, "restore_persist_s": 1e9}
"""Policy overrides under which nothing acts by itself (the tests drive the rung)."""


def _rung(e) -> KVPrecisionRung:
    rung = e.resource_manager(KVPrecisionRung)
    assert rung is not None
    return rung


def test_retired_blocks_count_nowhere_until_they_come_back():
    pool = BlockPool(8, max_blocks=20)
    held = pool.allocate(3)
    pool.retire([6, 7])
    assert (pool.num_blocks, pool.num_free, pool.num_retired) == (6, 3, 2)
    pool.check_invariants()
    assert pool.allocate(4) is None  # 3 free: ids 3, 4, 5
    extent = pool.add_extent("kv8:0", 7, quantized=True)
    assert extent.start == 8 and pool.num_blocks == 13 and pool.is_quantized(9) and not pool.is_quantized(5)
    assert pool.allocate(4) == [3, 4, 5, 8]  # full-precision blocks first, then the 8-bit ones
    try:
        pool.retire([3])
        raise AssertionError("retired a block in use")
    except BlockPoolError:
        pass
    layer = pool.add_extent("layer", 4)  # ids 15-18, full precision: free ones the rung may convert
    assert pool.free_full_ids() == [15, 16, 17, 18] and pool.num_free_full == 4  # 9-14: free but 8-bit
    pool.free([8])
    assert pool.free_full_ids() == [15, 16, 17, 18] and pool.num_free_full == 4 and pool.num_free == 11
    pool.free([3])
    assert pool.free_full_ids() == [3, 15, 16, 17, 18] and pool.num_free_full == 5
    pool.remove_extent(layer.owner)
    pool.free([4, 5])
    pool.remove_extent("kv8:0")
    pool.unretire([6, 7])
    pool.free(held)
    assert (pool.num_blocks, pool.num_free, pool.num_retired) == (8, 8, 0)
    pool.check_invariants()


def test_pressure_converts_before_any_layer_swap_and_calm_reverts_lifo(tiny):
    """Eight 30-token prompts on 20 blocks: the rung converts every free slot first (the waiting prompts need 64
    blocks), the morph runtime then swaps what is still short; the pool is exact at every step; once calm, the morph
    extent leaves first (LIFO), then the rung's, and the engine is back at its 20 full-precision blocks."""
    clock = FakeClock()
    e = morph_engine(tiny, "performance", blocks=20, clock=clock, kv_rung="int8")
    rung = _rung(e)
    assert [m.name for m in e.resources] == ["kv_precision", "morph", "quality"] and e.kv.mixes_formats
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(8):
        e.add_request([(17 * i + j) % 4000 + 10 for j in range(30)], params)
    e.step()
    assert rung.conversions_total == 1 and rung.slots_converted == 20 and rung.kv_blocks_8bit == 63
    assert e.pool.extents[1].quantized  # the rung's extent came before the first layer's
    while e.has_unfinished_requests():
        e.step()
        clock.t += 0.05
        assert_memory_exact(e)
        assert_exact_accounting(e)
    stats = e.stats()
    assert stats.kv_precision_conversions_total == 1 and stats.kv_blocks_8bit == 63
    assert stats.kv_precision_bytes_gained == (63 - 20) * e.kv.full.layout.block_bytes
    assert stats.resources["kv_precision"].slots_converted == 20
    drain_and_settle(e, clock)
    assert rung.reverts_total == 1 and e.pool.num_blocks == 20 and e.pool.num_retired == 0
    assert morph(e).stats.restores == morph(e).stats.swaps


def test_a_layer_restore_waits_while_a_newer_8bit_extent_lies_above_its_extent(tiny):
    """Extents leave LIFO whoever added them: rung extent, layer extent, rung extent; the second conversion takes the
    highest free full-precision blocks, the layer extent's; the layer cannot be restored (its extent is not the newest
    and not free) until the rung's newer extent has gone, and the pool stays exact throughout."""
    from policy import FULL, MorphDecision  # noqa: PLC0415

    e = morph_engine(tiny, "performance", blocks=20, kv_rung="int8", **CALM)
    rung, m = _rung(e), morph(e)
    held = e.pool.allocate(16)
    rung.apply(KVRungDecision("convert", 4, "test"))          # blocks 16-19 -> an 8-bit extent
    m.apply_now(MorphDecision("quantize", (0,), "int4", "test"))  # a layer extent above it
    e.pool.free(held[-4:])                                      # blocks 12-15 free again
    rung.apply(KVRungDecision("convert", 4, "test"))          # a second 8-bit extent, above the layer's
    assert [c.quantized for c in e.pool.extents[1:]] == [True, False, True]
    layer_extent = e.pool.extents[2]
    assert rung.conversions[1].retired == list(range(layer_extent.end - 4, layer_extent.end))  # the layer extent's top
    assert_memory_exact(e)
    m.apply_now(MorphDecision("restore", (0,), None, "test"))
    assert e.model.layers[0].precision == "int4" and m.events[-1]["event"] == "restore_skipped"
    assert not e.faults.consecutive
    rung.apply(KVRungDecision("revert", 4, "test"))
    m.apply_now(MorphDecision("restore", (0,), None, "test"))
    assert e.model.layers[0].precision == FULL
    rung.apply(KVRungDecision("revert", 4, "test"))
    e.pool.free(held[:-4])
    assert e.pool.num_blocks == 20 and e.pool.num_retired == 0
    assert_memory_exact(e)


def test_the_default_mode_runs_the_rung_on_a_cpu_fp32_engine_and_not_when_asked_off(tiny):
    """kv_rung auto (the default mode's) resolves to int8 on this fp32 CPU engine: the rung is the first resource
    manager, ahead of the morph runtime; kv_rung null gives the default mode without it, and a static int8 cache
    none (nothing to convert) rather than an error."""
    from serve.morph.runtime import MorphRuntime  # noqa: PLC0415

    e = morph_engine(tiny, "default", blocks=20)
    rung = _rung(e)
    first, second = list(e.resources)[:2]
    assert rung.rule.kv_cache_dtype == "int8" and first is rung and isinstance(second, MorphRuntime)
    assert morph_engine(tiny, "default", blocks=20, kv_rung=None).resource_manager(KVPrecisionRung) is None
    assert morph_engine(tiny, "default", blocks=20, kv_cache_dtype="int8").resource_manager(KVPrecisionRung) is None


def test_the_rung_spares_layer_swaps(tiny):
    """Six 14-token prompts on 16 blocks: without the rung the runtime swaps layers, with it none is needed."""
    swaps = {}
    for rung in (None, "int8"):
        clock = FakeClock()
        e = morph_engine(tiny, "performance", blocks=16, clock=clock, **({"kv_rung": rung} if rung else {}))
        e.generate([[(11 * i + j) % 4000 + 10 for j in range(14)] for i in range(6)],
                   SamplingParams(max_tokens=8, ignore_eos=True))
        swaps[rung] = morph(e).stats.swaps
    assert swaps[None] >= 1 and swaps["int8"] == 0, swaps


def _round_trip_from(position: int):
    """A transformers DynamicCache rounding the K/V of positions >= ``position`` as int8 blocks hold them."""
    from transformers import DynamicCache  # noqa: PLC0415

    def rt(x: torch.Tensor, past: int) -> torch.Tensor:
        rows = x.transpose(1, 2).clone()  # [B, T, kvh, hd]
        keep = max(0, position - past)
        tail = rows[:, keep:]
        if tail.numel():
            codes, scales = quantize(tail.reshape(-1, *tail.shape[2:]), "int8")
            rows[:, keep:] = dequantize(codes, scales, "int8", x.dtype).view(tail.shape)
        return rows.transpose(1, 2)

    class Cache(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            past = self.get_seq_length(layer_idx) if layer_idx < len(self.layers) else 0
            return super().update(rt(k, past), rt(v, past), layer_idx, *args, **kwargs)

    return Cache()


def test_a_request_crossing_a_conversion_continues_as_a_reference_rounding_the_same_positions(tiny):
    """Mid-decode the rung converts the last two free slots; the request's later blocks are 8-bit (its table mixes
    formats: the mixed decode kernel reads it; 16 tokens leave one of the 5 8-bit blocks free, so no running block is
    converted). (1) Its greedy tokens equal transformers' with a cache that rounds exactly the K/V of positions 8 on
    (the ones in 8-bit blocks). (2) Layer 0's stored K/V (which depend on the token alone) read
    back as that reference's: unrounded at positions 0-7, rounded from 8 on, and the rounding is real there."""
    from serve.model.hf_reference import hf_llama  # noqa: PLC0415

    prompt = [(7 * j) % 4000 + 10 for j in range(8)]
    e = morph_engine(tiny, "performance", blocks=20, kv_rung="int8", **CALM)
    held = e.pool.allocate(16)  # leaves blocks 16..19: the prompt's two, and two to convert
    tokens: list[int] = []
    e.add_request(prompt, SamplingParams(max_tokens=16, ignore_eos=True),
                  callback=lambda o: tokens.extend(o.new_token_ids))
    e.step()  # the prompt (positions 0-7, full precision) and its first token
    seq = e.scheduler.running[0]
    assert len(tokens) == 1 and seq.block_ids == [16, 17]
    _rung(e).apply(KVRungDecision("convert", 2, "test"))
    assert _rung(e).kv_blocks_8bit == 5  # positions 8-22 need 4 blocks: no layer swap, no preemption
    blocks: list[int] = []
    while e.has_unfinished_requests():
        blocks = list(seq.block_ids) or blocks
        e.step()
        assert_memory_exact(e)
    assert [e.pool.is_quantized(b) for b in blocks] == [False, False] + [True] * 4
    assert morph(e).stats.swaps == 0 and e.scheduler.num_preemptions == 0 and _rung(e).blocks_rewritten_total == 0
    hf = hf_llama(tiny, attn_implementation="eager", for_generation=True)
    with torch.inference_mode():
        x = torch.tensor([prompt])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                          cache=_round_trip_from(8))[0, 8:].tolist()
        assert tokens == ref
        seen = prompt + tokens[:-1]  # every position whose K/V the engine stored
        rounded, plain = _round_trip_from(8), _round_trip_from(10**9)
        for cache in (rounded, plain):
            hf(torch.tensor([seen]), cache=cache, use_cache=True)
    ids = torch.tensor(blocks)
    k, v = (t[0, : len(seen)] for t in e.kv.read_blocks(0, e.kv.block_map[ids].view(1, -1),
                                                         e.kv.block_format[ids].view(1, -1)))
    (rk, rv), (pk, pv) = ((c.layers[0].keys[0].transpose(0, 1), c.layers[0].values[0].transpose(0, 1))
                          for c in (rounded, plain))
    assert (k - rk).abs().max() < 1e-5 and (v - rv).abs().max() < 1e-5
    assert (k[:8] - pk[:8]).abs().max() < 1e-5 and (k[8:] - pk[8:]).abs().max() > 1e-3
    e.pool.free(held)


def test_exact_never_registers_8bit_blocks_and_preserve_shares_them(tiny):
    """Under exact a sequence registers its full-precision blocks up to its first 8-bit one and nothing after; under
    preserve every full block is registered, 8-bit ones too."""
    registered = {}
    for policy in ("exact", "preserve"):
        e = morph_engine(tiny, "performance", blocks=20, kv_rung="int8", **CALM)
        e.config.prefix_cache_across_morph = policy
        _rung(e).pool.register_quantized = policy == "preserve"
        held = e.pool.allocate(17)  # ids 0..16 held: the prompt starts in 17..19
        _rung(e).apply(KVRungDecision("convert", 2, "test"))  # 18, 19 -> 8-bit blocks
        e.generate([[(5 * j) % 4000 + 10 for j in range(16)]], SamplingParams(max_tokens=2, ignore_eos=True))
        blocks = {e.pool._block_of[h] for h in e.pool.registered_hashes()}
        registered[policy] = (sorted(b for b in blocks if not e.pool.is_quantized(b)),
                              sorted(b for b in blocks if e.pool.is_quantized(b)))
        e.pool.free(held)
    assert registered["exact"] == ([17], [])
    assert len(registered["preserve"][0]) == 1 and len(registered["preserve"][1]) == 3


def test_exact_keys_a_chain_that_starts_8bit_apart_and_serves_it_to_the_same_prompt(tiny):
    """Under exact a prompt whose first block is 8-bit registers its chain under the pool's 8-bit root
    (``cache_root_8bit``), never under the full-precision root; the same prompt later finds it there (prefix hits),
    continues that chain, and generates the tokens the first one did; a full-precision chain is still found first."""
    e = morph_engine(tiny, "performance", blocks=20, kv_rung="int8", **CALM)
    e.config.prefix_cache_across_morph = "exact"
    pool = _rung(e).pool
    pool.register_quantized = False
    held = pool.allocate(16)
    _rung(e).apply(KVRungDecision("convert", 4, "test"))  # 16..19 -> 15 8-bit blocks: every new block is 8-bit
    prompt = [(7 * j) % 4000 + 10 for j in range(17)]
    first = e.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]["token_ids"]
    blocks = {pool._block_of[h]: h for h in pool.registered_hashes()}
    assert len(blocks) == 5 and all(pool.is_quantized(b) for b in blocks)  # 20 tokens computed
    full_chain = extend_block_hashes([], prompt, 4, 4, pool.cache_root)
    assert set(extend_block_hashes([], prompt, 4, 4, pool.cache_root_8bit)) <= set(blocks.values())
    assert not set(full_chain) & set(blocks.values())
    kvm = e.scheduler.kv_cache_manager
    assert kvm.prefix_hit_tokens == 0
    second = e.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]["token_ids"]
    assert kvm.prefix_hit_tokens == 16 and second == first
    pool.free(held)
    assert_memory_exact(e)


def test_the_rungs_metrics_are_in_the_catalogue():
    names = {m.stats_key for m in ENGINE_METRICS}
    assert {"kv_blocks_8bit", "kv_precision_conversions_total", "kv_precision_reverts_total",
            "kv_precision_bytes_gained"} <= names


request = st.tuples(st.integers(4, 40), st.integers(1, 16), st.integers(0, 30), st.sampled_from([None, 2, 5, 11]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request, min_size=1, max_size=12), mode=st.sampled_from(["default", "performance", "accuracy"]),
       blocks=st.integers(16, 40), seed=st.integers(0, 1000), scheduler=st.sampled_from(["fcfs", "slai"]),
       prefix_cache=st.sampled_from(["exact", "preserve"]))
def test_random_load_with_the_rung_keeps_memory_and_blocks_exact(tiny, reqs, mode, blocks, seed, scheduler,
                                                                 prefix_cache):
    """tests/morph/test_morph.py's random load (arrivals, aborts, shared prefixes, preemption) with the rung converting
    and reverting beside layer swaps: arena, ledger, conversions and every block's holders exact after every step;
    back at the base pool, every layer at full precision and nothing converted at the end."""
    clock = FakeClock()
    e = morph_engine(tiny, mode, blocks=blocks, clock=clock, scheduler=scheduler, kv_rung="int8",
                     persist_iters=1 + seed % 3, restore_persist_s=float(seed % 4))
    e.config.prefix_cache_across_morph = prefix_cache
    _rung(e).pool.register_quantized = prefix_cache == "preserve"
    run_random_load_to_base(e, clock, reqs, seed, shared_prefix=8)
    assert e.pool.num_retired == 0 and _rung(e).is_at_rest()
    assert int((e.kv.block_format[: e.pool.num_blocks] == Q8_BLOCK).sum()) == 0
