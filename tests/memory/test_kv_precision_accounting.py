"""int8 KV blocks in the arena: a slot is one block of the configured format, so layer swaps hand the KV pool int8
blocks (more of them per freed byte), and blocks, arena bytes and the ledger stay exact under random load with
morphing, preemption, prefix hits and cancellation."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy import FULL, MorphDecision
from serve.model.kv_format import KVLayout
from tests.morph.test_morph import (
    FakeClock,
    assert_memory_exact,
    assert_swap_mid_decode_keeps_state,
    decode_with_swap_at,
    morph_engine,
    run_random_load_to_base,
)
from tests.morph_support import morph


def test_a_swap_adds_int8_blocks_in_the_layers_own_bytes(tiny):
    """Quantizing layer 0 to int4 frees the same bytes either way; with int8 KV they are 3.2x the blocks (the tiny
    model's int8 block is 640 bytes against 2,048 at fp32: head_dim 16 pays more for its scales), each one inside
    the layer's region, and the ledger counts them exactly."""
    slot = {fmt: KVLayout.of(tiny.config, 4, torch.float32, fmt).block_bytes for fmt in ("auto", "int8")}
    assert slot == {"auto": 2048, "int8": 640}
    gained, blocks = {}, {}
    for fmt in ("auto", "int8"):
        e = morph_engine(tiny, "performance", blocks=8, kv_cache_dtype=fmt)
        assert e.ledger.slot_bytes == slot[fmt]
        region = morph(e).bank.regions[0]
        morph(e).apply_now(MorphDecision("quantize", (0,), "int4", "test"))
        extent = e.pool.extents[-1]
        gained[fmt], blocks[fmt] = extent.num_blocks * e.ledger.slot_bytes, extent.num_blocks
        phys = e.kv.block_map[extent.start:extent.end].tolist()
        assert region.start <= min(phys) and max(phys) < region.end
        assert_memory_exact(e)
        held = e.pool.allocate(e.pool.num_free)  # fill the grown pool, then give it back and restore
        e.pool.free(held)
        morph(e).apply_now(MorphDecision("restore", (0,), None, "test"))
        assert e.model.layers[0].precision == FULL and e.pool.num_blocks == e.pool.base_blocks
        assert_memory_exact(e)
    # the same freed bytes (up to one fp32 slot of rounding at each end of the region), 3x the blocks and more
    assert abs(gained["int8"] - gained["auto"]) <= 2 * slot["auto"] and blocks["int8"] >= 3 * blocks["auto"]


def test_a_swap_mid_decode_keeps_int8_kv_state(tiny):
    """With int8 KV blocks, quantizing layers mid-decode gives the tokens of a mode-off int8-KV engine that swaps the
    same layers in place at the same step (its KV never moved): the swap neither loses nor remaps an 8-bit block."""
    assert_swap_mid_decode_keeps_state(lambda step: decode_with_swap_at(
        lambda: morph_engine(tiny, "performance", blocks=64, kv_cache_dtype="int8", kv_high=1.0,
                             queue_delay_high_s=1e9, restore_persist_s=1e9), step),
        lambda: morph_engine(tiny, "off", blocks=64, kv_cache_dtype="int8"), tiny)


request = st.tuples(st.integers(4, 40), st.integers(1, 16), st.integers(0, 30), st.sampled_from([None, 2, 5, 11]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request, min_size=1, max_size=12), mode=st.sampled_from(["default", "performance", "accuracy"]),
       blocks=st.integers(16, 40), seed=st.integers(0, 1000), scheduler=st.sampled_from(["fcfs", "slai"]))
def test_random_load_with_int8_kv_keeps_memory_and_blocks_exact(tiny, reqs, mode, blocks, seed, scheduler):
    """tests/morph/test_morph.py's random load (arrivals, aborts, shared prompt prefixes, swaps under pressure,
    preemption) with int8 KV: after every step the arena partition, the ledger and every block's holders are
    exact, and the engine drains back to full precision with every block free."""
    clock = FakeClock()
    e = morph_engine(tiny, mode, blocks=blocks, clock=clock, scheduler=scheduler, kv_cache_dtype="int8",
                     persist_iters=1 + seed % 3, restore_persist_s=float(seed % 4))
    assert e.kv.is_quantized
    run_random_load_to_base(e, clock, reqs, seed, shared_prefix=8)
