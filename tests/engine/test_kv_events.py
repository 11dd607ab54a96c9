"""KV events for Dynamo's router (serve/dynamo/kv_events.py) against a real engine: randomized traffic with shared
prefixes, evictions, preemptions, morph transitions and cache resets. A fake publisher applies every batch the
way Dynamo 1.6.1's publisher and router do (reference counts per id, a store's parent must be known) and the
router's view must equal, after every step, exactly the blocks the pool serves under its current root."""

from __future__ import annotations

import hashlib
import random
from array import array

import pytest

from policy import MorphDecision
from serve.config import EngineConfig
from serve.dynamo.kv_events import KvEventBridge, block_id
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.morph.runtime import MorphRuntime
from tests.morph.test_morph import FakeClock
from tests.morph_support import morph

BS = 4


class RouterView:
    """What Dynamo's publisher + radix tree keep of one worker: ids with reference counts and their parents."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}
        self.batches = 0

    def publish_batch(self, events: list[dict]) -> None:
        self.batches += 1
        for ev in events:
            if ev["type"] == "stored":
                assert ev["num_block_tokens"] == [BS] and len(ev["token_ids"]) == BS
                parent = ev["parent_hash"]
                assert parent is None or self.refs.get(parent, 0) > 0, "a store whose parent the router lacks"
                (bid,) = ev["block_hashes"]
                assert -(1 << 63) <= bid < (1 << 63)
                assert self.refs.get(bid, 0) == 0, f"block {bid} stored twice"
                self.refs[bid] = 1
                self.tokens[bid] = ev["token_ids"]
            else:
                assert ev["type"] == "removed"
                for bid in ev["block_hashes"]:
                    assert self.refs.get(bid, 0) == 1, f"block {bid} removed but not stored"
                    del self.refs[bid]

    def ids(self) -> set[int]:
        return set(self.refs)


def serving_now(engine: LLMEngine, bridge: KvEventBridge) -> set[bytes]:
    """Blocks the pool holds under its current root whose parent chain the router can reach."""
    root = engine.pool.cache_root
    held = {h: b for h, b in bridge.held.items() if b.root == root}
    assert set(held) <= engine.pool.registered_hashes()
    return set(held)


def check(engine: LLMEngine, bridge: KvEventBridge, view: RouterView) -> None:
    bridge.flush()
    pool_hashes = engine.pool.registered_hashes()
    assert set(bridge.held) == pool_hashes                      # the bridge mirrors every registration, any root
    assert view.ids() == {block_id(h) for h in bridge.published}
    assert bridge.published <= serving_now(engine, bridge)      # never a block the cache does not serve now
    # every block the cache serves now is published unless its parent was evicted first (the router's chain
    # is cut there too); each published block's tokens hash, with its parent, to its id
    for h in serving_now(engine, bridge) - bridge.published:
        b = bridge.held[h]
        assert b.parent is not None and b.parent not in bridge.published, "a servable block was not published"
    for h in bridge.published:
        b = bridge.held[h]
        prev = b.parent if b.parent is not None else hashlib.sha256(b.root).digest()
        assert hashlib.sha256(prev + array("q", b.tokens).tobytes()).digest() == h
        assert view.tokens[block_id(h)] == list(b.tokens)


@pytest.mark.parametrize("policy, mode, blocks", [("exact", "performance", 24), ("preserve", "performance", 24),
                                                  ("exact", "off", 16)])
def test_published_blocks_equal_the_pools_servable_registrations(tiny, policy, mode, blocks):
    """Bursts and calm spells: in performance mode the controller quantizes (the pool grows by an extent) and
    restores (the extent and its cached blocks leave); with morphing off a small pool preempts instead."""
    rng = random.Random(7)
    clock = FakeClock()
    morph = {"persist_iters": 1, "restore_persist_s": 1.0, "cost_aware": False} if mode != "off" else {}
    engine = LLMEngine(EngineConfig(num_kv_blocks=blocks, block_size=BS, max_num_batched_tokens=48, max_num_seqs=6,
                                    morph_mode=mode, max_model_len=128, prefix_cache_across_morph=policy,
                                    slo_ttft_s=1e6, slo_tbt_s=1e6, policy_overrides=morph),  # calm = KV only
                       loaded=tiny, clock=clock)
    runtime = engine.resource_manager(MorphRuntime)
    bridge = KvEventBridge()
    view = RouterView()
    engine.set_cache_events(bridge)
    bridge.attach(view)
    prefixes = [[rng.randrange(30, 500) for _ in range(rng.randrange(12, 24))] for _ in range(4)]
    resets = 0
    for step in range(450):
        for _ in range(rng.choice([0, 1, 2, 3]) if step % 90 < 30 else 0):  # 30 busy steps, 60 calm ones
            prompt = rng.choice(prefixes) + [rng.randrange(30, 500) for _ in range(rng.randrange(0, 9))]
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 24), ignore_eos=True))
        if runtime is not None and runtime.pending:
            runtime.pending[0].job.result()  # the copy lands within the step, as a real forward's time allows
        engine.step()
        clock.t += 0.5
        check(engine, bridge, view)
        if rng.random() < 0.01:
            engine.reset_prefix_cache()
            resets += 1
            check(engine, bridge, view)
    while engine.has_unfinished_requests() or (runtime is not None and not runtime.is_at_rest()):
        if runtime is not None and runtime.pending:
            runtime.pending[0].job.result()
        engine.step()  # drain, then stay calm until every layer is back at full precision
        clock.t += 0.5
        check(engine, bridge, view)
    stats = engine.stats()
    print(f"{policy}/{mode}: swaps {stats.swaps_total}, restores {stats.restores_total}, resets {resets}, "
          f"preemptions {stats.num_preemptions}, hits {stats.prefix_cache_hits}, sent {bridge.sent}, "
          f"unreachable {bridge.unreachable}")
    assert resets >= 1 and stats.prefix_cache_hits > 0 and bridge.sent["removed"] > 0
    if mode == "off":
        assert stats.num_preemptions > 0
    else:
        assert stats.swaps_total >= 2 and stats.restores_total >= 2


def test_a_configuration_that_returns_republishes_its_blocks(tiny):
    engine = LLMEngine(EngineConfig(num_kv_blocks=40, block_size=BS, max_num_batched_tokens=32, max_num_seqs=4,
                                    morph_mode="performance", max_model_len=128,
                                    policy_overrides={"persist_iters": 1, "restore_persist_s": 5.0,
                                                      "cost_aware": False}),
                       loaded=tiny, clock=FakeClock())
    bridge, view = KvEventBridge(), RouterView()
    engine.set_cache_events(bridge)
    bridge.attach(view)
    prompt = [(7 * j) % 500 + 30 for j in range(17)]
    engine.generate([prompt], SamplingParams(max_tokens=1))
    bridge.flush()
    full_precision = view.ids()
    assert len(full_precision) == 4                                  # 17 tokens: 4 full blocks registered
    morph(engine).apply_now(MorphDecision("quantize", (0,), "int4", "test"))
    bridge.flush()
    assert view.ids() == set()                                       # withdrawn: they do not serve the int4 model
    morph(engine).apply_now(MorphDecision("restore", (0,), None, "test"))
    bridge.flush()
    assert view.ids() == full_precision                              # back, without recomputing anything


def test_events_wait_for_the_publisher_and_a_full_queue_drops_and_counts(tiny):
    bridge = KvEventBridge(max_pending=2)
    bridge.root_changed(b"")  # what LLMEngine.set_cache_events tells it first
    for i in range(3):
        bridge.stored(bytes([i]) * 32, None, [1, 2, 3, 4], b"")
    assert bridge.dropped == 1
    view = RouterView()
    bridge.attach(view)
    assert len(view.ids()) == 2 and view.batches == 1
