"""Structured output (serve/guided) on SmolLM2 with real grammars (xgrammar): every output of 24 JSON schemas
parses and validates, regex outputs match fully, the mask changes nothing but forbidden tokens (greedy picks the
unconstrained argmax wherever the grammar allows it), bad guides are refused (malformed ones before admission, those
the grammar engine refuses or cannot compile in time as the request's end, kind invalid input), guides compile off
the admission path (Reliability III finding 3), and guided requests keep their grammar state through preemption,
sampling, penalties and prefix caching."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
import torch

from bench.guided_schemas import REGEXES, SCHEMAS, regex_prompt, schema_prompt
from policy.decision import MorphDecision
from serve.config import EngineConfig
from serve.engine import sampler as sampler_module
from serve.engine.engine import LLMEngine
from serve.engine.outputs import OutputCollector
from serve.engine.sampling_params import SamplingParams
from serve.engine.sequence import SequenceStatus
from serve.error_kinds import ErrorKind
from serve.guided.spec import MAX_GUIDE_BYTES, GuidedDecoding
from serve.guided.state import apply_bitmask, mask_guided_rows
from tests.morph_support import morph

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def engine(smollm):
    e = LLMEngine(EngineConfig(num_kv_blocks=512, max_num_seqs=32, max_num_batched_tokens=1024), loaded=smollm)
    yield e
    e.shutdown()


def _chat(e: LLMEngine, text: str) -> str:
    return e.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _schema_params(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 160),
                          guided_decoding={"type": "json_schema", "guide": schema}, **kw)


def test_every_output_of_24_schemas_parses_and_validates(engine) -> None:
    prompts = [_chat(engine, schema_prompt(subject)) for subject, _ in SCHEMAS]
    outs = engine.generate(prompts, [_schema_params(schema) for _, schema in SCHEMAS])
    for (subject, schema), out in zip(SCHEMAS, outs):
        assert out["finish_reason"] == "stop", (subject, out)
        jsonschema.validate(json.loads(out["text"]), schema)
    assert len(SCHEMAS) >= 20


def _closed(schema):
    """``schema`` with ``additionalProperties: false`` on every object that does not say otherwise."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out.setdefault("additionalProperties", False)
        return out
    return [_closed(v) for v in schema] if isinstance(schema, list) else schema


@pytest.mark.slow
def test_the_llguidance_backend_behind_the_same_seam(smollm) -> None:
    """llguidance (EngineConfig.guided_backend): the same 24 schemas validate, regexes match, a bad regex is
    refused before admission."""
    e = LLMEngine(EngineConfig(num_kv_blocks=512, max_num_seqs=32, max_num_batched_tokens=1024,
                               guided_backend="llguidance"), loaded=smollm)
    try:
        prompts = [_chat(e, schema_prompt(subject)) for subject, _ in SCHEMAS]
        prompts += [_chat(e, regex_prompt(subject)) for subject, _ in REGEXES]
        # llguidance follows JSON Schema (unnamed properties allowed unless additionalProperties is false), where
        # xgrammar's strict mode forbids them: closed objects make the two languages the same
        params = [_schema_params(_closed(schema)) for _, schema in SCHEMAS]
        params += [SamplingParams(max_tokens=48, guided_decoding={"type": "regex", "guide": rx}) for _, rx in REGEXES]
        outs = e.generate(prompts, params)
        stopped = [(schema, out) for (_, schema), out in zip(SCHEMAS, outs) if out["finish_reason"] == "stop"]
        assert len(stopped) >= 22, [o["text"] for o in outs]  # seen: one number run on to max_tokens (length)
        for schema, out in stopped:
            jsonschema.validate(json.loads(out["text"]), schema)
        for (subject, rx), out in zip(REGEXES, outs[len(SCHEMAS):]):
            assert re.fullmatch(rx, out["text"]), (subject, out["text"])
        bad = e.generate(["hi"], SamplingParams(max_tokens=4, guided_decoding={"type": "regex", "guide": "([a-z"}))[0]
        assert bad["error_kind"] == "invalid_input" and "invalid regex guide" in bad["error"], bad
        assert e.num_waiting() == 0
    finally:
        e.shutdown()


def test_regex_outputs_match_fully(engine) -> None:
    prompts = [_chat(engine, regex_prompt(subject)) for subject, _ in REGEXES]
    params = [SamplingParams(max_tokens=48, guided_decoding={"type": "regex", "guide": rx}) for _, rx in REGEXES]
    for (subject, rx), out in zip(REGEXES, engine.generate(prompts, params)):
        assert out["finish_reason"] == "stop", (subject, out)
        assert re.fullmatch(rx, out["text"]), (subject, out["text"])


def test_choice_json_and_grammar_kinds(engine) -> None:
    prompt = _chat(engine, "Is the sky blue? Answer yes or no.")
    guide = {"type": "choice", "guide": ["yes", "no", "maybe"]}
    out = engine.generate([prompt], SamplingParams(max_tokens=8, guided_decoding=guide))[0]
    assert out["text"] in ("yes", "no", "maybe") and out["finish_reason"] == "stop"
    # any JSON: a 135M model asked for "a person" rambles past 200 tokens (still JSON so far); one key it ends
    out = engine.generate([_chat(engine, "Give the capital of France as JSON with one key.")],
                          SamplingParams(max_tokens=64, guided_decoding={"type": "json"}))[0]
    assert out["finish_reason"] == "stop" and isinstance(json.loads(out["text"]), (dict, list)), out
    grammar = 'root ::= "The answer is " digit "."\ndigit ::= [0-9]'
    out = engine.generate([_chat(engine, "What is 2+2?")],
                          SamplingParams(max_tokens=16, guided_decoding={"type": "ebnf_grammar", "guide": grammar}))[0]
    assert re.fullmatch(r"The answer is [0-9]\.", out["text"]), out


def test_the_mask_changes_nothing_but_forbidden_tokens(engine, monkeypatch) -> None:
    """Greedy: at every step the guided token is the unconstrained argmax whenever the grammar allows that
    token, and an allowed token otherwise (the real logits of the real run, before and after the mask)."""
    steps: list[tuple[int, torch.Tensor]] = []
    real = sampler_module.mask_guided_rows

    def recording(logits, states, argmax_only=None):
        raw = logits.argmax(dim=-1).clone()
        real(logits, states, argmax_only)
        steps.append((int(raw[0]), logits[0].clone()))

    monkeypatch.setattr(sampler_module, "mask_guided_rows", recording)
    subject, schema = SCHEMAS[8]  # an order: nested objects in an array
    out = engine.generate([_chat(engine, schema_prompt(subject))], _schema_params(schema))[0]
    tokens = out["token_ids"]
    assert len(steps) == len(tokens) and len(tokens) > 10
    agreed = 0
    for (raw, masked), tok in zip(steps, tokens):
        assert masked[tok] > float("-inf")
        if masked[raw] > float("-inf"):
            assert tok == raw
            agreed += 1
    assert 0 < agreed < len(tokens)  # the grammar both followed the model and overruled it
    unguided = engine.generate([_chat(engine, schema_prompt(subject))], SamplingParams(max_tokens=len(tokens)))[0]
    first_overruled = next(i for i, (raw, m) in enumerate(steps) if m[raw] == float("-inf"))
    assert unguided["token_ids"][:first_overruled] == tokens[:first_overruled]


def test_greedy_rows_skip_the_mask_only_where_it_changes_nothing(engine) -> None:
    """argmax_only: the argmax of every row equals that of the fully masked logits, on random logits whose
    argmax the grammar sometimes allows and sometimes forbids; rows that are not argmax-only are masked."""
    g = torch.Generator().manual_seed(5)
    states = [engine.guides.new_state(GuidedDecoding("regex", r"[0-9]{1,3}|abc")) for _ in range(6)] + [None]
    allowed = engine.tokenizer.encode("7")[0]
    for trial in range(20):
        logits = torch.randn(7, engine.model_config.vocab_size, generator=g)
        if trial % 2:
            logits[:, allowed] = 50.0  # the grammar allows this argmax
        full, fast = logits.clone(), logits.clone()
        mask_guided_rows(full, states)
        mask_guided_rows(fast, states, [True] * 5 + [False, True])
        assert torch.equal(full.argmax(-1), fast.argmax(-1))
        assert torch.equal(full[5], fast[5]) and torch.equal(fast[6], logits[6])
        assert (trial % 2 == 1) == torch.equal(fast[0], logits[0])


def test_the_torch_mask_for_other_devices_equals_xgrammars_kernel(engine) -> None:
    """apply_bitmask (the path for CUDA, in plain torch ops) run on the CPU in bfloat16 and fp32: the same
    -inf positions as xgrammar's CPU kernel, rows not named untouched."""
    import xgrammar as xgr

    g = torch.Generator().manual_seed(3)
    vocab = engine.model_config.vocab_size
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(4, vocab, generator=g).to(dtype)
        ours, theirs = logits.clone(), logits.float()
        apply_bitmask(ours, bitmask, [0, 2, 3])
        xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=[0, 2, 3])
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        assert torch.equal(ours[1], logits[1]) and torch.isinf(ours[0]).sum() > vocab // 4


@pytest.mark.parametrize("guided, match", [
    ({"type": "json_schema", "guide": "{not json"}, "not valid JSON"),
    ({"type": "json_schema", "guide": "[1, 2]"}, "must be a JSON object"),
    ({"type": "yaml", "guide": "a: 1"}, "must be one of"),
    ({"type": "regex", "guide": ""}, "needs a guide"),
    ({"type": "regex", "guide": "a" * (MAX_GUIDE_BYTES + 1)}, "at most"),
    ({"type": "choice", "guide": []}, "non-empty strings"),
    ({"type": "regex", "guide": "x", "backend": "outlines"}, "unknown guided decoding field"),
])
def test_bad_guides_are_refused_before_admission(engine, guided, match) -> None:
    before = (engine.num_waiting(), len(engine._requests))
    with pytest.raises(ValueError, match=match):
        engine.add_request("hi", SamplingParams(max_tokens=4, guided_decoding=guided))
    assert (engine.num_waiting(), len(engine._requests)) == before == (0, 0)


@pytest.mark.parametrize("guided, match", [
    ({"type": "regex", "guide": "([a-z"}, "invalid regex guide: .*Unclosed"),
    ({"type": "json_schema", "guide": '{"$ref": "#"}'}, "accepts no text"),     # these once answered 500
    ({"type": "ebnf_grammar", "guide": "root ::= root"}, "accepts no text"),
])
def test_guides_the_grammar_engine_refuses_end_the_request_as_invalid_input(engine, guided, match) -> None:
    """Compiled off the admission path, a guide the grammar engine refuses ends its request with the reason, kind
    invalid input (HTTP 400), and leaves nothing waiting."""
    out = engine.generate(["hi"], SamplingParams(max_tokens=4, guided_decoding=guided))[0]
    assert out["finish_reason"] == "error" and out["error_kind"] == ErrorKind.INVALID_INPUT.value, out
    assert re.search(match, out["error"]), out["error"]
    assert (engine.num_waiting(), len(engine._requests), len(engine.grammars)) == (0, 0, 0)


def test_a_guide_that_reaches_a_dead_end_ends_as_invalid_input(engine) -> None:
    """A grammar that allows a first token but nothing after it: the request ends as its own input's fault
    (GuideViolation, invalid input) instead of sampling from no token at all (an engine error, HTTP 500)."""
    grammar = 'root ::= "Yes" tail\ntail ::= tail'
    guide = {"type": "ebnf_grammar", "guide": grammar}
    out = engine.generate(["Say yes."], SamplingParams(max_tokens=8, guided_decoding=guide))[0]
    assert out["error_kind"] == ErrorKind.INVALID_INPUT.value and "allows no token after" in out["error"], out
    assert out["text"] == "Yes"


SLOW_REGEX = "(" + "|".join(f"[\\s\\S]{{0,{3000 + 7 * j}}}q0_{j}" for j in range(20)) + ")"
"""The issue's 391-byte regex: ~50 CPU seconds of xgrammar compile on this 2-core host."""


def _children(pid: int) -> list[int]:
    return [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def test_a_slow_compile_waits_apart_is_stopped_and_the_engine_goes_on(smollm) -> None:
    """Off the admission path: add_request returns at once, an ordinary request added after the slow guide is
    scheduled in the very next step while the guided one waits for its grammar, and past guided_compile_timeout_s
    (CPU time) the compile's process is killed (it kept burning a core for ~50 s after the refusal) and the request
    ends as invalid input."""
    e = LLMEngine(EngineConfig(num_kv_blocks=64, guided_compile_timeout_s=1.0), loaded=smollm)
    collect = OutputCollector()
    try:
        slow = e.add_request("hi", SamplingParams(max_tokens=4, guided_decoding={"type": "regex", "guide": SLOW_REGEX}),
                             callback=collect)
        plain = e.add_request("hi", SamplingParams(max_tokens=3), callback=collect)
        e.step()
        assert [c.request_id for c in e.scheduler.running] == [plain] and e.num_waiting() == 1
        assert e._requests[slow].status is SequenceStatus.WAITING_FOR_GRAMMAR and len(e.grammars) == 1
        seen: set[int] = set()
        while not collect.finished(slow):
            if (worker := e.guides.pool.worker_pid()) is not None:
                seen.update(_children(worker))
            if not e.step():
                e.grammars.wait(0.1)
        assert collect.results[plain]["finish_reason"] == "length"
        assert collect.results[slow]["error_kind"] == ErrorKind.INVALID_INPUT.value
        assert "did not compile within 1 s of CPU time" in collect.results[slow]["error"]
        assert seen and not any(os.path.exists(f"/proc/{pid}") for pid in seen)  # the compile was stopped
        assert _children(e.guides.pool.worker_pid()) == [] and e.num_waiting() == 0 and not e.has_unfinished_requests()
    finally:
        e.shutdown()


def test_an_aborted_guided_request_stops_its_compile(smollm) -> None:
    e = LLMEngine(EngineConfig(num_kv_blocks=64, guided_compile_timeout_s=600.0), loaded=smollm)
    try:
        rid = e.add_request("hi", SamplingParams(max_tokens=4, guided_decoding={"type": "regex", "guide": SLOW_REGEX}))
        while not (e.guides.pool.worker_pid() and _children(e.guides.pool.worker_pid())):
            e.grammars.wait(0.1)
        compiling = _children(e.guides.pool.worker_pid())
        assert e.abort_request(rid)
        while any(os.path.exists(f"/proc/{pid}") for pid in compiling):
            e.grammars.wait(0.1)
        assert len(e.grammars) == 0 and e.guides.pool.compiling == 0
    finally:
        e.shutdown()


class _NeverCompiles:
    """A guide whose compile never finishes (a stand-in for a compile slower than any deadline)."""

    cancelled = False

    def done(self) -> bool:
        return False

    def add_done_callback(self, fn) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True


def test_a_request_waiting_for_its_grammar_meets_its_queue_deadline_in_a_background_loop(smollm) -> None:
    """With nothing else to run, the background loop slept until a compile finished, so a guided request's queue
    deadline (and timeout_s) went unchecked while its grammar compiled: the issue-44 probe's three slow guides were
    answered 503 at 41 s, not 30 (bench.reliability_probe, 2026-12-04). The loop now ticks while grammars compile:
    the request ends past its deadline, kind overloaded, and its compile is cancelled."""
    e = LLMEngine(EngineConfig(num_kv_blocks=64, queue_timeout_s=0.5), loaded=smollm)
    pending = _NeverCompiles()
    e.guides.submit = lambda spec: pending  # type: ignore[method-assign]
    collect = OutputCollector()
    e.start_background()
    try:
        rid = e.add_request("hi", SamplingParams(max_tokens=4, guided_decoding={"type": "regex", "guide": "[ab]+"}),
                            callback=collect)
        for _ in range(600):  # a bound against a hang, not a timing: the deadline is 0.5 s
            if collect.finished(rid):
                break
            e.grammars.wait(0.1)
        assert collect.finished(rid), "the request waiting for its grammar never met its queue deadline"
        assert collect.results[rid]["error_kind"] == ErrorKind.OVERLOADED.value
        assert "queue_timeout_s" in collect.results[rid]["error"] and pending.cancelled and len(e.grammars) == 0
    finally:
        e.shutdown()


def test_min_tokens_with_a_guide_is_refused() -> None:
    with pytest.raises(ValueError, match="min_tokens together with guided decoding"):
        SamplingParams(max_tokens=8, min_tokens=2, guided_decoding={"type": "json"})
    assert GuidedDecoding.from_value({"type": "choice", "guide": ["a", "b"]}).choices == ["a", "b"]


def test_max_tokens_before_the_grammar_ends_is_a_stated_length_finish(engine) -> None:
    subject, schema = SCHEMAS[15]
    out = engine.generate([_chat(engine, schema_prompt(subject))], _schema_params(schema, max_tokens=5))[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(out["text"])


@pytest.mark.slow
def test_guided_requests_survive_preemption_with_the_same_tokens(smollm) -> None:
    """A pool too small for the batch preempts (recompute keeps the tokens, so the matcher stays right):
    outputs equal those of a pool with room for all, and still validate. The grammars are compiled first (one
    token each, then served from the compiler's cache), so all six reach the scheduler together: requests that
    waited for their compiles one by one could run one after another and never preempt."""
    picks = [SCHEMAS[i] for i in (0, 4, 8, 9, 15, 22)]
    outs = {}
    for blocks in (512, 18):
        e = LLMEngine(EngineConfig(num_kv_blocks=blocks, max_num_seqs=8), loaded=smollm)
        try:
            prompts = [_chat(e, schema_prompt(s)) for s, _ in picks]
            e.generate(prompts, [_schema_params(schema, max_tokens=1) for _, schema in picks])
            before = e.scheduler.num_preemptions
            outs[blocks] = e.generate(prompts, [_schema_params(schema) for _, schema in picks])
            preempted = e.scheduler.num_preemptions - before
        finally:
            e.shutdown()
        if blocks == 18:
            assert preempted > 0
    assert [o["token_ids"] for o in outs[18]] == [o["token_ids"] for o in outs[512]]
    for (_, schema), out in zip(picks, outs[18]):
        jsonschema.validate(json.loads(out["text"]), schema)


def test_sampling_penalties_stop_strings_and_prefix_caching_keep_outputs_valid(engine) -> None:
    picks = SCHEMAS[:8]
    prompts = [_chat(engine, schema_prompt(s)) for s, _ in picks]
    sampled = [_schema_params(schema, temperature=0.9, top_p=0.95, top_k=50, seed=7 + i, repetition_penalty=1.2,
                              presence_penalty=0.3, stop=["\n\n"]) for i, (_, schema) in enumerate(picks)]
    first = engine.generate(prompts, sampled)
    again = engine.generate(prompts, sampled)  # prefix cache hits, same seeds: same tokens
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in first]
    for (_, schema), out in zip(picks, first):
        assert out["finish_reason"] == "stop"
        jsonschema.validate(json.loads(out["text"]), schema)


def test_guided_requests_under_slai_with_layers_swapped_mid_request(smollm) -> None:
    """SLAI scheduling and morph transitions while guided requests run: layers go to int8 and int4 after a few
    steps and come back before the end (a swap changes weights, not grammar state); every output validates."""
    e = LLMEngine(EngineConfig(scheduler="slai", morph_mode="default", device_memory="700MiB", max_num_seqs=8,
                               morph_precisions="int8,int4",
                               policy_overrides={"cost_aware": False}), loaded=smollm)
    try:
        picks = [SCHEMAS[i] for i in (1, 5, 8, 13, 19, 21)]
        results: dict[str, dict] = {}

        def collect(out) -> None:
            r = results.setdefault(out.request_id, {"text": ""})
            r["text"] += out.new_text
            if out.finished:
                r["finish_reason"] = out.finish_reason.value

        rids = [e.add_request(_chat(e, schema_prompt(s)), _schema_params(schema), callback=collect) for s, schema
                in picks]
        while len(e.grammars):  # the swaps below must land mid-request: first let every grammar compile
            e.has_unfinished_requests()
            e.grammars.wait(0.1)
        order = morph(e).controller.swap_order
        for step in range(400):
            if step == 3:
                morph(e).apply_now(MorphDecision("quantize", tuple(order[:4]), "int8", "test"))
            if step == 6:
                morph(e).apply_now(MorphDecision("quantize", tuple(order[:2]), "int4", "test"))
            if step == 12:
                morph(e).apply_now(MorphDecision("restore", tuple(order[:2]), "int8", "test"))
            if not e.step() and not e.has_unfinished_requests():
                break
        assert morph(e).stats.swaps >= 2
        for rid, (subject, schema) in zip(rids, picks):
            assert results[rid]["finish_reason"] == "stop", (subject, results[rid])
            jsonschema.validate(json.loads(results[rid]["text"]), schema)
    finally:
        e.shutdown()
