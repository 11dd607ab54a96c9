"""``kv_cache_dtype`` int8 end to end: the engine's tokens against references that attend over the same stored K/V
(our dense path; transformers with a cache that keeps K/V exactly as the int8 blocks do), the KV tokens at the same
``device_memory``, the prefix cache's key, and clear errors for formats a device cannot serve.

Exact tokens against full-precision KV are not expected (8-bit KV changes the numerics); what is exact is that every
path reads back the same int8 codes and scales."""

from __future__ import annotations

import pytest
import torch

from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.engine.scheduler import ScheduledChunk
from serve.engine.sequence import Sequence
from serve.model.kv_format import dequantize, quantize
from serve.model.random_model import make_tiny_model
from serve.model.tokenizer import IncrementalDetokenizer
from tests.engine.test_engine_reference import _prompt_logits, _rel_err

NEW_TOKENS = 10
PROMPTS = [[(13 * j + i) % 1000 + 3 for j in range(n)] for i, n in enumerate((1, 17, 40, 77, 150))]


@pytest.fixture(scope="module")
def model(tiny):
    return make_tiny_model(seed=5, tokenizer=tiny.tokenizer, vocab_size=1024, hidden_size=192, intermediate_size=256,
                           num_layers=2, num_heads=6, num_kv_heads=2, head_dim=32)


def _engine(model, blocks: int = 64, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=blocks, block_size=16, max_num_batched_tokens=48, max_num_seqs=8,
                                  kv_cache_dtype="int8", **kw), loaded=model)


def _generate(e: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [o["token_ids"] for o in e.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))]


def test_int8_kernels_generate_exactly_what_dense_attention_over_the_dequantized_blocks_does(model):
    """Five prompts at once, chunked (48-token budget) and preempted (14 blocks for ~24 needed): the int8 decode
    kernel and the prompt kernel over dequantized context give the greedy tokens of torch SDPA over the blocks read
    back dequantized (the dense path), and the kernel really ran."""
    kernel = _engine(model, blocks=14)
    assert kernel.kv.is_quantized and kernel.model.paged_attention is not None
    calls: list[int] = []
    ops = kernel.model.paged_attention

    class Counting:
        def __getattr__(self, name):
            return getattr(ops, name)

        def paged_decode_attention_q8(self, q, *args):
            calls.append(q.shape[0])
            return ops.paged_decode_attention_q8(q, *args)

    kernel.model.paged_attention = Counting()
    got = _generate(kernel, PROMPTS)
    assert kernel.scheduler.num_preemptions > 0 and sum(calls) > 0
    dense = _engine(model, blocks=14)
    dense.model.paged_attention = dense.model.prompt_attention = None
    assert _generate(dense, PROMPTS) == got
    assert dense.scheduler.num_preemptions == kernel.scheduler.num_preemptions


def test_a_prefix_hit_generates_what_computing_the_prefix_again_does(model):
    """Every attention reads K/V as stored (a whole prompt too, after its own round trip), so a prompt whose prefix
    blocks come from the cache gives the tokens of an engine that computes them."""
    tail = [PROMPTS[3] + [7, 8, 9]]
    cached = _engine(model)
    _generate(cached, [PROMPTS[3]])
    hit = _generate(cached, tail)
    assert cached.scheduler.kv_cache_manager.prefix_hit_tokens == 64
    assert _generate(_engine(model, enable_prefix_caching=False), tail) == hit


def test_a_prompt_in_two_chunks_attends_to_what_one_chunk_does(model):
    """The first chunk's K/V come back from its int8 blocks for the second chunk; a prompt in one chunk attends over
    its own K/V after the same round trip, so both give the same logits (fp32 noise; measured: equal). Attending over
    the fresh, unrounded K/V instead would differ by ~1 % here, as int8 KV does from fp32 KV (checked)."""
    e, fp32 = _engine(model), LLMEngine(EngineConfig(num_kv_blocks=64, block_size=16), loaded=model)
    for ids in (PROMPTS[3], PROMPTS[4]):
        whole = _prompt_logits(e, ids)
        assert _rel_err(_prompt_logits(e, ids, split=len(ids) // 3), whole) <= 1e-5
        assert _rel_err(_prompt_logits(fp32, ids), whole) > 1e-3  # the rounding is real


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    """[B, kv_heads, T, hd] through quantize/dequantize per token and head."""
    rows = x.transpose(1, 2)  # [B, T, kvh, hd]
    codes, scales = quantize(rows.reshape(-1, *rows.shape[2:]), "int8")
    return dequantize(codes, scales, "int8", x.dtype).view(rows.shape).transpose(1, 2)


def _round_trip_cache(caught: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
    """A transformers DynamicCache whose new K/V go through the int8 format's round trip before they are stored and
    attended (the engine's semantics: every attention sees K/V as the blocks hold them); ``caught`` gets each
    layer's rounded K/V ``[T, kv_heads, hd]``."""
    from transformers import DynamicCache  # noqa: PLC0415

    class Cache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k, v = _round_trip(key_states), _round_trip(value_states)
            if caught is not None:
                caught[layer_idx] = (k[0].transpose(0, 1), v[0].transpose(0, 1))
            return super().update(k, v, layer_idx, *args, **kwargs)

    return Cache()


def test_smollm2_with_int8_kv_matches_transformers_over_the_same_kv_rounding(smollm, smollm_hf):
    """SmolLM2-135M with int8 KV against transformers' model whose cache rounds K/V the same way (an independent
    forward: its own attention, GEMMs and RoPE). (1) The K/V the engine stores for a prompt read back as transformers'
    rounded K/V in the first layers (to fp32 noise: the same codes and scales). Later layers are not compared: the
    rounding is discontinuous, so fp32 summation-order noise flips a code now and then, the flip's step perturbs
    the next layers by ~1e-3 and flips more (measured: none in layers 0-5, ~1,000 of 10,000 per layer by layer 14;
    logits then differ by ~2 %, as much as int8 KV moves them from fp32 KV). (2) Greedy tokens, alone and
    concurrently, are transformers' (they are also fp32 KV's here: 8-bit KV is near lossless)."""
    tok = smollm.tokenizer
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):",
                                       "Once upon a time, in a small village by the sea,")]
    e = LLMEngine(EngineConfig(num_kv_blocks=64, kv_cache_dtype="int8"), loaded=smollm)
    ids, caught = prompts[2], {}
    with torch.inference_mode():
        smollm_hf(torch.tensor([ids]), cache=_round_trip_cache(caught), use_cache=True)
    seq = Sequence("probe", ids, SamplingParams(), 0.0, IncrementalDetokenizer(e.tokenizer))
    seq.block_ids = e.pool.allocate(-(-len(ids) // 16))
    batch, _ = e.executor.prepare([ScheduledChunk(seq, 0, len(ids))])
    e.model.forward(batch, e.kv)
    blocks = e.kv.block_map[torch.tensor(seq.block_ids)].view(1, -1)
    for layer in range(3):
        k, v = (x[0, :len(ids)] for x in e.kv.read_blocks(layer, blocks))
        assert (k - caught[layer][0]).abs().max() < 1e-4 and (v - caught[layer][1]).abs().max() < 1e-4, layer
    e.pool.free(seq.block_ids)
    ref = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = smollm_hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24,
                                   min_new_tokens=24, cache=_round_trip_cache())
            ref.append(y[0, len(ids):].tolist())
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert [e.generate([p], params)[0]["token_ids"] for p in prompts] == ref
    assert [o["token_ids"] for o in e.generate(prompts, params)] == ref


def test_int8_kv_holds_at_least_3_5x_the_tokens_at_the_same_device_memory(smollm):
    """SmolLM2-135M at --device-memory 1200MiB: the base pool's KV tokens (and so the admission bound) with int8
    KV are >= 3.5x fp32's (3.75x per block; the layers' regions round to the smaller slot too)."""
    fp32 = LLMEngine(EngineConfig(device_memory="1200MiB"), loaded=smollm)
    int8 = LLMEngine(EngineConfig(device_memory="1200MiB", kv_cache_dtype="int8"), loaded=smollm)
    assert fp32.ledger.budget == int8.ledger.budget
    ratio = int8.pool.num_blocks / fp32.pool.num_blocks
    assert ratio >= 3.5, (fp32.pool.num_blocks, int8.pool.num_blocks)
    assert int8.reachable_blocks / fp32.reachable_blocks >= 3.5
    assert int8.ledger.as_dict()["arena"] <= fp32.ledger.as_dict()["arena"] + fp32.ledger.slot_bytes
    print(f"KV tokens at 1200MiB: fp32 {fp32.pool.num_blocks * 16}, int8 {int8.pool.num_blocks * 16} ({ratio:.2f}x)")


def test_the_prefix_cache_root_names_the_kv_format(model):
    """A block computed at int8 is never found by (nor reported to a KV-aware router as) an fp32 block."""
    auto = LLMEngine(EngineConfig(num_kv_blocks=16, block_size=16), loaded=model)
    int8 = _engine(model, blocks=16)
    assert int8.pool.cache_root == auto.pool.cache_root[:8] + b"kv=int8;" + auto.pool.cache_root[8:]
    for e in (auto, int8):
        _generate(e, [PROMPTS[2]])
    assert not auto.pool.registered_hashes() & int8.pool.registered_hashes()
    assert len(int8.pool.registered_hashes()) == 3  # 40 prompt + 9 generated tokens computed: 3 full blocks


def test_formats_a_device_cannot_serve_are_clear_errors(model):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp16")
    # refused when the engine is built on a CPU (the planner models fp8 KV on a GPU system from a CPU config)
    with pytest.raises(ValueError, match="fp8.*needs a CUDA device"):
        LLMEngine(EngineConfig(device="cpu", kv_cache_dtype="fp8", num_kv_blocks=4), loaded=model)
    with pytest.raises(ValueError, match="kv_rung.*int8 already|8-bit already"):
        LLMEngine(EngineConfig(kv_cache_dtype="int8", num_kv_blocks=4, morph_mode="default",
                               policy_overrides={"kv_rung": "int8", "cost_aware": False}), loaded=model)
