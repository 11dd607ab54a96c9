"""Per-request metrics (RequestOutput.metrics, stop_reason): what the engine counted for that request, exactly.

KV blocks: a prompt sent twice finds its full blocks in the prefix cache the second time; the request's reused
blocks are what the engine's prefix-hit counter grew by, its missed blocks the rest of its prompt's blocks, its new
blocks what the pool handed it. Speculation: a request's draft and accepted tokens are what the manager's counters
grew by while it ran alone. Times are ordered on the engine clock. stop_reason names the stop string or stop token
id that ended a request, and nothing for the model's end token or max_tokens.
"""

from __future__ import annotations

import pytest

from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.outputs import RequestOutput
from serve.engine.sampling_params import SamplingParams
from serve.engine.spec_manager import SpeculationManager

PROMPT = "The history of the city begins with a small settlement by the river. " * 4


def _run(engine: LLMEngine, prompt: str, params: SamplingParams) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    rid = engine.add_request(prompt, params, callback=outs.append)
    while not (outs and outs[-1].finished):
        engine.step()
    assert all(o.request_id == rid for o in outs)
    return outs


def test_kv_block_counts_are_the_pools(smollm) -> None:
    engine = LLMEngine(EngineConfig(speculation="off", num_kv_blocks=64), loaded=smollm)
    bs = engine.config.block_size
    first = _run(engine, PROMPT, SamplingParams(max_tokens=5))[-1].metrics
    hits_before = engine.stats().prefix_cache_hits
    second_outs = _run(engine, PROMPT, SamplingParams(max_tokens=5, perf_metrics=True))
    second = second_outs[-1].metrics
    prompt_blocks = -(-second_outs[-1].num_prompt_tokens // bs)
    assert first.kv_reused_blocks == 0 and first.kv_missed_blocks == prompt_blocks and first.kv_hit_rate == 0
    assert second.kv_reused_blocks > 0
    assert second.kv_reused_blocks * bs == engine.stats().prefix_cache_hits - hits_before
    assert second.kv_reused_blocks + second.kv_missed_blocks == prompt_blocks
    # every block it holds at the end (prompt + 5 tokens) is a reused or a new one
    assert second.kv_total_blocks == -(-(second_outs[-1].num_prompt_tokens + 4) // bs)
    assert second.kv_hit_rate == pytest.approx(second.kv_reused_blocks / prompt_blocks)
    # with perf_metrics every output carries them; without, only the last one
    assert all(o.metrics is not None for o in second_outs)
    times = [second.arrival_time, second.first_scheduled_time, second.first_token_time, second.last_token_time]
    assert None not in times and times == sorted(times)
    fields = second.perf_fields(final=True)
    assert fields["kv_cache_reused_block"] == second.kv_reused_blocks and fields["last_token_time_ns"] > 0
    assert second_outs[0].metrics.perf_fields(final=False)["last_token_time_ns"] == 0


def test_draft_counts_are_the_speculation_managers(smollm) -> None:
    engine = LLMEngine(EngineConfig(speculation="always", num_kv_blocks=128, enable_prefix_caching=False),
                       loaded=smollm)
    spec = engine.resource_manager(SpeculationManager)
    drafted, accepted = spec.num_draft_tokens, spec.num_accepted_tokens
    m = _run(engine, "The capital of France is", SamplingParams(max_tokens=24))[-1].metrics
    assert m.draft_tokens > 0
    assert (m.draft_tokens, m.accepted_draft_tokens) == (spec.num_draft_tokens - drafted,
                                                         spec.num_accepted_tokens - accepted)
    assert m.acceptance_rate == pytest.approx(m.accepted_draft_tokens / m.draft_tokens)


def test_stop_reason_names_the_stop_string_or_token(smollm) -> None:
    engine = LLMEngine(EngineConfig(speculation="off", num_kv_blocks=64), loaded=smollm)
    by_string = _run(engine, "Count: one, two, three,", SamplingParams(max_tokens=40, stop=(",",)))[-1]
    assert by_string.finish_reason.value == "stop" and by_string.stop_reason == ","
    plain = _run(engine, "Count: one, two, three,", SamplingParams(max_tokens=40))
    token = plain[1].new_token_ids[0]  # the second generated token, as a stop token id
    by_token = _run(engine, "Count: one, two, three,", SamplingParams(max_tokens=40, stop_token_ids=(token,)))[-1]
    assert by_token.stop_reason == token
    assert _run(engine, "Count:", SamplingParams(max_tokens=2))[-1].stop_reason is None  # length
