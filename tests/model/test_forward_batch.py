"""The executor-to-model batch contract (``ForwardBatch`` in serve/model/llama.py): the executor hands block tables
of logical block ids and context lengths, the model maps them through ``kv.block_map`` and masks by length.
Checked on a mixed batch (ragged decodes, a chunk after cached tokens, a whole prompt) over scattered blocks:
the tensors handed over, and the dense (SDPA, masked) paths against the kernels that take lengths."""

from __future__ import annotations

import pytest

from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.engine.scheduler import ScheduledChunk
from serve.engine.sequence import Sequence
from serve.model import kernels
from serve.model.random_model import make_tiny_model
from serve.model.tokenizer import IncrementalDetokenizer

BS = 16


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    model = make_tiny_model(seed=3, vocab_size=1024, hidden_size=192, intermediate_size=256, num_layers=2,
                            num_heads=6, num_kv_heads=2, head_dim=32)
    return LLMEngine(EngineConfig(num_kv_blocks=64, block_size=BS, max_num_seqs=8), loaded=model)


def _seq(engine: LLMEngine, n: int, blocks: list[int], name: str) -> Sequence:
    seq = Sequence(name, [(7 * j + len(name)) % 1000 + 3 for j in range(n)], SamplingParams(), 0.0,
                   IncrementalDetokenizer(engine.tokenizer))
    seq.block_ids = blocks
    return seq


def _mixed(engine: LLMEngine) -> tuple[list[Sequence], list[ScheduledChunk], list[ScheduledChunk]]:
    """Sequences on scattered blocks (out of order), the chunks that fill their KV first, and a mixed batch: two
    decodes of different lengths (one shorter than the other's table: a padded row), a 1-token last piece of a
    prompt (a decode chunk too), a chunk after 20 cached tokens, and a whole prompt."""
    ids = engine.pool.allocate(16)
    assert ids is not None
    seqs = [_seq(engine, 40, [ids[7], ids[2], ids[9]], "a"), _seq(engine, 18, [ids[0], ids[11]], "b"),
            _seq(engine, 33, [ids[4], ids[5], ids[1]], "c"), _seq(engine, 37, [ids[15], ids[3], ids[8]], "d"),
            _seq(engine, 12, [ids[13]], "e")]
    a, b, c, d, e = seqs
    fill = [ScheduledChunk(a, 0, 39), ScheduledChunk(b, 0, 17), ScheduledChunk(c, 0, 32), ScheduledChunk(d, 0, 20)]
    mixed = [ScheduledChunk(d, 20, 17), ScheduledChunk(a, 39, 1), ScheduledChunk(e, 0, 12), ScheduledChunk(b, 17, 1),
             ScheduledChunk(c, 32, 1)]
    return seqs, fill, mixed


def _slots(seq: Sequence, start: int, end: int) -> list[int]:
    return [seq.block_ids[p // BS] * BS + p % BS for p in range(start, end)]


def test_prepare_hands_block_tables_and_lengths(engine):
    seqs, _, mixed = _mixed(engine)
    a, b, c, d, e = seqs
    try:
        batch, sampled = engine.executor.prepare(mixed)
        assert batch.num_decodes == 3 and [ch.seq.request_id for ch in sampled] == ["a", "b", "c", "d", "e"]
        # 40 tokens need 3 blocks: b's 18-token context is padded with its own first block, and masked by length
        assert batch.decode_block_tables.tolist() == [a.block_ids, [*b.block_ids, b.block_ids[0]], c.block_ids]
        assert batch.decode_context_lens.tolist() == [40, 18, 33] and batch.decode_ragged
        assert batch.slot_mapping.tolist() == (_slots(a, 39, 40) + _slots(b, 17, 18) + _slots(c, 32, 33)
                                               + _slots(d, 20, 37) + _slots(e, 0, 12))
        after, whole = batch.prefills
        assert (after.token_start, after.num_tokens, after.context_start, after.context_len) == (3, 17, 20, 37)
        assert after.block_table.tolist() == d.block_ids
        assert (whole.token_start, whole.num_tokens, whole.context_start, whole.block_table) == (20, 12, 0, None)
        # contexts that fill their tables exactly: nothing to mask
        full, _ = engine.executor.prepare([ScheduledChunk(c, 31, 1), ScheduledChunk(_seq(engine, 32, d.block_ids, "f"),
                                                                                   31, 1)])
        assert full.decode_context_lens.tolist() == [32, 32] and not full.decode_ragged
        assert full.decode_block_tables.tolist() == [c.block_ids[:2], d.block_ids[:2]]
    finally:
        engine.pool.free(sorted({i for s in seqs for i in s.block_ids}))


def test_chunk_and_decode_definitions():
    """``ScheduledChunk.is_decode`` (the forward's shape) is wider than ``Sequence.is_decoding`` (the generation
    phase): a prompt's last token run alone is a decode chunk of a sequence that has not decoded yet."""
    seq = Sequence("p", list(range(1, 34)), SamplingParams(), 0.0, None)  # type: ignore[arg-type]
    seq.num_computed_tokens = 32
    assert ScheduledChunk(seq, 32, 1).is_decode and not seq.is_decoding
    seq.token_ids.append(5)  # its first output; the 33rd token computed
    seq.num_computed_tokens = 33
    assert seq.is_decoding and ScheduledChunk(seq, 33, 1).is_decode
    seq.num_computed_tokens = 0  # preempted: recomputed from scratch, not decoding until caught up
    assert not seq.is_decoding and not ScheduledChunk(seq, 0, 34).is_decode and not ScheduledChunk(seq, 0, 1).is_decode


@pytest.mark.skipif(kernels.ops() is None, reason="the CPU kernels are not built")
def test_dense_paths_mask_like_the_kernels(engine):
    """The SDPA paths (masks the model builds from lengths and chunk starts) give the kernels' logits on a mixed
    batch, and every prompt attention kernel call still sees the context it did."""
    model = engine.model
    paged, prompt = model.paged_attention, model.prompt_attention
    assert paged is not None and prompt is not None
    seqs, fill, mixed = _mixed(engine)
    got = {}
    try:
        fb, _ = engine.executor.prepare(fill)
        model.forward(fb, engine.kv)
        for dense in (False, True):
            model.paged_attention, model.prompt_attention = (None, None) if dense else (paged, prompt)
            batch, _ = engine.executor.prepare(mixed)
            batch.sample_indices = None
            got[dense] = model.forward(batch, engine.kv)
    finally:
        model.paged_attention, model.prompt_attention = paged, prompt
        engine.pool.free(sorted({i for s in seqs for i in s.block_ids}))
    assert got[True].shape == (3 + 17 + 12, 1024)
    err = float((got[True] - got[False]).abs().max() / got[False].abs().max())
    assert err <= 1e-5, err
