"""The arena makes a swap's freed weight bytes physically become KV blocks (issue: elastic memory made physical).

Addresses are checked with data_ptr, memory with the process's resident set, and behaviour with real engine
runs: a request that fits only after quantizing is served without preemption, one no configuration of the
mode can hold is refused at admission, and running requests short of blocks get a quantize step instead of
being preempted.
"""

from __future__ import annotations

import contextlib
import ctypes

import pytest

from policy import FULL, MorphDecision
from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.morph.placement import weight_tensors
from serve.morph.runtime import MorphRuntime
from tests.conftest import make_tiny_model
from tests.memory.test_kv_accounting import assert_exact_accounting
from tests.morph.test_morph import (
    FakeClock,
    assert_memory_exact,
    assert_swap_mid_decode_keeps_state,
    decode_with_swap_at,
    drain_and_settle,
    morph_engine,
)
from tests.morph_support import morph


def _rss_bytes() -> int:
    """Resident bytes of this process after glibc returns its free heap pages to the OS (malloc_trim), so the
    figure counts live memory, not what the allocator keeps cached from earlier activations."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _ranges(layer) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in weight_tensors(layer)]


def test_a_swap_turns_the_layers_own_bytes_into_kv_blocks_and_a_restore_puts_the_weights_back(tiny):
    e = morph_engine(tiny, "performance", blocks=8)
    arena, kv, bank = e.memory.arena, e.kv, morph(e).bank
    full = _ranges(e.model.layers[0])
    lo, hi = min(a for a, _ in full), max(b for _, b in full)
    region = bank.regions[0]
    assert arena.data_ptr(region.start) <= lo and hi <= arena.data_ptr(region.end)
    before = [t.clone() for t in weight_tensors(e.model.layers[0])]

    morph(e).apply_now(MorphDecision("quantize", (0,), "int4", "test"))
    extent = e.pool.extents[-1]
    assert extent.num_blocks == region.num_slots - bank.slots(0, "int4") > 0
    for logical in range(extent.start, extent.end):  # every new block sits where the full weights were
        k = kv.k[0][kv.physical_slot(logical)]
        v = kv.v[e.model_config.num_layers - 1][kv.physical_slot(logical)]
        for t in (k, v):
            assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi
    quant = _ranges(e.model.layers[0])  # the variant lives in the region's tail
    assert all(arena.data_ptr(bank.tail(0, "int4").start) <= a and b <= arena.data_ptr(region.end) for a, b in quant)

    held = e.pool.allocate(e.pool.num_free)  # write KV into the extent: real bytes over the old weights
    for logical in held:
        kv.k[0][kv.physical_slot(logical)].fill_(7.0)
    e.pool.free(held)
    morph(e).apply_now(MorphDecision("restore", (0,), None, "test"))
    assert e.model.layers[0].precision == FULL
    assert _ranges(e.model.layers[0]) == full  # back at the very same addresses
    for old, new in zip(before, weight_tensors(e.model.layers[0])):
        assert old.equal(new)  # and the bytes are the full weights again, not the KV written meanwhile
    assert_memory_exact(e)


def test_resident_memory_stays_flat_while_swaps_grow_the_kv_cache(tiny):
    """KV written into swap extents costs no new memory: with three layers quantized and the grown pool full of
    KV, resident memory is within a small constant of what it was before the swaps (measured and printed).
    KV allocated outside the arena would show as growth of about the KV gained (23 MiB here)."""
    big = make_tiny_model(seed=3, tokenizer=tiny.tokenizer, vocab_size=1024, hidden_size=512, intermediate_size=1024,
                          num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64)
    clock = FakeClock()
    e = LLMEngine(EngineConfig(num_kv_blocks=16, block_size=16, max_num_batched_tokens=512, max_num_seqs=16,
                               morph_mode="performance", max_model_len=1024,
                               policy_overrides={"persist_iters": 1, "restore_persist_s": 1e9, "cost_aware": False}),
                  loaded=big, clock=clock)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = [(7 * j) % 1000 + 5 for j in range(250)]
    capacity0 = e.pool.num_blocks
    growth: list[int] = []
    for _ in range(3):  # the first round warms up (activations, allocator pools, the swap thread's malloc arena)
        rss0 = _rss_bytes()
        for layer in morph(e).controller.swap_order[:3]:
            morph(e).apply_now(MorphDecision("quantize", (layer,), "int4", "burst"))
        grown = e.pool.num_blocks
        fill = (grown * 16) // 260  # requests that together write KV into (nearly) every block of the grown pool
        outs = e.generate([prompt] * fill, params)
        assert all(len(o["token_ids"]) == 4 for o in outs)
        growth.append(_rss_bytes() - rss0)  # at the peak: swapped layers, grown pool written
        for layer in reversed(morph(e).controller.swap_order[:3]):
            morph(e).apply_now(MorphDecision("restore", (layer,), None, "burst"))
        assert e.pool.num_blocks == capacity0
    kv_gained = (grown - capacity0) * e.bytes_per_block
    print(f"\nRSS growth at the peak of each burst: {[round(g / 2**20, 1) for g in growth]} MiB while the KV cache "
          f"grew by {kv_gained / 2**20:.1f} MiB (arena {e.memory.arena.nbytes / 2**20:.1f} MiB)")
    assert kv_gained > 12 * 2**20
    assert max(growth[1:]) < 8 * 2**20, f"resident memory grew {[g / 2**20 for g in growth]} MiB"


@pytest.mark.parametrize("mode", ["performance", "accuracy"])
def test_bfloat16_engine_morphs_with_exact_accounting_and_returns_to_full(tiny, mode):
    """The whole engine in the GPU's dtype, on CPU: swaps under load, restores when calm, exact accounting."""
    clock = FakeClock()
    # the tiny model has 2 layers: let accuracy (25 % of layers by default) quantize one of them
    e = morph_engine(tiny, mode, blocks=16, clock=clock, dtype="bfloat16", restore_persist_s=1.0,
                     max_quantized_fraction=0.5)
    assert str(e.model.embedding.weight.dtype) == "torch.bfloat16" and e.model.embedding.layout is None
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for i in range(6):
        e.add_request([(11 * i + j) % 4000 + 10 for j in range(24)], params)
    produced = 0
    while e.has_unfinished_requests():
        produced += len(e.step())
        clock.t += 0.05
        assert_memory_exact(e)
        assert_exact_accounting(e)
    assert morph(e).stats.swaps >= 1
    drain_and_settle(e, clock, max_steps=1000)
    assert all(layer.precision == FULL for layer in e.model.layers)
    assert e.pool.num_blocks == e.pool.base_blocks
    assert_memory_exact(e)


def test_bfloat16_swap_mid_decode_keeps_state(tiny):
    """State preservation in bf16: quantizing mid-decode gives the tokens of a mode-off bf16 engine that swaps the
    same layers in place at the same step; no recomputation."""
    def run(swap_step):
        return decode_with_swap_at(lambda: morph_engine(tiny, "performance", blocks=64, dtype="bfloat16", kv_high=1.0,
                                                        queue_delay_high_s=1e9, restore_persist_s=1e9), swap_step)
    assert_swap_mid_decode_keeps_state(run, lambda: morph_engine(tiny, "off", blocks=64, dtype="bfloat16"), tiny)


def test_a_request_that_fits_only_after_quantizing_is_served_without_preemption(tiny):
    clock = FakeClock()
    # layer swaps alone (kv_rung null): the default mode's int8 KV rung would cover this pressure without a swap
    e = morph_engine(tiny, "default", blocks=20, clock=clock, kv_rung=None)
    gain = morph(e).blocks_per_layer_extent["int4"]
    assert e.reachable_blocks == 20 + morph(e).controller.max_quantized_layers * gain
    small = [e.add_request([50 + j for j in range(6)], SamplingParams(max_tokens=30, ignore_eos=True))]
    big_prompt = [(13 * j) % 4000 + 10 for j in range(4 * 20 + 40)]  # needs more blocks than the base pool
    big = e.add_request(big_prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    finished: dict[str, int] = {}
    steps = 0
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                finished[out.request_id] = out.num_output_tokens
        clock.t += 0.05
        assert_memory_exact(e)
        steps += 1
        assert steps < 500
    assert finished[big] == 8 and finished[small[0]] == 30
    assert e.scheduler.num_preemptions == 0
    assert morph(e).stats.swaps >= 1


def test_a_request_no_configuration_of_the_mode_can_hold_is_refused_with_the_reason(tiny):
    long_ctx = make_tiny_model(tokenizer=tiny.tokenizer, max_position_embeddings=2048)
    e = LLMEngine(EngineConfig(num_kv_blocks=20, block_size=4, morph_mode="default", max_model_len=2048),
                  loaded=long_ctx, clock=FakeClock())
    too_big = e.reachable_blocks * 4 + 4 - 8  # prompt + 8 new tokens = one block more than the mode can reach
    with pytest.raises(ValueError,
                       match=r"can never hold more than \d+ in morph mode 'default' \(20 base \+ 1 layers at int4"):
        e.add_request(list(range(10, 10 + too_big)), SamplingParams(max_tokens=8, ignore_eos=True))
    assert not e.has_unfinished_requests()


@pytest.mark.parametrize("scheduler", ["fcfs", "slai"])
@pytest.mark.parametrize("mode, expect_preemption", [("performance", False), ("off", True)])
def test_running_requests_short_of_blocks_get_a_quantize_step_instead_of_preemption(tiny, mode, expect_preemption,
                                                                                  scheduler):
    """Decodes outgrow the base pool. With morphing, the runtime quantizes the shortfall the scheduler meets (in
    its own order: FCFS's or SLAI's) before it would preempt (the controller's own pressure rule is held back
    here, so only quantize-before-preempt acts); blocks and memory stay exact after every step."""
    clock = FakeClock()
    e = morph_engine(tiny, mode, blocks=20, clock=clock, scheduler=scheduler, kv_high=1.0, queue_delay_high_s=1e9,
                     persist_iters=10_000)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ids = [e.add_request([(7 * i + j) % 4000 + 10 for j in range(8)], params) for i in range(4)]
    done: dict[str, int] = {}
    steps = 0
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.num_output_tokens
        clock.t += 0.01
        assert_exact_accounting(e)
        if e.resource_manager(MorphRuntime) is not None:
            assert_memory_exact(e)
        steps += 1
        assert steps < 2000
    assert all(done[i] == 40 for i in ids)
    assert (e.scheduler.num_preemptions > 0) is expect_preemption
    if not expect_preemption:
        assert morph(e).stats.swaps >= 1
        assert any("quantize before preempt" in ev.get("reason", "") for ev in morph(e).events)


def test_an_engine_whose_iterations_keep_failing_reports_unhealthy_and_refuses_work(tiny):
    """A broken device or layer makes every step fail: after 3 in a row the engine says so and refuses new
    requests with the reason, instead of accepting work it will fail."""
    e = morph_engine(tiny, "off")
    e.start_background()
    try:
        def broken(chunks):
            raise RuntimeError("device fell off the bus")
        e.executor.execute = broken
        errors = []
        for _ in range(3):
            done = []
            e.add_request([5, 6, 7], SamplingParams(max_tokens=2), callback=lambda o: done.append(o) if o.finished
                          else None)
            for _ in range(500):
                if done:
                    break
                import time
                time.sleep(0.01)
            errors.append(done[0].error)
        assert all("device fell off the bus" in err for err in errors)
        assert not e.healthy and e.stats().healthy is False
        with pytest.raises(RuntimeError, match="refuses new requests"):
            e.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    finally:
        e.shutdown()


# ---- fault injection: a weight copy that fails half-way ---------------------------------------------

def _failing_copies(bank, monkeypatch, failures: int) -> None:
    """Make the next ``failures`` asynchronous copies write half of their layer's tensors and then raise."""
    from concurrent.futures import Future

    from serve.morph import layer_bank

    left = [failures]
    real = bank.copy_async

    def copy_async(src, dest):
        if left[0] <= 0:
            return real(src, dest)
        left[0] -= 1
        alloc, placed = bank.arena.allocator(dest), [0]

        def place_then_fail(t):
            placed[0] += 1
            if placed[0] > 2:
                raise RuntimeError("injected: copy failed half-way")
            return alloc.place(t)

        future: Future = Future()
        try:
            layer_bank.remap(src, place_then_fail)
        except RuntimeError as exc:
            future.set_exception(exc)
        return layer_bank.CopyJob(None, future=future)

    monkeypatch.setattr(bank, "copy_async", copy_async)


def test_a_quantize_whose_copy_fails_half_way_leaves_the_layer_and_the_pool_as_they_were(tiny, monkeypatch):
    reference = morph_engine(tiny, "off").generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    e = morph_engine(tiny, "performance", blocks=8)
    blocks = e.pool.num_blocks
    _failing_copies(morph(e).bank, monkeypatch, failures=1)
    morph(e).start(MorphDecision("quantize", (0, 1), "int4", "test"))  # as at an iteration boundary
    morph(e).complete_ready(wait=True)  # the copy for layer 0 fails
    assert [layer.precision for layer in e.model.layers[:2]] == [FULL, FULL]  # the rest of the decision dropped
    assert e.pool.num_blocks == blocks and morph(e).stack == [] and morph(e).stats.failed_copies == 1
    assert_memory_exact(e)
    out = e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out["token_ids"] == reference["token_ids"]  # staging's partial bytes were never served
    morph(e).apply_now(MorphDecision("quantize", (0,), "int4", "test"))  # the next attempt works
    assert e.model.layers[0].precision == "int4" and e.pool.num_blocks > blocks
    assert_memory_exact(e)


def test_a_restore_whose_copy_fails_half_way_is_copied_again_and_serves_full_weights(tiny, monkeypatch):
    reference = morph_engine(tiny, "off").generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    e = morph_engine(tiny, "performance", blocks=8)
    full = [t.clone() for t in weight_tensors(e.model.layers[0])]
    morph(e).apply_now(MorphDecision("quantize", (0,), "int4", "test"))
    _failing_copies(morph(e).bank, monkeypatch, failures=1)
    morph(e).apply_now(MorphDecision("restore", (0,), None, "test"))
    assert e.model.layers[0].precision == FULL and morph(e).stats.failed_copies == 1
    assert all(a.equal(b) for a, b in zip(full, weight_tensors(e.model.layers[0])))
    assert _ranges(e.model.layers[0]) != [] and e.pool.num_blocks == e.pool.base_blocks
    assert_memory_exact(e)
    out = e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out["token_ids"] == reference["token_ids"]
