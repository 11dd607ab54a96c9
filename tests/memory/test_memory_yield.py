"""Yield and reclaim: the pure rule, the runtime with real memory, and the VMM segment arithmetic.

The engine tests use a fake pressure source (a number the test sets) and real components otherwise: the
arena's pages really go back to the kernel (the process's VmRSS falls), the ledger stays exact, and running
requests' tokens are compared with engines that never yielded.
"""

from __future__ import annotations

import pytest

from policy import MorphController, MorphDecision, PolicyConfig, Telemetry
from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.memory.cuda_vmm import VmmBuffer
from serve.memory.host_pages import PAGE, resident_bytes
from serve.memory.pressure import FreeMemory, PressureSource, cgroup_room, host_free, meminfo_available
from tests.morph_support import morph

MiB = 2**20
RSS_NOISE = 1 * MiB
"""What the process may allocate or free between two RSS readings besides the arena (Python objects, the C heap);
seen ~40 KB once in a run. Small against the >= 40 MiB the checks are about."""
EXTENT = {"int8": 50, "int4": 75}
BLOCK = MiB  # bytes per block in the pure tests: a layer at int8 frees 50 MiB, at int4 75 MiB


def telemetry(now: float, *, free: int | None, quantized=(), top_yielded=False, yielded=0, request=None,
              extent_free=True, total=1000, used=100) -> Telemetry:
    return Telemetry(now_s=now, kv_blocks_total=total, kv_blocks_used=used, num_layers=8,
                     quantized_layers=tuple(quantized), pending_restore_extent_free=extent_free,
                     blocks_per_layer_extent=EXTENT, memory_free_bytes=free, memory_source="test",
                     yielded_bytes=yielded, top_is_yielded=top_yielded, yield_request_bytes=request, block_bytes=BLOCK)


def controller(**kw) -> MorphController:
    # ladder int8, int4
    policy = PolicyConfig.for_mode("accuracy", cost_aware=False, memory_floor_bytes=1000 * MiB, **kw)
    return MorphController(policy, (5, 2, 7, 0, 3, 6, 1, 4))


# ---- the pure rule --------------------------------------------------------------------------------------------

def test_yield_sizes_the_step_to_the_shortfall_in_swap_order() -> None:
    c = controller()
    d = c.decide(telemetry(1.0, free=880 * MiB))  # 120 MiB short, 50 MiB per layer at int8 -> 3 layers
    assert (d.action, d.layers, d.precision) == ("yield", (5, 2, 7), "int8")
    assert "test free 880.0 MiB < floor 1000.0 MiB" in d.reason
    # above the floor nothing is yielded and the KV rules decide as before
    assert c.decide(telemetry(2.0, free=2000 * MiB)).action == "none"


def test_yield_takes_a_free_kv_extent_on_top_first_and_then_moves_layers_down_the_ladder() -> None:
    c = controller()
    d = c.decide(telemetry(1.0, free=990 * MiB, quantized=[(5, "int8")]))
    assert (d.action, d.layers, d.precision) == ("yield", (5,), None)
    every = [(layer, "int8") for layer in (5, 2, 7, 0, 3, 6, 1, 4)]
    d = c.decide(telemetry(2.0, free=900 * MiB, quantized=every, top_yielded=True))
    assert (d.action, d.layers, d.precision) == ("yield", (5, 2, 7, 0), "int4")  # 100 MiB at 25 MiB per layer
    last = [(layer, "int4") for layer in (5, 2, 7, 0, 3, 6, 1, 4)]
    d = c.decide(telemetry(3.0, free=900 * MiB, quantized=last, top_yielded=True))
    assert d.action == "none" and "nothing left to give back" in d.reason


def test_reclaim_waits_for_room_after_the_take_back_and_for_the_calm_period() -> None:
    c = controller(memory_reclaim_bytes=1100 * MiB, memory_reclaim_calm_s=5.0)
    q = [(5, "int8"), (2, "int8")]
    d = c.decide(telemetry(1.0, free=1120 * MiB, quantized=q, top_yielded=True, yielded=100 * MiB))
    assert d.action == "none" and "reclaim mark" in d.reason  # 1120 - 50 < 1100
    d = c.decide(telemetry(2.0, free=1200 * MiB, quantized=q, top_yielded=True, yielded=100 * MiB))
    assert d.action == "none" and "possible for 0.00 s" in d.reason
    d = c.decide(telemetry(7.5, free=1200 * MiB, quantized=q, top_yielded=True, yielded=100 * MiB))
    assert (d.action, d.layers, d.precision) == ("reclaim", (2,), None)  # LIFO: the newest first


def test_kv_restore_never_undoes_a_yielded_transition() -> None:
    """Calm KV (restore_persist_s 0) would restore the top layer at once; it gave its bytes back, so only the
    reclaim rule may undo it, and the outside memory does not allow that yet."""
    c = MorphController(PolicyConfig.for_mode("default", cost_aware=False, restore_persist_s=0.0,
                                              memory_floor_bytes=1000 * MiB, memory_reclaim_bytes=1100 * MiB),
                        (5, 2, 7, 0, 3, 6, 1, 4))
    for now in (1.0, 2.0, 3.0):
        d = c.decide(telemetry(now, free=1120 * MiB, quantized=[(5, "int4")], top_yielded=True, yielded=75 * MiB))
        assert d.action == "none" and "reclaim mark" in d.reason
    d = c.decide(telemetry(4.0, free=1120 * MiB, quantized=[(5, "int4")]))  # the same layer, quantized for KV
    assert (d.action, d.layers) == ("restore", (5,))


def test_an_operator_request_yields_and_holds_until_cleared() -> None:
    policy = PolicyConfig.for_mode("default", cost_aware=False)  # ladder int4, no floor
    c = MorphController(policy, (5, 2, 7, 0, 3, 6, 1, 4))
    d = c.decide(telemetry(1.0, free=None, request=100 * MiB))
    assert (d.action, d.layers, d.precision) == ("yield", (5, 2), "int4")
    held = telemetry(2.0, free=None, quantized=[(5, "int4"), (2, "int4")], top_yielded=True, yielded=150 * MiB,
                     request=100 * MiB)
    assert c.decide(held).action == "none"  # 150 - 75 < 100: the request holds layer 2
    released = telemetry(3.0, free=None, quantized=[(5, "int4"), (2, "int4")], top_yielded=True, yielded=150 * MiB)
    assert c.decide(released).action == "reclaim"


def test_modes_that_cannot_yield_refuse_a_floor() -> None:
    with pytest.raises(ValueError, match="needs a dynamic morph mode"):
        EngineConfig(morph_mode="off", memory_floor="1GiB")
    with pytest.raises(ValueError, match="memory_reclaim_bytes"):
        EngineConfig(morph_mode="default", memory_floor="2GiB", memory_reclaim_mark="1GiB")
    with pytest.raises(ValueError, match="memory_pressure_source"):
        EngineConfig(morph_mode="default", memory_pressure_source="psi")


def test_host_readings_are_real_numbers() -> None:
    avail = meminfo_available()
    assert avail is not None and 0 < avail
    free = host_free()
    assert free is not None and free.free_bytes <= avail and free.source in ("cgroup", "meminfo")
    room = cgroup_room()
    assert room is None or room >= 0


# ---- the engine: real pages, exact ledger, running requests --------------------------------------------------

class Outside:
    """The fake pressure source: free memory outside the engine is what the test says plus what the engine
    has given back (as NVML or MemAvailable would show it)."""

    def __init__(self, free: int) -> None:
        self.free = free

    def attach(self, engine: LLMEngine) -> None:
        led = engine.ledger
        morph(engine).pressure = PressureSource(lambda: FreeMemory(self.free + led.yielded_slots * led.slot_bytes,
                                                                  "test"), interval_s=0.0)


def engine_with_floor(loaded, floor: str | None, **policy) -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=48, block_size=16, max_num_seqs=4, max_model_len=512,
                                  morph_mode="default", memory_floor=floor, memory_pressure_source="none",
                                  policy_overrides={"cost_aware": False, "memory_reclaim_calm_s": 0.0, **policy}),
                     loaded=loaded)


def start(engine: LLMEngine, n: int = 3) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        engine.add_request(list(range(400 + 7 * i, 440 + 7 * i)), SamplingParams(max_tokens=24, ignore_eos=True),
                           callback=lambda o, i=i: outs[i].extend(o.new_token_ids))
    return outs


def boundary(engine: LLMEngine) -> MorphDecision | None:
    d = morph(engine).before_schedule(engine.scheduler)
    morph(engine).complete_ready(wait=True)
    return d


def test_yield_gives_pages_back_and_reclaim_takes_them_again_with_tokens_unchanged(smollm) -> None:
    reference = engine_with_floor(smollm, None)
    want = start(reference)
    while reference.has_unfinished_requests():
        reference.step()

    outside = Outside(10 * 2**30)
    e = engine_with_floor(smollm, "1GiB")
    outside.attach(e)
    got = start(e)
    for _ in range(6):
        e.step()
    rss_before = resident_bytes()
    outside.free = 1024 * MiB - 40 * MiB  # a co-tenant took memory: 40 MiB short of the floor
    d = boundary(e)
    assert boundary(e).action == "none"  # the bytes given back cover the shortfall: no second step
    assert d is not None and d.action == "yield", d
    yielded = e.ledger.yielded_slots * e.ledger.slot_bytes
    rss_yielded = resident_bytes()
    assert yielded >= 40 * MiB
    segments = len([t for t in morph(e).stack if t.yielded])
    assert rss_before - rss_yielded >= yielded - 2 * PAGE * segments - RSS_NOISE, (rss_before, rss_yielded, yielded)
    stats = e.stats()
    assert stats.memory["yielded"] == yielded and stats.memory_yield["yields_total"] == len(d.layers)
    e.ledger.check()
    assert e.ledger.used_slots == e.ledger.arena_slots  # layers + staging + KV + yielded: exactly the arena

    outside.free = 10 * 2**30  # the co-tenant left
    while morph(e).stack:
        assert boundary(e).action == "reclaim"
    assert e.ledger.yielded_slots == 0
    assert resident_bytes() - rss_yielded >= yielded - 2 * PAGE * segments - RSS_NOISE
    assert all(layer.precision == "full" for layer in e.model.layers)
    while e.has_unfinished_requests():
        e.step()
    assert got == want  # the round trip touched no running request's KV or weights


def test_tokens_while_yielded_equal_an_engine_that_quantized_the_same_layers(tiny) -> None:
    """Yield changes where the freed bytes go, not what the model computes: decoding with layers yielded
    equals decoding with the same layers quantized for KV at the same step."""
    def run(yield_it: bool) -> tuple[list[list[int]], LLMEngine]:
        outside = Outside(10 * 2**30)
        # 64 blocks hold the 3 requests (16 each) below kv_high: no preemption or KV step in either engine
        e = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_model_len=256,
                                   morph_mode="default", memory_floor="1GiB" if yield_it else None,
                                   memory_pressure_source="none",
                                   policy_overrides={"cost_aware": False, "memory_reclaim_calm_s": 1e9}),
                      loaded=tiny)
        outside.attach(e)
        outs = start(e)
        layers: tuple[int, ...] = ()
        for step in range(200):
            if not e.has_unfinished_requests():
                break
            if step == 4:
                if yield_it:
                    outside.free = 2**30 - 4096
                    d = boundary(e)
                    assert d.action == "yield" and d.precision == "int4"
                    layers = d.layers
                else:
                    morph(e).apply_now(MorphDecision("quantize", (morph(e).controller.swap_order[0],), "int4", "test"))
                    layers = (morph(e).controller.swap_order[0],)
            e.step()
        assert layers == (morph(e).controller.swap_order[0],)
        assert e.scheduler.num_preemptions == 0 and morph(e).stats.swaps == (0 if yield_it else 1)
        return outs, e

    yielded, ey = run(True)
    quantized, eq = run(False)
    assert yielded == quantized
    assert ey.ledger.yielded_slots == eq.pool.num_blocks - eq.pool.base_blocks > 0
    assert ey.pool.num_blocks == ey.pool.base_blocks  # nothing went to the pool


def test_a_free_kv_extent_is_yielded_as_it_stands(tiny) -> None:
    outside = Outside(10 * 2**30)
    e = LLMEngine(EngineConfig(num_kv_blocks=40, block_size=4, max_num_seqs=4, max_model_len=256,
                               morph_mode="default", memory_floor="1GiB", memory_pressure_source="none",
                               policy_overrides={"cost_aware": False}), loaded=tiny)
    outside.attach(e)
    layer = morph(e).controller.swap_order[0]
    morph(e).apply_now(MorphDecision("quantize", (layer,), "int4", "test"))
    grown = e.pool.num_blocks
    assert grown > e.pool.base_blocks
    outside.free = 2**30 - 4096
    d = boundary(e)
    assert (d.action, d.layers, d.precision) == ("yield", (layer,), None)
    assert e.pool.num_blocks == e.pool.base_blocks
    assert e.ledger.yielded_slots == grown - e.pool.base_blocks
    assert morph(e).stack[-1].yielded and not morph(e).stack[-1].owner
    from tests.morph.test_morph import assert_memory_exact

    assert_memory_exact(e)


def test_operator_control_on_the_engine(tiny) -> None:
    e = LLMEngine(EngineConfig(num_kv_blocks=40, block_size=4, max_model_len=256, morph_mode="default",
                               policy_overrides={"cost_aware": False}), loaded=tiny)
    stats = e.request_memory_yield(1)
    assert stats["yield_request_bytes"] == 1
    assert boundary(e).action == "yield" and e.ledger.yielded_slots > 0
    e.request_memory_yield(None)
    assert boundary(e).action == "reclaim" and e.ledger.yielded_slots == 0
    with pytest.raises(ValueError, match=">= 0"):
        e.request_memory_yield(-5)
    off = LLMEngine(EngineConfig(num_kv_blocks=40, block_size=4, max_model_len=256), loaded=tiny)
    with pytest.raises(ValueError, match="cannot yield"):
        off.request_memory_yield(2**20)


# ---- CUDA VMM segments, with a recording driver ----------------------------------------------------------------

class RecordingDriver:
    def __init__(self) -> None:
        self.mapped: dict[int, int] = {}  # address -> size
        self.next_handle = 1
        self.freed = False

    def granularity(self) -> int:
        return 2 * MiB

    def reserve(self, size: int) -> int:
        self.reserved = size
        return 1 << 40

    def map_new(self, address: int, size: int) -> int:
        assert address not in self.mapped and address % (2 * MiB) == 0
        self.mapped[address] = size
        self.next_handle += 1
        return self.next_handle

    def unmap_release(self, address: int, size: int, handle: int) -> None:
        assert self.mapped.pop(address) == size

    def free_reservation(self, address: int, size: int) -> None:
        assert not self.mapped and size == self.reserved
        self.freed = True


def test_vmm_buffer_releases_only_whole_segments_inside_a_range_and_maps_them_back() -> None:
    drv = RecordingDriver()
    buf = VmmBuffer(drv, nbytes=100 * MiB + 5, segment_bytes=3 * MiB)  # rounded up to the 2 MiB granularity: 4 MiB
    assert buf.segment_bytes == 4 * MiB and buf.num_segments == 26 and buf.mapped_bytes == 104 * MiB
    given = buf.release(5 * MiB, 21 * MiB)  # segments 2, 3, 4 (8-20 MiB) lie wholly inside
    assert given == 12 * MiB and sorted(set(range(26)) - set(buf.handles)) == [2, 3, 4]
    assert buf.release(5 * MiB, 21 * MiB) == 0  # twice: nothing more
    assert buf.recommit(0, 104 * MiB) == 12 * MiB and buf.mapped_bytes == 104 * MiB
    assert len(drv.mapped) == 26
    buf.close()
    assert drv.freed


# ---- the controls' parsing -------------------------------------------------------------------------------------

def test_operator_memory_control_body() -> None:
    from serve.engine.controls import yield_request_bytes

    assert yield_request_bytes({"size": "2GiB"}) == 2 * 2**30 and yield_request_bytes({"bytes": 5}) == 5
    for bad in ({}, {"size": "2GiB", "bytes": 1}, {"bytes": -1}, {"bytes": True}, {"size": 5}):
        with pytest.raises(ValueError):
            yield_request_bytes(bad)


def test_yielded_bytes_under_newer_kv_transitions_come_back_as_kv(tiny) -> None:
    """Load went on after a yield, so KV steps stacked newer transitions on top. Reclaim does not wait for
    them to be restored: the buried transition's slots come back as its KV extent (the pool grows, nothing is
    yielded) and the transition moves to the top, where the restore rule undoes it first, LIFO as ever."""
    from tests.morph.test_morph import assert_memory_exact

    e = LLMEngine(EngineConfig(num_kv_blocks=40, block_size=4, max_model_len=256, morph_mode="default",
                               policy_overrides={"cost_aware": False}), loaded=tiny)
    first, second = morph(e).controller.swap_order[:2]
    e.request_memory_yield(1)
    assert boundary(e).layers == (first,)
    morph(e).apply_now(MorphDecision("quantize", (second,), "int4", "KV pressure"))
    assert_memory_exact(e)  # one yielded transition under a KV one
    grown = e.pool.num_blocks
    e.request_memory_yield(None)
    d = boundary(e)
    assert (d.action, d.layers) == ("reclaim", (first,)) and "as KV blocks" in d.reason
    extent = morph(e).stack[-1].blocks
    assert e.ledger.yielded_slots == 0 and e.pool.num_blocks == grown + extent
    assert [t.layer for t in morph(e).stack] == [second, first] and not any(t.yielded for t in morph(e).stack)
    assert_memory_exact(e)
    morph(e).apply_now(MorphDecision("restore", (first,), None, "calm"))
    morph(e).apply_now(MorphDecision("restore", (second,), None, "calm"))
    assert not morph(e).stack and e.pool.num_blocks == e.pool.base_blocks
    assert_memory_exact(e)
