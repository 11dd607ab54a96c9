"""The quality meter on the real embedded SmolLM2 engine: it never changes a served token or the block accounting
(meter on vs off, speculation off and always, through preemption and a cancellation), it samples nothing while
nothing is quantized, and each request's final output carries the share of its tokens served quantized and its
sampled agreement."""

from __future__ import annotations

import pytest

from policy import MorphDecision
from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.outputs import RequestOutput
from serve.engine.quality_meter import QualityMeter
from serve.engine.sampling_params import SamplingParams
from serve.metrics_catalogue import ENGINE_METRICS, stat_value
from tests.conftest import REPO_ROOT
from tests.morph_support import morph

WORDS = (REPO_ROOT / "workload" / "data" / "botchan_excerpt.txt").read_text(encoding="utf-8").split()
PROMPTS = [" ".join(WORDS[i * 37: i * 37 + 20 + 3 * i]) for i in range(8)]
LAYERS = (9,)
# nothing quantizes or restores on its own: max_quantized_fraction leaves room for exactly the test's layer, and
# restores wait "forever"; no KV rung (its conversions would be the engine's, not the test's)
POLICY = {"cost_aware": False, "restore_persist_s": 1e6, "kv_rung": None, "max_quantized_fraction": 0.034}


def meter(engine: LLMEngine) -> QualityMeter:
    m = engine.resource_manager(QualityMeter)
    assert m is not None, "the engine hosts no quality meter"
    return m


def build(smollm, fraction: float, speculation: str, **kw) -> LLMEngine:
    cfg = dict(morph_mode="default", morph_precisions="int8,int4", policy_overrides=POLICY, speculation=speculation,
               quality_meter=fraction, num_kv_blocks=14, max_num_seqs=8, enable_prefix_caching=False)
    return LLMEngine(EngineConfig(**{**cfg, **kw}), loaded=smollm)


def serve(engine: LLMEngine, params: SamplingParams, cancel_at: int | None = None):
    """Every request's tokens and final output, and after every step the pool's accounting: used and total blocks
    and each running sequence's block ids."""
    morph(engine).apply_now(MorphDecision("quantize", LAYERS, "int8", "test"))
    tokens: dict[str, list[int]] = {}
    finals: dict[str, RequestOutput] = {}

    def collect(out: RequestOutput) -> None:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finals[out.request_id] = out

    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, request_id=f"r{i}", callback=collect)
    trace, step = [], 0
    while engine.has_unfinished_requests():
        if step == cancel_at:
            assert engine.abort_request("r3")
        engine.step()
        step += 1
        trace.append((engine.pool.num_used, engine.pool.num_blocks,
                      sorted((s.request_id, tuple(s.block_ids)) for s in engine.scheduler.running)))
    return tokens, finals, trace


@pytest.mark.parametrize("speculation", ["off", "always"])
def test_the_meter_never_changes_a_served_token_or_the_block_accounting(smollm, speculation):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    on, off = build(smollm, 0.5, speculation), build(smollm, 0.0, speculation)
    try:
        assert off.resource_manager(QualityMeter) is None  # quality_meter 0: not built
        got = serve(on, params, cancel_at=9)
        want = serve(off, params, cancel_at=9)
        assert got[0] == want[0]  # every request's tokens, the cancelled one's included
        assert got[2] == want[2]  # used / total blocks and every running sequence's block ids, step by step
        assert on.scheduler.num_preemptions == off.scheduler.num_preemptions > 0  # the pool was tight
        assert on.pool.num_used == 0
        stats = meter(on).resource_stats()
        assert stats.samples_total > 0 and stats.reading is not None
        assert 0.0 <= stats.reading.divergence <= 1.0
        assert not meter(on)._served  # the cancelled request and the finished ones left nothing behind
        if speculation == "always":
            assert on.stats().spec_decode_num_drafts > 0
    finally:
        on.shutdown()
        off.shutdown()


def test_zero_samples_while_nothing_is_quantized(smollm):
    engine = build(smollm, 1000.0, "off", num_kv_blocks=256)
    try:
        engine.generate(PROMPTS[:4], SamplingParams(max_tokens=12, ignore_eos=True))
        assert morph(engine).num_quantized == 0
        s = meter(engine).resource_stats()
        assert (s.samples_total, s.tokens_quantized_layers, s.tokens_kv_8bit, s.meter_seconds, s.earned_seconds) == \
            (0, 0, 0, 0.0, 0.0)
        assert engine.stats().quality_agreement is None
    finally:
        engine.shutdown()


def test_final_outputs_carry_the_quantized_share_and_sampled_agreement(smollm):
    engine = build(smollm, 1000.0, "off", num_kv_blocks=256)
    try:
        tokens, finals, _ = serve(engine, SamplingParams(max_tokens=10, ignore_eos=True))
        total = 0
        for rid, out in finals.items():
            m = out.metrics
            assert m is not None
            assert m.quantized_layer_tokens == len(tokens[rid]) == 10  # every token served with a layer at int8
            assert m.kv_8bit_tokens == 0
            if m.quality_samples:
                assert m.quality_agreement == m.quality_agreed / m.quality_samples
            else:
                assert m.quality_agreement is None
            total += m.quality_samples
        stats = engine.stats()
        assert total == stats.quality_samples_total > 0
        assert stats.tokens_quantized_layers_total == 80
        assert stats.quality_agreement is not None and stats.quality_agreement_lower <= stats.quality_agreement
        rows = {m.name: stat_value(stats, m.stats_key) for m in ENGINE_METRICS
                if m.name.startswith(("morphserve_quality", "morphserve_tokens_"))}
        assert (rows["morphserve_quality_samples_total"] == total
                and rows["morphserve_tokens_quantized_layers_total"] == 80)
        assert (rows["morphserve_quality_agreement"] == stats.quality_agreement
                and rows["morphserve_tokens_kv_8bit_total"] == 0)
        assert None not in rows.values() and len(rows) == 7  # what both front ends export from the catalogue
    finally:
        engine.shutdown()


def test_8bit_kv_alone_switches_the_meter_on(smollm):
    engine = build(smollm, 1000.0, "off", num_kv_blocks=256, kv_cache_dtype="int8")
    try:
        out = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
        assert morph(engine).num_quantized == 0 and all(len(o["token_ids"]) == 8 for o in out)
        s = meter(engine).resource_stats()
        assert s.samples_total > 0 and s.tokens_kv_8bit == 16 and s.tokens_quantized_layers == 0
    finally:
        engine.shutdown()


def test_the_controller_sees_which_tiers_are_running(smollm):
    """Per-tier quality floors (PolicyConfig.quality_floor_by_tier) read the SLO tiers with a request running from
    the telemetry the morph runtime builds: each tier once, strictest first, none once everything finished."""
    from serve.engine.slo import RequestSLO

    engine = build(smollm, 0.0, "off", num_kv_blocks=256)
    try:
        for i, tier in enumerate((3, 0, 3)):
            engine.add_request(PROMPTS[i], SamplingParams(max_tokens=6, ignore_eos=True), request_id=f"t{i}",
                               slo=RequestSLO(priority=tier))
        while engine.scheduler.num_running() < 3:
            engine.step()
        runtime = morph(engine)
        assert runtime.telemetry(engine.clock(), engine.scheduler).running_tiers == (0, 3)
        while engine.has_unfinished_requests():
            engine.step()
        assert runtime.telemetry(engine.clock(), engine.scheduler).running_tiers == ()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("floor", [None, 0.5])
def test_the_meter_samples_only_when_nobody_waits_unless_a_floor_is_set(smollm, floor):
    """One request runs at a time (max_num_seqs 1), so the first two wait behind it: without a quality floor the
    meter takes no sample in a step that leaves a request waiting (it would delay each of them by a whole reference
    forward), so only the last request is sampled; with a floor it samples while they wait."""
    policy = {**POLICY, "quality_floor": floor}
    engine = build(smollm, 1000.0, "off", num_kv_blocks=256, max_num_seqs=1, policy_overrides=policy)
    try:
        morph(engine).apply_now(MorphDecision("quantize", LAYERS, "int8", "test"))
        finals: dict[str, RequestOutput] = {}
        for i, p in enumerate(PROMPTS[:3]):
            engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True), request_id=f"w{i}",
                               callback=lambda out: finals.update({out.request_id: out}) if out.finished else None)
        while engine.has_unfinished_requests():
            engine.step()
        samples = [finals[f"w{i}"].metrics.quality_samples for i in range(3)]
        if floor is None:
            assert samples[:2] == [0, 0] and samples[2] > 0
        else:
            assert all(n > 0 for n in samples)
    finally:
        engine.shutdown()


def test_tbt_room_is_the_least_time_left_before_a_batch_request_misses_its_tbt():
    from types import SimpleNamespace

    from serve.engine.quality_meter import tbt_room
    from serve.engine.slo import RequestSLO

    def chunk(tbt: float, last: float | None) -> SimpleNamespace:
        return SimpleNamespace(seq=SimpleNamespace(slo=RequestSLO(1.0, tbt, 1), last_token_time=last))

    assert tbt_room([chunk(0.4, 10.0), chunk(1.0, 9.5), chunk(0.1, None)], now=10.1) == pytest.approx(0.3)
    assert tbt_room([chunk(0.1, None)], now=10.0) == float("inf")  # a prompt in prefill has no gap yet
