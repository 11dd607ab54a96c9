"""Decodes over block tables that mix fp32 and 8-bit blocks in a running engine (the KV-precision rung): the mixed
decode kernel (attention_mixed_avx2.cpp) reads them, and the engine generates exactly the tokens of one whose decodes
all go to the dense path (gather, dequantize, SDPA) over the same blocks."""

from __future__ import annotations

from policy.kv_rung import KVRungDecision
from serve.engine.sampling_params import SamplingParams
from tests.memory.test_kv_rung import CALM, _rung
from tests.morph.test_morph import assert_memory_exact, morph_engine
from tests.morph_support import morph

PROMPTS = [[(7 * j + 31 * i) % 4000 + 10 for j in range(n)] for i, n in enumerate((8, 5, 13))]


def _run(tiny, kernel: bool, fused_write: bool = True) -> tuple[list[list[int]], list[int], int]:
    """Three prompts take the last 8 full-precision slots (4-token blocks) and decode 7 tokens each; after the first
    step the rung converts the 2 slots left, so every later block is 8-bit while earlier ones are not (and a step's
    new tokens go to both formats). Returns the tokens, the batch sizes the mixed kernel was called with, and how
    many steps some running table mixed formats. ``fused_write`` off: RoPE and the KV write as torch ops
    (rope.rotate, PagedKVCache.write) instead of elementwise_avx2.cpp's kernels."""
    e = morph_engine(tiny, "performance", blocks=20, kv_rung="int8", **CALM)
    if not fused_write:
        e.model.fused_elementwise = None
    ops, calls = e.model.paged_attention, []
    assert ops is not None, "the engine's CPU kernels were not built"

    class Counting:
        def __getattr__(self, name):
            return getattr(ops, name)

        def paged_decode_attention_mixed(self, q, *args):
            calls.append(q.shape[0])
            return ops.paged_decode_attention_mixed(q, *args)

    e.model.paged_attention = Counting() if kernel else None
    held = e.pool.allocate(10)
    out: list[list[int]] = [[] for _ in PROMPTS]
    for i, p in enumerate(PROMPTS):
        e.add_request(p, SamplingParams(max_tokens=7, ignore_eos=True), callback=lambda o, i=i: out[i].extend(
            o.new_token_ids))
    e.step()
    assert all(len(t) == 1 for t in out) and e.pool.num_free == 2
    _rung(e).apply(KVRungDecision("convert", 2, "test"))
    mixing = 0
    while e.has_unfinished_requests():
        formats = [{e.pool.is_quantized(b) for b in s.block_ids} for s in e.scheduler.running]
        mixing += any(len(f) == 2 for f in formats)
        e.step()
        assert_memory_exact(e)
    assert morph(e).stats.swaps == 0 and e.scheduler.num_preemptions == 0
    e.pool.free(held)
    return out, calls, mixing


def test_decodes_over_mixed_tables_run_the_mixed_kernel_and_match_the_dense_path(tiny):
    tokens, calls, mixing = _run(tiny, kernel=True)
    assert mixing >= 3 and sum(calls) >= 3 * tiny.config.num_layers and max(calls) == 3
    dense, dense_calls, dense_mixing = _run(tiny, kernel=False)
    assert not dense_calls and dense_mixing == mixing
    assert tokens == dense


def test_the_fused_rope_and_kv_write_into_both_formats_matches_the_torch_write(tiny):
    """Steps whose new tokens land in fp32 and 8-bit blocks at once (``KVIndex.kind`` "mixed") and steps of one
    format: rope_kv_write_q8_ (one pass: rotate, quantize the 8-bit tokens, copy the fp32 ones) generates exactly the
    tokens of rope.rotate + PagedKVCache.write."""
    from serve.model import kv_cache  # noqa: PLC0415

    kinds: list[str] = []
    write = kv_cache.PagedKVCache.rope_write_

    def counting(self, ops, qkv, cos, sin, heads, kv_heads, layer, where):
        kinds.append(where.kind)
        return write(self, ops, qkv, cos, sin, heads, kv_heads, layer, where)

    kv_cache.PagedKVCache.rope_write_ = counting
    try:
        fused, _, _ = _run(tiny, kernel=True)
    finally:
        kv_cache.PagedKVCache.rope_write_ = write
    assert {"full", "mixed", "q8"} <= set(kinds), set(kinds)
    torch_written, _, _ = _run(tiny, kernel=True, fused_write=False)
    assert fused == torch_written
