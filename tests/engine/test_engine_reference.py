"""The engine's outputs equal Hugging Face transformers' on the same weights (the embedded SmolLM2)."""

from __future__ import annotations

import math

import pytest
import torch

from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.engine.scheduler import ScheduledChunk
from serve.engine.sequence import Sequence
from serve.model.tokenizer import IncrementalDetokenizer

NEW_TOKENS = 32
_STORY = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps aloud while the "
          "wind rattled the windows and the gulls argued over scraps of fish on the rocks below. ")

PROMPTS_RAW = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    _STORY * 3,                                              # ~130 tokens: chunked under a small budget
    "1, 2, 3, 4, 5,",
]
CHATS = ["Name three colors.", "What is the capital of France?", "Write a haiku about winter. " + _STORY]


@pytest.fixture(scope="module")
def prompt_ids(smollm):
    tok = smollm.tokenizer
    ids = [tok.encode(p) for p in PROMPTS_RAW]
    ids += [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHATS]
    assert len(ids) == 8 and len({len(x) for x in ids}) >= 6
    return ids


@pytest.fixture(scope="module")
def hf_greedy(smollm_hf, prompt_ids):
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = smollm_hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                   max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def engine(smollm):
    return LLMEngine(EngineConfig(num_kv_blocks=256), loaded=smollm)


def _prompt_logits(engine: LLMEngine, ids: list[int], split: int | None = None) -> torch.Tensor:
    """Logits of every prompt position, computed in one chunk or two (the second attends to cached K/V)."""
    seq = Sequence("probe", ids, SamplingParams(), 0.0, IncrementalDetokenizer(engine.tokenizer))
    seq.block_ids = engine.pool.allocate(math.ceil(len(ids) / engine.config.block_size))
    try:
        parts = [(0, len(ids))] if split is None else [(0, split), (split, len(ids) - split)]
        out = []
        for start, n in parts:
            batch, _ = engine.executor.prepare([ScheduledChunk(seq, start, n)])
            batch.sample_indices = None
            out.append(engine.model.forward(batch, engine.kv))
        return torch.cat(out)
    finally:
        engine.pool.free(seq.block_ids)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_prompt_logits_match_transformers(engine, smollm_hf, prompt_ids):
    for ids in (prompt_ids[3], prompt_ids[7]):
        with torch.inference_mode():
            ref = smollm_hf(torch.tensor([ids])).logits[0].float()
        assert _rel_err(_prompt_logits(engine, ids), ref) <= 1e-4
        assert _rel_err(_prompt_logits(engine, ids, split=len(ids) // 3), ref) <= 1e-4
    assert engine.pool.num_used == 0


def test_the_trimmed_last_layer_gives_the_same_sampled_logits_and_writes_every_rows_kv(engine, prompt_ids):
    """The last layer runs its attention projection and MLP only for the sampled rows (LlamaModel.trim_last_layer):
    those rows' logits are the untrimmed ones up to fp32 summation order, and every token's K/V still lands."""
    ids = prompt_ids[3]
    seq = Sequence("probe", ids, SamplingParams(), 0.0, IncrementalDetokenizer(engine.tokenizer))
    seq.block_ids = engine.pool.allocate(math.ceil(len(ids) / engine.config.block_size))
    rows = torch.tensor([len(ids) // 2, len(ids) - 1])
    slots = engine.kv.block_map[torch.tensor(seq.block_ids)]  # this sequence's KV slots (the arena also holds weights)
    got = {}
    try:
        for trim in (None, True):
            engine.model.trim_last_layer = trim
            engine.kv.storage[slots] = 0.0  # only this forward's writes will be there
            batch, _ = engine.executor.prepare([ScheduledChunk(seq, 0, len(ids))])
            batch.sample_indices = rows
            got[trim] = (engine.model.forward(batch, engine.kv), engine.kv.storage[slots].clone())
    finally:
        engine.model.trim_last_layer = True
        engine.pool.free(seq.block_ids)
    (trimmed, kv_trimmed), (full, kv_full) = got[True], got[None]
    assert trimmed.shape == full.shape == (2, engine.model_config.vocab_size)
    assert _rel_err(trimmed, full) <= 1e-5
    assert torch.equal(kv_trimmed, kv_full) and kv_full.abs().sum() > 0


def test_greedy_alone_matches_transformers(engine, prompt_ids, hf_greedy):
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for ids, ref in zip(prompt_ids, hf_greedy):
        got = engine.generate([ids], params)[0]["token_ids"]
        assert got == ref
    assert engine.pool.num_used == 0


def test_greedy_concurrent_chunked_preempted_matches_transformers(smollm, prompt_ids, hf_greedy):
    block_size = 16
    need = [math.ceil((len(p) + NEW_TOKENS) / block_size) for p in prompt_ids]
    # room for the largest request plus a little: far less than all eight at once -> preemption
    engine = LLMEngine(EngineConfig(num_kv_blocks=max(need) + 6, max_num_batched_tokens=48, max_num_seqs=8,
                                    block_size=block_size), loaded=smollm)
    assert max(len(p) for p in prompt_ids) > 48, "some prompt must need chunked prefill"
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    rids: list[str] = []
    steps = 0
    while len(rids) < len(prompt_ids) or engine.has_unfinished_requests():
        if len(rids) < len(prompt_ids) and steps % 2 == 0:  # staggered arrivals, one every other step
            rid = engine.add_request(prompt_ids[len(rids)], params,
                                     callback=lambda o: tokens.setdefault(o.request_id, []).extend(o.new_token_ids))
            rids.append(rid)
        engine.step()
        engine.pool.check_invariants()
        steps += 1
        assert steps < 2000
    assert engine.scheduler.num_preemptions >= 1
    assert engine.pool.num_used == 0
    for rid, ref in zip(rids, hf_greedy):
        assert tokens[rid] == ref, rid
