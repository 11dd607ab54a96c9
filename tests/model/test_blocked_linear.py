"""Full-precision weights in oneDNN's blocked layout (serve/model/linear.py: BlockedLayout, DenseLinear.blocked).

What must hold: the layout we probe is the one oneDNN packs real weights into; our kernel for that layout and
oneDNN on a non-owning view of the same bytes both compute x @ W^T (float64 reference); the view reads the
bytes where they lie (no packed second copy: checked by writing the bytes and by resident memory); the
placement walk sees exactly the weight bytes; and an engine's fp32 CPU layers hold their weights this way.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.model import crossovers, kernels
from serve.model import linear as linear_module
from serve.model.linear import BlockedLayout, DenseLinear, blocked_layout
from serve.morph.placement import arena_nbytes, weight_tensors
from tests.conftest import make_tiny_model
from tests.memory.test_arena import _rss_bytes
from tests.model.test_qkernels import _check_close, _gen

torch.set_num_threads(2)

OPS = kernels.ops()
needs_blocked = pytest.mark.skipif(OPS is None or not linear_module.onednn_available(),
                                   reason="needs our CPU kernels and torch's oneDNN")


def _formula_layout(n: int, k: int, block: int) -> BlockedLayout:
    """A layout object for our kernel alone (no oneDNN md): the formula, at any block size."""
    return BlockedLayout(n, k, block, torch.empty(0, dtype=torch.uint8))


@needs_blocked
@pytest.mark.parametrize("n,block", [(16, 16), (48, 16), (96, 32), (128, 64), (960, 64)])
@pytest.mark.parametrize("k", [1, 13, 576])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 13])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocked_kernel_matches_float_reference(n: int, block: int, k: int, m: int, with_bias: bool) -> None:
    """Every path our kernel has (one row: 64-, 32- and 16-row panels; several rows: whole 64-, 32- or 16-row
    tasks)."""
    g = _gen(n * 131 + k * 7 + m + with_bias)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    layout = _formula_layout(n, k, block)
    _check_close(OPS.fp32_blocked_linear(x, layout.pack(w), n, block, bias), x, w, bias)


@needs_blocked
@pytest.mark.parametrize("n,block", [(48, 16), (96, 32), (960, 64)])
@pytest.mark.parametrize("k", [13, 64, 65, 576])
@pytest.mark.parametrize("m", [2, 5, 47, 48, 49, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocked_kernel_rows_equal_the_one_row_kernel_bit_for_bit(n: int, block: int, k: int, m: int,
                                                                   with_bias: bool) -> None:
    """Row invariance, what the speculative verify's exactness rests on: each of ``m`` rows computed together
    (the several-row path, its k chunks and its 48-row groups) equals that row computed alone (the one-row path)."""
    g = _gen(n * 17 + k * 3 + m + with_bias)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    packed = _formula_layout(n, k, block).pack(w)
    together = OPS.fp32_blocked_linear(x, packed, n, block, bias)
    alone = torch.cat([OPS.fp32_blocked_linear(x[i:i + 1].contiguous(), packed, n, block, bias) for i in range(m)])
    assert torch.equal(together, alone)


@needs_blocked
def test_blocked_kernel_rejects_bad_operands() -> None:
    w = torch.randn(64 * 8)
    with pytest.raises(RuntimeError, match="multiple of block"):
        OPS.fp32_blocked_linear(torch.randn(1, 8), w, 60, 64)
    with pytest.raises(RuntimeError, match="values, not n_out"):
        OPS.fp32_blocked_linear(torch.randn(1, 9), w, 64, 64)
    with pytest.raises(RuntimeError, match="bias must be"):
        OPS.fp32_blocked_linear(torch.randn(1, 8), w, 64, 64, torch.randn(63))
    with pytest.raises(RuntimeError, match="w must be"):
        OPS.fp32_blocked_linear(torch.randn(1, 8), w.double(), 64, 64)


@needs_blocked
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (3072, 576), (1024, 512)])
def test_probed_layout_is_how_onednn_packs_a_real_weight(n: int, k: int) -> None:
    """The layout is probed with index-valued floats; a random weight must land the same way."""
    layout = blocked_layout(n, k)
    assert layout is not None and n % layout.block == 0
    w = torch.randn(n, k, generator=_gen(n + k))
    packed = torch.ops.mkldnn._reorder_linear_weight(w, linear_module.PACK_HINT_ROWS)
    assert torch.ops.mkldnn._nbytes(packed) == n * k * 4
    raw = torch.frombuffer((ctypes.c_float * (n * k)).from_address(torch.ops.mkldnn.data_ptr(packed)),
                           dtype=torch.float32)
    assert torch.equal(raw, layout.pack(w).view(-1))
    x = torch.randn(4, k, generator=_gen(n))  # and oneDNN computes with our bytes as with its own
    ours = layout.pack(w)  # held: the view does not own the bytes
    view = OPS.mkldnn_weight_view(ours, n, k, layout.md)
    assert torch.equal(linear_module.onednn_linear(x, view), linear_module.onednn_linear(x, packed))


@needs_blocked
def test_shapes_onednn_would_pad_keep_the_plain_layout() -> None:
    assert blocked_layout(40, 96) is None
    op = DenseLinear(torch.randn(40, 96)).blocked()
    assert op.layout is None and op.weight.shape == (40, 96)
    bf16 = DenseLinear(torch.randn(128, 64).bfloat16()).blocked()
    assert bf16.layout is None


@needs_blocked
@pytest.mark.parametrize(("limit", "m"), [(2, 1), (2, 2), (2, 3), (2, 64), (2, 300), (8, 8), (8, 9), (0, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocked_op_runs_our_kernel_for_few_rows_and_onednn_above(limit: int, m: int, with_bias: bool,
                                                                  monkeypatch) -> None:
    """Up to the current ``blocked_kernel_max_rows`` (the default 8, or this machine's: here 2, 8 and 0) our blocked
    kernel, above it oneDNN on a view of the same bytes."""
    calls: list[tuple[str, int]] = []
    real_kernel, real_onednn = OPS.fp32_blocked_linear, linear_module.onednn_linear

    class Counting:
        def __getattr__(self, name):
            return getattr(OPS, name)

        @staticmethod
        def fp32_blocked_linear(x, w, n, block, b=None):
            calls.append(("ours", x.shape[0]))
            return real_kernel(x, w, n, block, b)

    def counting_onednn(x, w, b=None):
        assert w.is_mkldnn  # the view of the blocked bytes, never the plain weight
        calls.append(("oneDNN", x.shape[0]))
        return real_onednn(x, w, b)

    monkeypatch.setattr(kernels, "ops", lambda: Counting())
    monkeypatch.setattr(linear_module, "onednn_linear", counting_onednn)
    g = _gen(m * 3 + with_bias)
    x, w = torch.randn(m, 576, generator=g), torch.randn(960, 576, generator=g)
    b = torch.randn(960, generator=g) if with_bias else None
    op = DenseLinear(w, b).blocked()
    assert op.layout is not None and op.weight.shape == (960 // op.layout.block, 576, op.layout.block)
    assert torch.equal(op.plain_weight(), w)
    with crossovers.using(blocked_kernel_max_rows=limit):
        _check_close(op(x), x, w, b)
    assert calls == [("ours" if m <= limit else "oneDNN", m)]


@needs_blocked
def test_onednn_reads_the_blocked_bytes_where_they_lie() -> None:
    """Doubling the stored bytes in place doubles oneDNN's output exactly: the view holds no copy of its own."""
    g = _gen(5)
    op = DenseLinear(torch.randn(960, 576, generator=g)).blocked()
    x = torch.randn(64, 576, generator=g)
    y = op(x)
    assert op.weight.data_ptr() in op.layout.views
    op.weight.mul_(2)
    assert torch.equal(op(x), 2 * y)


@needs_blocked
def test_batched_calls_keep_no_packed_copy_in_memory() -> None:
    """Eight 7 MiB weights called at 64 rows: a packed copy per weight (what oneDNN's own prepacking keeps)
    would add 56 MiB of resident memory; the view adds none."""
    g = _gen(6)
    ops = [DenseLinear(torch.randn(3072, 576, generator=g)).blocked() for _ in range(8)]
    x = torch.randn(64, 576, generator=g)
    for op in ops[:1]:
        op(x)  # warm-up: oneDNN's primitive cache, scratch buffers
    rss0 = _rss_bytes()
    for _ in range(2):
        for op in ops:
            op(x)
    growth = _rss_bytes() - rss0
    assert growth < 16 * 2**20, f"resident memory grew {growth / 2**20:.1f} MiB"


@needs_blocked
def test_placement_sees_exactly_the_weight_bytes() -> None:
    """The layout (and its md tensor and cached views) is shared metadata, not a weight the arena places."""
    b = torch.randn(960)
    op = DenseLinear(torch.randn(960, 576), b).blocked()
    op(torch.randn(64, 576))  # a cached view exists now (oneDNN runs above the crossover)
    assert [t.data_ptr() for t in weight_tensors(op)] == [op.weight.data_ptr(), op.bias.data_ptr()]
    assert arena_nbytes(op) == arena_nbytes(DenseLinear(torch.randn(960, 576), b))


@needs_blocked
def test_engine_layers_hold_blocked_weights_in_the_arena_and_generate_like_plain_ones(tiny) -> None:
    """A model with 64-multiple widths: every projection is blocked, lies in the arena, and greedy tokens equal
    those of the same layers with plain weights (fp32 sums in another order; the tiny model's margins are wide)."""
    big = make_tiny_model(seed=3, tokenizer=tiny.tokenizer, vocab_size=1024, hidden_size=512, intermediate_size=1024,
                          num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64)
    e = LLMEngine(EngineConfig(num_kv_blocks=32, block_size=16, max_num_batched_tokens=256, max_num_seqs=8),
                  loaded=big)
    arena = e.memory.arena
    lo, hi = arena.data_ptr(0), arena.data_ptr(arena.num_slots)
    for layer in e.model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            op = getattr(layer, name)
            assert op.layout is not None, name
            assert lo <= op.weight.data_ptr() < hi
    prompts = [[(11 * j + i) % 1000 + 3 for j in range(20 + 7 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    blocked = [o["token_ids"] for o in e.generate(prompts, params)]
    for layer in e.model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            op = getattr(layer, name)
            setattr(layer, name, DenseLinear(op.plain_weight().contiguous(), op.bias))
    e.reset_prefix_cache()
    assert [o["token_ids"] for o in e.generate(prompts, params)] == blocked


@needs_blocked
def test_cached_views_are_bounded_and_stay_correct(monkeypatch) -> None:
    """Weights placed afresh at new addresses (evaluation copies) do not grow the view cache without bound."""
    monkeypatch.setattr(linear_module, "MAX_CACHED_VIEWS", 2)
    g = _gen(9)
    ws = [torch.randn(960, 576, generator=g) for _ in range(5)]
    ops = [DenseLinear(w).blocked() for w in ws]
    x = torch.randn(64, 576, generator=g)  # above every crossover measured or defaulted (8 here): oneDNN's views
    layout = ops[0].layout
    assert all(op.layout is layout for op in ops)  # one layout per shape, shared with earlier tests' weights:
    layout.views.clear()  # their views can name addresses our weights now reuse (no insertion, no clearing)
    sizes = []
    for w, op in zip(ws, ops):
        _check_close(op(x), x, w)
        sizes.append(len(layout.views))
    assert sizes == [1, 2, 1, 2, 1]
    assert "views" not in repr(layout)  # a cached view may name freed bytes: printing one could read them
    layout.views.clear()
