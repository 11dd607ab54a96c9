"""Runtime layer swapping + KV resizing on a tiny random Llama: exact accounting, state preservation."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy import FULL, MorphDecision
from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.kv_rung import KVPrecisionRung
from serve.engine.sampling_params import SamplingParams
from serve.model.kv_cache import Q8_BLOCK
from serve.morph.latency_window import percentile
from serve.morph.runtime import MorphRuntime
from tests.memory.test_kv_accounting import assert_exact_accounting
from tests.morph_support import decode_with_direct_swap_at, morph


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def morph_engine(tiny, mode="performance", blocks=20, clock=None, dtype=None, scheduler="fcfs", kv_cache_dtype="auto",
                 **overrides) -> LLMEngine:
    # cost_aware off: these tests are about the swap machinery, which must not depend on this machine's kernel speed
    policy = {"persist_iters": 1, "restore_persist_s": 5.0, "cost_aware": False, **overrides}
    if mode.startswith("static") or mode == "off":
        policy = {}
    return LLMEngine(EngineConfig(num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=32, max_num_seqs=16,
                                  morph_mode=mode, policy_overrides=policy, max_model_len=256, dtype=dtype,
                                  scheduler=scheduler, kv_cache_dtype=kv_cache_dtype),
                     loaded=tiny, clock=clock or FakeClock())


def assert_memory_exact(engine: LLMEngine) -> None:
    """The arena is exactly partitioned (layer weights + staging + KV blocks), every installed layer's weights
    lie where the layout says, and every KV extent is the slots its transition freed, inside that layer's
    region, right in front of the variant that replaced the milder one."""
    led, m, kv, arena = engine.ledger, morph(engine), engine.kv, engine.memory.arena
    led.check()
    assert led.used_slots == led.arena_slots
    rung = engine.resource_manager(KVPrecisionRung)
    if rung is not None:
        assert_kv_rung_exact(engine, rung)
    net = 0 if rung is None else rung.kv_blocks_8bit - rung.slots_converted  # the rung's 8-bit blocks, in KV slots
    assert led.kv_blocks == engine.pool.num_blocks - net
    bank = m.bank
    restoring = {p.layer for p in m.pending if p.kind == "restore"}
    for i, layer in enumerate(engine.model.layers):
        where = bank.staging if i in restoring else bank.tail(i, layer.precision)
        lo, hi = arena.data_ptr(where.start), arena.data_ptr(where.end)
        assert all(lo <= a and b <= hi for a, b in bank.resident_ranges(i)), f"layer {i} outside {where}"
        if i not in restoring:
            assert led.layer_slots[i] == bank.slots(i, layer.precision)
    extents = [c for c in engine.pool.extents[1:] if not c.quantized]
    with_extents = [t for t in m.stack if t.owner]
    assert sum(c.num_blocks for c in extents) == sum(t.blocks for t in m.stack if not t.yielded)
    assert led.yielded_slots == sum(t.blocks for t in m.stack if t.yielded)  # given back: in no extent
    assert [c.owner for c in extents] == [t.owner for t in with_extents]
    for c, t in zip(extents, with_extents):
        assert kv.block_map[c.start:c.end].tolist() == list(range(t.slots.start, t.slots.end))
        region = bank.regions[t.layer]
        assert region.start <= t.slots.start and t.slots.end <= region.end
        assert t.blocks == bank.slots(t.layer, t.from_precision) - bank.slots(t.layer, t.to_precision)


def assert_kv_rung_exact(engine: LLMEngine, rung: KVPrecisionRung) -> None:
    """The KV rung's conversions: each one's retired blocks are out of service full-precision blocks (the base pool's
    or a layer extent's), its extent is in the pool
    (in order) and maps to exactly its 8-bit blocks, every 8-bit block lies wholly inside its retired slots' bytes,
    and no two conversions share a byte."""
    pool, kv = engine.pool, engine.kv
    ours = [c for c in pool.extents if c.quantized]
    assert [c.owner for c in ours] == [conv.owner for conv in rung.conversions]
    assert pool.num_retired == rung.slots_converted
    slot, block8 = kv.full.layout.block_bytes, kv.q8.layout.block_bytes
    taken: set[int] = set()
    for c, conv in zip(ours, rung.conversions):
        assert not any(pool.is_quantized(i) for i in conv.retired)
        assert kv.block_map[c.start:c.end].tolist() == conv.blocks_8bit
        assert bool((kv.block_format[c.start:c.end] == Q8_BLOCK).all())
        spans = {kv.physical_slot(i) for i in conv.retired}
        for p in conv.blocks_8bit:
            first, last = p * block8 // slot, ((p + 1) * block8 - 1) // slot
            assert all(s in spans for s in range(first, last + 1)), f"8-bit block {p} outside its slots"
        assert not taken & set(conv.blocks_8bit)
        taken |= set(conv.blocks_8bit)


def decode_with_swap_at(make_engine, swap_step: int | None, precision: str = "int4",
                        prompt: list[int] | None = None, max_tokens: int = 16) -> tuple[list[int], LLMEngine, int]:
    """One request on a fresh engine; quantize layers (1, 0) to ``precision`` at iteration ``swap_step``
    (mid-decode), or never. Returns the streamed tokens, the engine and how many tokens came before the swap."""
    e = make_engine()
    tokens: list[int] = []
    e.add_request(prompt or SWAP_PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  callback=lambda o: tokens.extend(o.new_token_ids))
    step, before = 0, max_tokens
    while e.has_unfinished_requests():
        if step == swap_step:
            before = len(tokens)
            morph(e).apply_now(MorphDecision("quantize", SWAP_LAYERS, precision, "test"))
        e.step()
        step += 1
    return tokens, e, before


SWAP_PROMPT = list(range(300, 340))
SWAP_LAYERS = (1, 0)


def assert_swap_mid_decode_keeps_state(run, reference, loaded, precision: str = "int4",
                                       prompt: list[int] | None = None, max_tokens: int = 16,
                                       swap_step: int = 5) -> None:
    """``run(swap_step)`` -> (tokens, engine, tokens before the swap) on a morphing engine; ``reference()`` -> a
    mode-off engine on the same weights, dtype and device. The morphing engine's tokens after quantizing layers
    mid-decode must equal the reference's, which swaps the same layers to the same variants in place at the same
    step without moving any memory (tests/morph_support.decode_with_direct_swap_at); and the swap recomputes
    nothing (no preemption) and really changes the output (the quantized layers ran)."""
    plain, _, _ = run(None)
    swapped, engine, before = run(swap_step)
    assert 0 < before < len(plain)  # the swap really happened mid-decode
    expected = decode_with_direct_swap_at(reference(), loaded, swap_step, SWAP_LAYERS, precision,
                                          prompt or SWAP_PROMPT, max_tokens)
    assert swapped == expected, f"tokens after the swap differ from the reference: {swapped} vs {expected}"
    assert swapped != plain, "the quantized layers must change the output, or the comparison proves nothing"
    assert engine.scheduler.num_preemptions == 0


def drain_and_settle(engine: LLMEngine, clock: FakeClock, max_steps: int = 5000) -> None:
    """Step until no request is left and every layer is back at full precision. Swap copies are
    asynchronous and the fake clock does not wait for them, so each iteration first lets the copy in flight
    land (as a real iteration's forward time would)."""
    steps = 0
    while engine.has_unfinished_requests() or not all(m.is_at_rest() for m in engine.resources):
        if morph(engine).pending:
            morph(engine).pending[0].job.result()
        engine.step()
        clock.t += 0.5
        assert_memory_exact(engine)
        assert_exact_accounting(engine)
        steps += 1
        assert steps < max_steps, "engine did not return to full precision"


def test_static_modes_quantize_every_layer_up_front(tiny):
    for mode, precision in (("static-int8", "int8"), ("static-int4", "int4")):
        e = morph_engine(tiny, mode)
        assert [layer.precision for layer in e.model.layers] == [precision] * tiny.config.num_layers
        assert e.pool.num_blocks > e.pool.base_blocks
        assert_memory_exact(e)
        out = e.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert len(out["token_ids"]) == 4


def test_off_mode_has_no_layer_bank(tiny):
    e = morph_engine(tiny, "off")
    assert e.resource_manager(MorphRuntime) is None
    assert e.stats().layers_quantized == {} and e.stats().swaps_total == 0


def test_pressure_quantizes_then_calm_restores_to_base(tiny):
    clock = FakeClock()
    e = morph_engine(tiny, "performance", clock=clock)
    base = e.pool.num_blocks
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(8):
        e.add_request([(17 * i + j) % 4000 + 10 for j in range(30)], params)
    max_total = base
    while e.has_unfinished_requests():
        e.step()
        clock.t += 0.05
        max_total = max(max_total, e.pool.num_blocks)
        assert_memory_exact(e)
        assert_exact_accounting(e)
    assert morph(e).stats.swaps >= 1 and max_total > base
    events = {ev["event"] for ev in morph(e).events}
    assert "swap" in events
    drain_and_settle(e, clock)
    assert e.pool.num_blocks == base
    assert all(layer.precision == FULL for layer in e.model.layers)
    assert morph(e).stats.restores == morph(e).stats.swaps
    assert "kv_shrink" in {ev["event"] for ev in morph(e).events}


def _run_with_swap_at(tiny, swap_step: int | None, layers=(1, 0), precision="int4"):
    """One request; optionally quantize `layers` at iteration `swap_step` (mid-decode)."""
    e = morph_engine(tiny, "performance", blocks=64, kv_high=1.0, queue_delay_high_s=1e9, restore_persist_s=1e9)
    tokens, computed = [], []
    prompt = list(range(300, 340))
    e.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True),
                  callback=lambda o: tokens.extend(o.new_token_ids))
    step = 0
    while e.has_unfinished_requests():
        if step == swap_step:
            seq = e.scheduler.running[0]
            kv_before = list(seq.block_ids)
            morph(e).apply_now(MorphDecision("quantize", layers, precision, "test"))
            assert seq.block_ids == kv_before, "a swap must not touch a sequence's KV blocks"
        sched = e.scheduler.schedule()
        computed.append(sched.num_tokens)
        logits, sampled = e.executor.execute(sched.chunks)
        e.scheduler.on_executed(sched)
        e._deliver(e._emit(e.appender.append(sampled, logits)))
        step += 1
    return tokens, computed, e


def test_swap_mid_decode_equals_an_independent_reference_and_recomputes_nothing(tiny):
    """Quantizing layers (1, 0) at iteration 6 of a decode: the tokens after it equal a mode-off engine's that swaps
    the same layers in place at the same step (its KV never moved), and no prompt token is computed again."""
    plain, plain_computed, _ = _run_with_swap_at(tiny, None)
    swapped, computed, engine = _run_with_swap_at(tiny, 6)
    reference = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=16,
                                       morph_mode="off", max_model_len=256), loaded=tiny, clock=FakeClock())
    expected = decode_with_direct_swap_at(reference, tiny, 6, (1, 0), "int4", list(range(300, 340)), 24)
    assert swapped == expected                    # the KV cached before the swap survived it, bit for bit
    assert swapped != plain                       # the quantized layers really ran afterwards
    assert sum(computed) == sum(plain_computed) == 40 + 24 - 1   # no recomputation of the prompt
    assert engine.scheduler.num_preemptions == 0
    assert [engine.model.layers[i].precision for i in (0, 1)] == ["int4", "int4"]


def test_restore_waits_for_its_extent_to_be_free(tiny):
    clock = FakeClock()
    e = morph_engine(tiny, "performance", blocks=8, clock=clock, restore_persist_s=0.0)
    morph(e).apply_now(MorphDecision("quantize", (0,), "int4", "test"))
    top = morph(e).stack[-1]
    held = e.pool.allocate(e.pool.num_free)            # occupy every block, including the extent's
    morph(e).start(MorphDecision("restore", (0,), None, "test"))
    assert e.model.layers[0].precision == "int4" and morph(e).stack[-1] is top
    assert morph(e).events[-1]["event"] == "restore_skipped"
    e.pool.free(held)
    morph(e).start(MorphDecision("restore", (0,), None, "test"))
    morph(e).complete_ready(wait=True)
    assert e.model.layers[0].precision == FULL and e.pool.num_blocks == e.pool.base_blocks
    assert_memory_exact(e)


def test_ladder_int8_then_int4_and_back_in_reverse(tiny):
    e = morph_engine(tiny, "accuracy", blocks=8)
    m = morph(e)
    for layer, prec in ((0, "int8"), (1, "int8"), (0, "int4")):
        m.apply_now(MorphDecision("quantize", (layer,), prec, "test"))
        assert_memory_exact(e)
    assert m.quantized_layers() == ((1, "int8"), (0, "int4"))
    for layer, prec in ((0, "int8"), (1, None), (0, None)):
        m.apply_now(MorphDecision("restore", (layer,), prec, "test"))
        assert_memory_exact(e)
    assert m.is_at_rest() and e.pool.num_blocks == e.pool.base_blocks


def test_budget_too_small_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match="no room for the KV cache"):
        LLMEngine(EngineConfig(device_memory="1MiB", morph_mode="default"), loaded=tiny)
    with pytest.raises(ValueError, match="morph_mode"):
        EngineConfig(morph_mode="turbo")


request = st.tuples(st.integers(4, 40), st.integers(1, 16), st.integers(0, 30), st.sampled_from([None, 2, 5, 11]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request, min_size=1, max_size=12), mode=st.sampled_from(["default", "performance", "accuracy"]),
       blocks=st.integers(16, 40), seed=st.integers(0, 1000), scheduler=st.sampled_from(["fcfs", "slai"]))
def test_random_load_keeps_memory_and_kv_exact_and_returns_to_base(tiny, reqs, mode, blocks, seed, scheduler):
    clock = FakeClock()
    e = morph_engine(tiny, mode, blocks=blocks, clock=clock, scheduler=scheduler, persist_iters=1 + seed % 3,
                     restore_persist_s=float(seed % 4))
    run_random_load_to_base(e, clock, reqs, seed)


def run_random_load_to_base(e: LLMEngine, clock: FakeClock, reqs, seed: int, shared_prefix: int = 0,
                            before_step: Callable[[int], object] | None = None) -> None:
    """Requests ``(prompt tokens, max_tokens, arrival step, abort after)`` arrive, run and are aborted; after every step
    the arena, the ledger and every block's holders are exact; then the engine drains back to full precision with
    every block free. ``shared_prefix``: every other prompt starts with the same tokens (prefix hits).
    ``before_step(step)``: called before each step (a test's own intervention, checked like the engine's)."""
    base = e.pool.num_blocks
    plan = sorted((arrive, i) for i, (_, _, arrive, _) in enumerate(reqs))
    rids: dict[int, str] = {}
    step = 0
    while plan or e.has_unfinished_requests():
        while plan and plan[0][0] <= step:
            _, i = plan.pop(0)
            n, max_tokens, _, _ = reqs[i]
            prefix = [(seed + j) % 4000 + 10 for j in range(shared_prefix)] if i % 2 else []
            rids[i] = e.add_request(prefix + [(seed + 13 * i + j) % 4000 + 10 for j in range(n)],
                                    SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for i, (_, _, arrive, abort_after) in enumerate(reqs):
            if abort_after is not None and i in rids and step == arrive + abort_after:
                e.abort_request(rids[i])
        if before_step is not None:
            before_step(step)
            assert_memory_exact(e)
            assert_exact_accounting(e)
        e.step()
        clock.t += 0.05
        assert_memory_exact(e)
        assert_exact_accounting(e)
        step += 1
        assert step < 5000
    drain_and_settle(e, clock)
    assert e.pool.num_blocks == base and e.pool.num_used == 0
    assert all(layer.precision == FULL for layer in e.model.layers)


def test_a_multi_layer_decision_stages_one_copy_at_a_time(tiny):
    e = morph_engine(tiny, "performance", blocks=8)
    m = morph(e)
    m.start(MorphDecision("quantize", (1, 0), "int4", "test"))
    assert len(m.pending) == 1 and list(m.queued) == [("quantize", 0, "int4", "test")]
    assert e.ledger.staging_slots == max(m.bank.slots(i, p) for i in (0, 1) for p in m.bank.precisions)
    assert m.bank.slots(1, "int4") <= e.ledger.staging_slots      # one variant fits the staging range
    assert m.quantized_layers() == ((1, "int4"), (0, "int4"))      # accepted swaps are visible to the policy
    m.complete_ready(wait=True)
    assert not m.pending and not m.queued
    assert [t.layer for t in m.stack] == [1, 0]
    assert_memory_exact(e)


@given(st.lists(st.floats(min_value=0, max_value=1e3, allow_nan=False), min_size=1, max_size=300),
       st.sampled_from([0, 50, 95, 99, 100]))
def test_runtime_percentile_is_numpys_linear_percentile(values: list[float], pct: float) -> None:
    """The TTFT / TBT window percentiles the controller sees are numpy's default ones, without numpy's cost."""
    assert percentile(values, pct) == pytest.approx(float(np.percentile(values, pct)), rel=1e-12, abs=1e-12)
