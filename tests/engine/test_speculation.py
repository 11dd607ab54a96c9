"""Self-speculative decoding on the real embedded SmolLM2 engine: greedy output equals speculation off token for
token (batch 1, a batch of several, max_tokens limits, stop strings and stop tokens inside an accepted run,
min_tokens, penalties, bad words, a morphing transition mid-request), and KV block accounting stays exact through
acceptance, rejection, preemption, cancellation and a failed verification."""

from __future__ import annotations

import math

import pytest
import torch

from policy import MorphDecision
from policy.speculation import SpeculationConfig, SpeculationController
from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.engine.spec_manager import SpeculationManager
from serve.model.step_costs import COSTS_FILE, find_measured, machine_key, store
from tests.conftest import REPO_ROOT
from tests.morph_support import direct_variant, morph
from tests.policy.test_speculation import COSTS

WORDS = (REPO_ROOT / "workload" / "data" / "botchan_excerpt.txt").read_text(encoding="utf-8").split()
PROMPTS = [" ".join(WORDS[i * 41: i * 41 + 24]) for i in range(6)] + ["The capital of France is", "def add(a, b):"]


def spec(engine: LLMEngine) -> SpeculationManager:
    manager = engine.resource_manager(SpeculationManager)
    assert manager is not None, f"speculation {engine.config.speculation!r} hosts no speculation manager"
    return manager


@pytest.fixture(scope="module")
def plain(smollm):
    engine = LLMEngine(EngineConfig(speculation="off", num_kv_blocks=256), loaded=smollm)
    assert engine.resource_manager(SpeculationManager) is None
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def drafting(smollm):
    engine = LLMEngine(EngineConfig(speculation="always", num_kv_blocks=256, enable_prefix_caching=False),
                       loaded=smollm)
    yield engine
    engine.shutdown()


def tokens(engine: LLMEngine, prompts, params) -> list[list[int]]:
    return [o["token_ids"] for o in engine.generate(list(prompts), params)]


def check_blocks(engine: LLMEngine) -> None:
    """Every running sequence holds exactly the blocks its computed tokens need (what plain decoding holds at the
    same length), and the pool counts exactly those blocks as used (prefix caching off: no block is shared)."""
    bs = engine.config.block_size
    running = engine.scheduler.running
    for seq in running:
        assert len(seq.block_ids) == math.ceil(seq.num_computed_tokens / bs), (
            seq.request_id, seq.num_computed_tokens, len(seq.block_ids))
    assert engine.pool.num_used == sum(len(s.block_ids) for s in running)


def test_greedy_batch_1_equals_speculation_off_over_many_prompts(plain, drafting):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    before = spec(drafting).resource_stats()
    for prompt in PROMPTS:
        assert tokens(drafting, [prompt], params) == tokens(plain, [prompt], params), prompt
    after = spec(drafting).resource_stats()
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert drafted > 0 and 0 < accepted < drafted  # both accepted runs and rejections were exercised
    assert drafting.pool.num_used == 0


def test_greedy_batch_of_several_with_max_tokens_limits(plain, drafting):
    params = [SamplingParams(max_tokens=3 + 4 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    got = tokens(drafting, PROMPTS, params)
    assert got == tokens(plain, PROMPTS, params)
    assert [len(t) for t in got] == [p.max_tokens for p in params]  # nothing emitted past max_tokens
    assert drafting.pool.num_used == 0


def test_stop_string_and_stop_token_inside_an_accepted_run(plain, drafting):
    prompt = PROMPTS[0]
    full = plain.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop_tok = full["token_ids"][9]  # first occurrence ends the request
    want = plain.generate([prompt], SamplingParams(max_tokens=24, stop_token_ids=(stop_tok,)))[0]
    got = drafting.generate([prompt], SamplingParams(max_tokens=24, stop_token_ids=(stop_tok,)))[0]
    assert got["token_ids"] == want["token_ids"] and got["token_ids"][-1] == stop_tok
    assert got["finish_reason"] == want["finish_reason"]
    word = full["text"].split()[5]
    for include in (False, True):
        sp = SamplingParams(max_tokens=24, stop=(word,), include_stop_str_in_output=include)
        want, got = plain.generate([prompt], sp)[0], drafting.generate([prompt], sp)[0]
        assert (got["text"], got["token_ids"], got["finish_reason"]) == (want["text"], want["token_ids"],
                                                                         want["finish_reason"])
        assert (word in got["text"]) is include


def test_min_tokens_penalties_and_bad_words_equal_speculation_off(plain, drafting, smollm):
    eos = smollm.config.eos_token_ids
    cases = [SamplingParams(max_tokens=20, min_tokens=12),
             SamplingParams(max_tokens=20, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                            ignore_eos=True),
             SamplingParams(max_tokens=20, bad_words=("the", " the", " and"), ignore_eos=True)]
    for sp in cases:
        assert tokens(drafting, PROMPTS[:3], sp) == tokens(plain, PROMPTS[:3], sp), sp
    assert eos  # min_tokens blocked the end tokens through drafts and verification alike


def test_opted_out_and_logprob_requests_decode_without_drafts(plain, drafting):
    manager = spec(drafting)
    for sp in (SamplingParams(max_tokens=12, ignore_eos=True, speculate=False),
               SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)):
        before = manager.resource_stats().num_drafts
        assert tokens(drafting, PROMPTS[:2], sp) == tokens(plain, PROMPTS[:2], sp)
        assert manager.resource_stats().num_drafts == before
        assert "no decoding sequence may draft" in manager.last_decision.reason


def test_kv_blocks_exact_after_every_accept_and_reject(drafting):
    manager = spec(drafting)
    for i, prompt in enumerate(PROMPTS[:4]):
        drafting.add_request(prompt, SamplingParams(max_tokens=30 + 7 * i, ignore_eos=True))
    partial = 0
    while drafting.has_unfinished_requests():
        drafting.step()
        check_blocks(drafting)
        partial += sum(1 for a in manager.accepted_per_draft[-4:] if a < 3)
    assert partial > 0  # some verification rejected a draft token and its blocks were rolled back
    assert drafting.pool.num_used == 0


def test_kv_pressure_preemption_and_cancellation_keep_blocks_exact(smollm, plain):
    engine = LLMEngine(EngineConfig(speculation="always", num_kv_blocks=14, enable_prefix_caching=False,
                                    max_num_seqs=4), loaded=smollm)
    try:
        manager = spec(engine)
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        rids = [engine.add_request(p, params) for p in PROMPTS[:5]]
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            check_blocks(engine)
            steps += 1
            if steps == 12:
                engine.abort_request(rids[0])  # cancelled right after a draft was verified and rolled back
                check_blocks(engine)
        assert engine.scheduler.num_preemptions > 0
        assert any("KV pressure" in d.reason for d in manager.decisions)
        assert manager.resource_stats().num_drafts > 0
        assert engine.pool.num_used == 0
    finally:
        engine.shutdown()


def test_a_failed_verification_frees_the_drafts_blocks(smollm):
    engine = LLMEngine(EngineConfig(speculation="always", num_kv_blocks=64, enable_prefix_caching=False),
                       loaded=smollm)
    try:
        engine.generate(PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # drafts built
        engine.add_request(PROMPTS[1], SamplingParams(max_tokens=20, ignore_eos=True))
        engine.step()  # prefill
        taken = []

        def broken(plan, drafts):
            taken.append(plan.blocks_taken + engine.pool.num_used)
            raise RuntimeError("verify failed")
        engine.executor._verify = broken
        outs = engine.step()
        assert taken and outs[-1].finished and outs[-1].error
        assert engine.pool.num_used == 0 and not engine.scheduler.running
    finally:
        engine.shutdown()


def test_greedy_equal_through_a_morphing_transition_mid_request(smollm):
    """Layers 3..8 move to int8 after the request has emitted some tokens: drafts then run those layers at int4
    (the ladder step below) and the rest at int8; output equals a plain engine whose same layers switch at the same
    output length (tests/morph_support.py's direct variants)."""
    cfg = dict(num_kv_blocks=128, enable_prefix_caching=False)
    # the test applies the transition itself; restore_persist_s: the controller must not restore the layers
    # after 5 s of calm wall-clock time, which a loaded machine reaches before the 36 tokens are out
    morphing = LLMEngine(EngineConfig(speculation="always", morph_mode="default", morph_precisions="int8,int4",
                                      policy_overrides={"cost_aware": False, "restore_persist_s": 1e9}, **cfg),
                         loaded=smollm)
    reference = LLMEngine(EngineConfig(speculation="off", **cfg), loaded=smollm)
    layers, prompt = tuple(range(3, 9)), smollm.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=36, ignore_eos=True)
    try:
        got: list[int] = []
        morphing.add_request(prompt, params, callback=lambda o: got.extend(o.new_token_ids))
        swapped_at = None
        while morphing.has_unfinished_requests():
            if swapped_at is None and len(got) >= 10:
                swapped_at = len(got)
                morph(morphing).apply_now(MorphDecision("quantize", layers, "int8", "test"))
                assert spec(morphing).drafts.precisions("int8")[3:9] == ["int4"] * 6
            morphing.step()
        assert swapped_at is not None and spec(morphing).resource_stats().num_drafts > 0
        want: list[int] = []
        reference.add_request(prompt, params, callback=lambda o: want.extend(o.new_token_ids))
        while reference.has_unfinished_requests():
            if len(want) == swapped_at and reference.model.layers[3].precision == "full":
                for i in layers:
                    reference.model.layers[i] = direct_variant(reference, smollm, i, "int8")
            reference.step()
        assert got == want
    finally:
        morphing.shutdown()
        reference.shutdown()


def test_auto_needs_the_engine_dirs_measured_costs(smollm, tmp_path):
    assert LLMEngine(EngineConfig(num_kv_blocks=32), loaded=smollm).resource_manager(SpeculationManager) is None, \
        "auto without an engine directory's measured costs builds nothing"
    shape, cpu = (576, 576, 1536), torch.device("cpu")
    assert find_measured(shape, cpu, torch.float32, ["full", "int8"], tmp_path)[0] is None
    store(tmp_path / COSTS_FILE, machine_key(cpu, torch.float32, shape), COSTS)
    found, where = find_measured(shape, cpu, torch.float32, ["full", "int8", "int4"], tmp_path)
    assert found is not None and found.rest_s == COSTS.rest_s and where == str(tmp_path / COSTS_FILE)
    assert find_measured(shape, cpu, torch.float32, ["full", "int8"], None)[0] is None  # never the per-user cache


def test_auto_drafts_at_batch_1_and_not_for_a_large_batch(smollm):
    """The auto controller with this machine's measured costs (tests/policy/test_speculation.py's COSTS, from
    engines/smollm2-135m/step_costs.json) on the real engine: on at batch 1, off at batch 24 (after one probe)."""
    engine = LLMEngine(EngineConfig(speculation="always", num_kv_blocks=256, max_num_seqs=32), loaded=smollm)
    try:
        manager = spec(engine)
        manager.controller = SpeculationController(SpeculationConfig(mode="auto"), COSTS)
        engine.generate(PROMPTS[:1], SamplingParams(max_tokens=6, ignore_eos=True))
        first, second = [d for d in manager.decisions if "batch 1," in d.reason][:2]
        assert not first.speculate and "no plain decode step measured yet" in first.reason  # the machine factor
        assert second.speculate and "predicted x" in second.reason  # prior acceptance: drafting pays at batch 1
        manager.decisions.clear()
        engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(24)], SamplingParams(max_tokens=8, ignore_eos=True))
        big = [d for d in manager.decisions if "batch 24," in d.reason]
        # a bucket never measured drafts once (a probe) to measure itself; after that the prediction keeps it off
        drafts = [d for d in big if d.speculate]
        assert len(drafts) <= 1 and all(d.reason.startswith("probe") for d in drafts), big
        assert "<" in big[-1].reason and not big[-1].speculate, big
    finally:
        engine.shutdown()


def test_a_wrong_draft_is_rejected_at_every_offset_with_exact_blocks_and_output(plain, drafting, monkeypatch):
    """Drafts corrupted at every third position: verification rejects them at offsets 0..k, at and across block
    boundaries; the output still equals plain decoding's and every step leaves exactly the blocks plain holds."""
    executor = drafting.executor
    honest = executor._draft_token

    def corrupt(logits, chunk, so_far):
        tok, q = honest(logits, chunk, so_far)
        return ((tok + 1) % logits.shape[-1] if (chunk.seq.num_tokens + len(so_far)) % 3 == 1 else tok), q
    monkeypatch.setattr(executor, "_draft_token", corrupt)
    manager = spec(drafting)
    params = [SamplingParams(max_tokens=40 + 3 * i, ignore_eos=True) for i in range(3)]
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS[:3]):
        got[prompt] = []
        drafting.add_request(prompt, params[i], callback=lambda o, p=prompt: got[p].extend(o.new_token_ids))
    offsets = set()
    while drafting.has_unfinished_requests():
        n = len(manager.accepted_per_draft)
        drafting.step()
        check_blocks(drafting)
        offsets.update(manager.accepted_per_draft[n:])
    assert offsets >= {0, 1, 2}  # rejected at the first, second and third draft token
    assert [got[p] for p in PROMPTS[:3]] == tokens(plain, PROMPTS[:3], params)
    assert drafting.pool.num_used == 0
