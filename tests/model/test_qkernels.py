"""Our AVX2 int8 / int4 / fp32 CPU kernels (serve.model.kernels) against a float64 reference of the same weights.

Reference: the dequantized weight (integer codes times bf16 scales, plus zero points, exactly as stored)
times x, in float64. The kernels accumulate in fp32, so the allowed error per output is a few fp32 units
of sum_k |x_k w_k| (the kernel sums per group, then scales: K * 2**-24 relative is a loose bound; measured
errors are ~1e-7 relative). Shapes are odd on purpose: row counts that are not multiples of 16, K with an
int8 tail, batch sizes around the 4-row tile and above SMALL_BATCH (dequantize + GEMM path).
"""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from serve.model import crossovers, kernels
from serve.model import linear as linear_module
from serve.model import quantized_linear as ql
from serve.model.kv_cache import PagedKVCache, block_shape
from serve.model.linear import ConcatLinear, DenseLinear, linear
from serve.model.quantized_linear import Int4WeightOnly, pack_int4_blocked, unpack_int4_blocked
from serve.model.rtn import quantize_int4_rtn, quantize_int8_rtn

torch.set_num_threads(2)  # the kernels split rows over torch's threads: exercise the split

OPS = kernels.ops()
needs_ops = pytest.mark.skipif(OPS is None, reason=f"quantized CPU kernels unavailable: {kernels.describe()}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """``y`` (fp32) vs ``x @ w.T (+ bias)`` in float64, per element within 8 * K fp32 units of sum |x||w| (with a
    bias: 8 * (K + 1) units of sum |x||w| + |bias|)."""
    ref = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    k = x.shape[-1]
    if bias is not None:
        ref, scale, k = ref + bias.double(), scale + bias.double().abs(), k + 1
    assert y.dtype == torch.float32 and y.shape == ref.shape
    bound = 8 * k * 2.0**-24 * scale + 1e-30
    assert ((y.double() - ref).abs() <= bound).all(), float(((y.double() - ref).abs() / scale).max())


def test_kernels_build_on_an_avx2_machine_with_a_compiler() -> None:
    """CI and this machine have AVX2 + gcc: a broken build must fail here, not silently fall back."""
    if not kernels.cpu_supported() or shutil.which("g++") is None:
        pytest.skip("no AVX2 or no compiler: torch's kernels are the expected path")
    if os.environ.get("MORPHSERVE_QKERNELS"):
        pytest.skip("MORPHSERVE_QKERNELS set")
    assert OPS is not None, kernels.describe()
    label = {"avx2": "AVX2", "avx512": "AVX-512"}[kernels.isa_name()]
    assert kernels.describe().startswith(f"morphserve {label} ")


@needs_ops
@pytest.mark.parametrize("n,k", [(1, 16), (17, 48), (100, 40), (576, 576), (33, 1536)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9])
def test_int8_kernel_matches_float_reference(n: int, k: int, m: int) -> None:
    g = _gen(n * 1000 + k + m)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) * 0.02 + 1e-3).bfloat16()
    x = torch.randn(m, k, generator=g)
    y = OPS.int8_linear(x, q, scales)
    _check_close(y, x, q.float() * scales.float()[:, None])


@needs_ops
@pytest.mark.parametrize("n,k", [(1, 8), (3, 13), (17, 48), (130, 576), (33, 1537)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 32, 61])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_kernel_matches_float_reference(n: int, k: int, m: int, with_bias: bool) -> None:
    """Every register tile (4 x 3 and the 1-3 row / 1-2 column remainders) and the masked K tail."""
    g = _gen(n * 7919 + k * 31 + m)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    y = OPS.fp32_linear(x, w, bias)
    _check_close(y - (bias if bias is not None else 0.0), x, w)


@needs_ops
def test_fp32_kernel_rejects_bad_operands() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="x must be"):
        OPS.fp32_linear(torch.randn(2, 15), w)
    with pytest.raises(RuntimeError, match="w must be"):
        OPS.fp32_linear(torch.randn(2, 16), w.double())
    with pytest.raises(RuntimeError, match="bias must be"):
        OPS.fp32_linear(torch.randn(2, 16), w, torch.randn(7))


@needs_ops
@pytest.mark.parametrize(("limit", "m"), [(128, 1), (128, 128), (128, 129), (128, 300), (4, 4), (4, 5), (0, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_linear_uses_the_kernel_up_to_its_row_limit_and_onednn_above(limit: int, m: int, with_bias: bool,
                                                                          monkeypatch) -> None:
    """Up to the current ``fp32_kernel_max_rows`` (the default 128, or what this machine measured: here set to 4
    and 0) DenseLinear calls our kernel, above it oneDNN's matmul on the plain weights (both counted); each agrees
    with the float64 reference, and bf16 operands reach neither (F.linear)."""
    calls: list[tuple[str, int]] = []
    real = OPS.fp32_linear

    class Counting:
        def __getattr__(self, name):
            return getattr(OPS, name)

        @staticmethod
        def fp32_linear(x, w, b=None):
            calls.append(("ours", x.shape[0]))
            return real(x, w, b)

    def counting_onednn(x, w, b=None):
        calls.append(("oneDNN", x.shape[0]))
        return real_onednn(x, w, b)

    real_onednn = linear_module.onednn_linear
    monkeypatch.setattr(kernels, "ops", lambda: Counting())
    monkeypatch.setattr(linear_module, "onednn_linear", counting_onednn)
    g = _gen(m + with_bias)
    x, w = torch.randn(m, 96, generator=g), torch.randn(40, 96, generator=g)
    b = torch.randn(40, generator=g) if with_bias else None
    with crossovers.using(fp32_kernel_max_rows=limit):
        y = DenseLinear(w, b)(x)
        _check_close(y - (0 if b is None else b), x, w)
        above = "oneDNN" if linear_module.onednn_available() else None
        expected = [("ours", m)] if m <= limit else ([(above, m)] if above else [])
        assert calls == expected
        linear(x.bfloat16(), w.bfloat16())
    assert calls == expected


def test_onednn_linear_is_available_in_the_projects_torch() -> None:
    """The project's torch (CPU wheel) ships oneDNN's linear: prefill-sized fp32 GEMMs depend on it."""
    assert linear_module.onednn_available()


@needs_ops
@pytest.mark.parametrize(("group", "hd"), [(1, 64), (3, 64), (4, 72), (7, 32)])
@pytest.mark.parametrize("lens", [[1], [16], [17, 5, 40], [3, 64, 33, 16, 1], [9] * 5])
def test_paged_decode_attention_matches_sdpa_over_gathered_blocks(group: int, hd: int, lens: list[int]) -> None:
    """The kernel reads K/V where they lie (scattered physical slots, layer 1 of 2) and equals SDPA over the
    same rows gathered densely, per row only its own ``len`` tokens (float64 reference). Group sizes and head
    dims cover every register-tile remainder; five sequences of two kv heads split across threads by sequence."""
    g = _gen(group * 100 + sum(lens) + hd)
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=hd, kv_size=2 * hd)
    bs, B, heads = 16, len(lens), 2 * group
    nb = max(-(-n // bs) for n in lens)
    storage = torch.randn(3 * B * nb, *block_shape(cfg, bs), generator=g)
    kv = PagedKVCache(cfg, bs, storage, storage.shape[0])
    perm = torch.randperm(storage.shape[0], generator=g)[: B * nb].view(B, nb)  # physical slots, scattered
    q = torch.randn(B, heads * hd, generator=g)
    y = OPS.paged_decode_attention(q, kv.blocks, kv.block_entries(0, perm), 1, kv.num_layers, torch.tensor(lens), 0.125)
    kd, vd = kv.read_blocks(1, perm)  # [B, nb * bs, kvh, hd]
    for b, n in enumerate(lens):
        qb = q[b].view(2, group, 1, hd).double()
        kb, vb = kd[b, :n].transpose(0, 1).double()[:, None], vd[b, :n].transpose(0, 1).double()[:, None]
        ref = torch.softmax((qb @ kb.transpose(-1, -2)) * 0.125, -1) @ vb
        assert torch.allclose(y[b].double(), ref.reshape(-1), atol=1e-5, rtol=1e-5)


@needs_ops
def test_paged_decode_attention_rejects_bad_lengths_and_indices() -> None:
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=8, kv_size=8)
    kv = PagedKVCache.standalone(cfg, 2, 4, torch.device("cpu"), torch.float32)
    q, idx = torch.randn(1, 8), torch.tensor([[0]])
    with pytest.raises(RuntimeError, match="lens"):
        OPS.paged_decode_attention(q, kv.blocks, idx, 0, 1, torch.tensor([5]), 1.0)  # one block holds 4 tokens
    with pytest.raises(RuntimeError, match="out of range"):
        OPS.paged_decode_attention(q, kv.blocks, torch.tensor([[3]]), 0, 1, torch.tensor([2]), 1.0)


def _causal_attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[n, heads * hd]: query token i (the last n of k's L) and head h over keys 0..L - n + i of kv head
    h // (heads / kv_heads), in float64."""
    n, heads, hd = q.shape
    L, group = k.shape[0], heads // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("ihd,jhd->hij", q.double(), kk) * scale
    s = s.masked_fill(torch.ones(n, L, dtype=torch.bool).triu(L - n + 1), float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vv).reshape(n, heads * hd)


@needs_ops
@pytest.mark.parametrize(("group", "kv_heads", "hd"), [(1, 2, 64), (3, 3, 64), (4, 1, 72), (7, 2, 32), (2, 1, 8)])
@pytest.mark.parametrize(("n", "cached"),
                         [(1, 0), (5, 0), (16, 0), (17, 0), (47, 0), (100, 0), (1, 30), (20, 5), (33, 64)])
def test_prompt_attention_matches_causal_attention_in_float64(group: int, kv_heads: int, hd: int, n: int,
                                                              cached: int) -> None:
    """Causal attention of n query tokens after ``cached`` ones, read from the strided q/k/v of fused qkv rows (as
    the engine passes a whole prompt; a later chunk passes the gathered context), equals float64 causal softmax
    attention and writes exactly its rows of ``out``. Token counts cover one and several query tiles (16 tokens)
    with partial ones; group sizes and head dims every register-tile remainder."""
    g = _gen(1000 * group + 10 * n + hd + cached)
    heads, L = group * kv_heads, cached + n
    qkv = torch.randn(L, (heads + 2 * kv_heads) * hd, generator=g)
    q = qkv[cached:, : heads * hd].view(n, heads, hd)
    k = qkv[:, heads * hd: (heads + kv_heads) * hd].view(L, kv_heads, hd)
    v = qkv[:, (heads + kv_heads) * hd:].view(L, kv_heads, hd)
    out = torch.full((n + 4, heads * hd), float("nan"))
    OPS.prefill_attention_(q, k, v, out[2: n + 2], 0.125)
    assert torch.allclose(out[2: n + 2].double(), _causal_attention_f64(q, k, v, 0.125), atol=1e-5, rtol=1e-5)
    assert out[:2].isnan().all() and out[n + 2:].isnan().all()


@needs_ops
def test_prompt_attention_rejects_bad_shapes() -> None:
    q, kv, out = torch.randn(4, 6, 16), torch.randn(4, 2, 16), torch.empty(4, 96)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        OPS.prefill_attention_(q, torch.randn(4, 4, 16), torch.randn(4, 4, 16), out, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        OPS.prefill_attention_(torch.randn(4, 6, 12), torch.randn(4, 2, 12), torch.randn(4, 2, 12), torch.empty(4, 72),
                               1.0)
    with pytest.raises(RuntimeError, match="out must be"):
        OPS.prefill_attention_(q, kv, kv, torch.empty(3, 96), 1.0)
    with pytest.raises(RuntimeError, match="heads adjacent"):
        OPS.prefill_attention_(torch.randn(6, 4, 16).transpose(0, 1), kv, kv, out, 1.0)
    with pytest.raises(RuntimeError, match="k must hold"):
        OPS.prefill_attention_(q, torch.randn(3, 2, 16), kv, out, 1.0)
    with pytest.raises(RuntimeError, match="v must be"):
        OPS.prefill_attention_(q, torch.randn(5, 2, 16), kv, out, 1.0)


@needs_ops
def test_engine_attends_prompt_chunks_with_the_kernel_and_generates_like_sdpa(tiny) -> None:
    """Every prompt chunk goes through the kernel once per layer (whole prompts, the later chunk of a prompt the
    token budget splits, and the uncached tail of a prompt whose prefix is cached), and greedy tokens equal those
    of the SDPA path."""
    from serve.config import EngineConfig
    from serve.engine.engine import LLMEngine
    from serve.engine.sampling_params import SamplingParams
    from serve.model.random_model import make_tiny_model

    model = make_tiny_model(seed=5, tokenizer=tiny.tokenizer, vocab_size=1024, hidden_size=192, intermediate_size=256,
                            num_layers=2, num_heads=6, num_kv_heads=2, head_dim=32)
    e = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=128, max_num_seqs=8),
                  loaded=model)
    kernel = e.model.prompt_attention
    assert kernel is not None
    calls: list[int] = []

    class Counting:
        def prefill_attention_(self, q, *args):
            calls.append(q.shape[0])
            return kernel.prefill_attention_(q, *args)

    e.model.prompt_attention = Counting()
    prompts = [[(13 * j + i) % 1000 + 3 for j in range(n)] for i, n in enumerate((1, 17, 40, 77, 150))]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with_kernel = [o["token_ids"] for o in e.generate(prompts, params)]
    # every prompt token's query once per layer, in more chunks than prompts (150 > the budget of 128 per step)
    assert sum(calls) == 2 * sum(map(len, prompts)) and len(calls) > 2 * len(prompts), calls
    calls.clear()
    tail = [prompts[3] + [7, 8, 9]]  # 80 tokens: the 77-token prompt's 4 full blocks of 16 cached, 16 new ones
    with_cache = [o["token_ids"] for o in e.generate(tail, params)]
    assert calls == [16] * 2, calls
    e.model.prompt_attention = None
    e.reset_prefix_cache()
    assert [o["token_ids"] for o in e.generate(prompts, params)] == with_kernel
    assert [o["token_ids"] for o in e.generate(tail, params)] == with_cache  # the same prefix cached again


@needs_ops
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (7, 576), (300, 64), (3, 13)])
def test_rms_norm_kernels_match_the_float64_formula(rows: int, hidden: int) -> None:
    """rms_norm and add_rms_norm_ (h += delta in place, then the norm) against HF's formula in float64;
    300 rows split over the threads, hidden 13 has a tail past the last 8-wide vector."""
    g = _gen(rows * 7 + hidden)
    h, delta, w = (torch.randn(rows, hidden, generator=g) * 3, torch.randn(rows, hidden, generator=g),
                   torch.randn(hidden, generator=g))

    def reference(x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        return w.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    assert torch.allclose(OPS.rms_norm(h, w, 1e-5).double(), reference(h), rtol=1e-6, atol=1e-6)
    expected_h = h + delta
    y = OPS.add_rms_norm_(h, delta, w, 1e-5)
    assert torch.equal(h, expected_h), "the residual add is done in place, in fp32, exactly"
    assert torch.allclose(y.double(), reference(expected_h), rtol=1e-6, atol=1e-6)


@needs_ops
def test_rms_norm_kernels_reject_bad_inputs() -> None:
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="weight"):
        OPS.rms_norm(x, torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        OPS.rms_norm(x.t(), torch.randn(2), 1e-5)
    with pytest.raises(RuntimeError, match="delta"):
        OPS.add_rms_norm_(x, torch.randn(3, 8), w, 1e-5)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        OPS.add_rms_norm_(x.bfloat16(), x, w, 1e-5)


@needs_ops
@pytest.mark.parametrize("n,k,group", [(1, 32, 32), (17, 96, 32), (50, 576, 64), (31, 1536, 128), (16, 512, 256)])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
@pytest.mark.parametrize("zeros", [False, True])
def test_int4_kernel_matches_float_reference(n: int, k: int, group: int, m: int, zeros: bool) -> None:
    g = _gen(n * 1000 + k + m + zeros)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=g) * 0.02 + 1e-3
    zero = torch.randn(k // group, n, generator=g) * 0.01 if zeros else torch.zeros(k // group, n)
    sz = torch.stack([scales, zero], dim=-1).bfloat16().contiguous()
    packed = pack_int4_blocked(codes)
    assert packed.shape == (n, k // 2) and torch.equal(unpack_int4_blocked(packed), codes)
    s, z = (t.float().t().repeat_interleave(group, dim=1) for t in (sz[..., 0], sz[..., 1]))
    w = (codes.float() - 8) * s + z
    x = torch.randn(m, k, generator=g)
    _check_close(OPS.int4_linear(x, packed, sz, group), x, w)
    assert torch.equal(OPS.int4_dequantize(packed, sz, group), w), "dequantize is bit-identical to the formula"


def _q8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """The activations the int8-activation kernels multiply: x rounded to int8 blocks of 32, as fp32."""
    q, d = OPS.q8_quantize(x.contiguous())
    return (q.float().view(x.shape[0], -1, 32) * d.unsqueeze(-1)).view(x.shape)


@needs_ops
@pytest.mark.parametrize("m", [1, 5, ql.SMALL_BATCH, ql.SMALL_BATCH + 3])
@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_layers_use_the_kernels_and_match_their_dequantized_weights(m: int, activations: str, monkeypatch) -> None:
    """Through the layer classes: small batches (GEMV, int8 or fp32 activations) and large ones (dequantize +
    GEMM, always fp32), fp32 and bf16 activations, AWQ pre_quant_scale folded into the reference."""
    monkeypatch.setenv("MORPHSERVE_QACTIVATIONS", activations)
    g = _gen(m)
    w = torch.randn(80, 576, generator=g) * 0.05
    x = torch.randn(m, 576, generator=g)
    int8 = quantize_int8_rtn(w)
    int4 = quantize_int4_rtn(w, 64)
    assert int4.layout == "avx2"
    pqs = torch.rand(576, generator=g) + 0.5
    scales, zeros = int4.scales_and_zeros()
    awq = Int4WeightOnly.from_codes(int4.codes(), scales, 64, zeros, pre_quant_scale=pqs)
    rounded = activations == "int8" and m <= ql.SMALL_BATCH
    for layer, weight, x_in in ((int8, int8.dequantize(), x), (int4, int4.dequantize(), x),
                                (awq, int4.dequantize(), x * pqs)):
        _check_close(layer(x), _q8_round_trip(x_in) if rounded else x_in, weight)
        # 2-D contiguous fp32 decode inputs take the short path (_q8_gemv_input), a 3-D view the general one
        assert ql._q8_gemv_input(x, 576) == rounded
        assert torch.equal(layer(x), layer(x[None])[0])
        yb = layer(x.bfloat16())
        assert yb.dtype == torch.bfloat16
        y32 = layer(x.bfloat16().float())  # the same bf16 inputs in fp32: the bf16 output is y32 rounded
        assert ((yb.float() - y32).abs() <= 2**-8 * y32.abs()).all()


def test_int8_activations_setting_rejects_unknown_values(monkeypatch) -> None:
    monkeypatch.setenv("MORPHSERVE_QACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="int8 or fp32"):
        kernels.int8_activations()
    monkeypatch.delenv("MORPHSERVE_QACTIVATIONS")
    assert kernels.int8_activations(), "int8 activations are the default"


@needs_ops
@pytest.mark.parametrize("m,k", [(2, 32), (3, 576), (5, 1536)])
def test_q8_quantize_is_the_documented_rounding(m: int, k: int) -> None:
    """Bit for bit the formula in q8act_avx2.cpp: d = max|x| / 127, q = round-half-even(x * (127 / max|x|)),
    all-zero blocks stay zero; the kernels' dot products use exactly these values."""
    x = torch.randn(m, k, generator=_gen(m + k)) * torch.logspace(-3, 3, k)
    x[0, :32] = 0.0
    x[-1, -32:] = torch.tensor([0.5, -0.5, 1.5, 2.5] * 8) / 127  # ties round to even
    q, d = OPS.q8_quantize(x)
    blocks = x.view(m, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    assert torch.equal(q, torch.round(blocks * inv).to(torch.int8).view(m, k))
    assert torch.equal(d, (amax / 127.0).view(m, -1))
    assert q.abs().max() <= 127 and (q[0, :32] == 0).all()


@needs_ops
@pytest.mark.parametrize("n,k,group", [(1, 32, 32), (17, 96, 32), (50, 576, 64), (31, 1536, 128), (16, 512, 256)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("zeros", [False, True])
def test_int8_activation_kernels_match_the_reference_on_their_rounded_activations(n: int, k: int, group: int, m: int,
                                                                                 zeros: bool) -> None:
    """int4 / int8 weights times the int8-rounded activations, within the fp32 bound of the float64 reference
    (the integer products are exact; only the per-block scaling is fp32)."""
    g = _gen(n * 1000 + k + m + zeros)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=g) * 0.02 + 1e-3
    zero = torch.randn(k // group, n, generator=g) * 0.01 if zeros else torch.zeros(k // group, n)
    sz = torch.stack([scales, zero], dim=-1).bfloat16().contiguous()
    s, z = (t.float().t().repeat_interleave(group, dim=1) for t in (sz[..., 0], sz[..., 1]))
    x = torch.randn(m, k, generator=g)
    xr = _q8_round_trip(x)
    # the zero points multiply the exact fp32 sum of x (no rounding): split the reference accordingly
    y4 = OPS.int4_linear_q8(x, pack_int4_blocked(codes), sz, group)
    _check_close(y4 - x @ z.t(), xr, (codes.float() - 8) * s)
    q8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    q8[0, :5] = -128
    sc = (torch.rand(n, generator=g) * 0.01 + 1e-4).bfloat16()
    _check_close(OPS.int8_linear_q8(x, q8, sc), xr, q8.float() * sc.float()[:, None])
    with pytest.raises(RuntimeError, match="multiple of 32"):
        OPS.int8_linear_q8(torch.randn(m, 48), torch.zeros(n, 48, dtype=torch.int8), sc)


@needs_ops
def test_int4_concat_is_exact_and_keeps_bytes() -> None:
    g = _gen(7)
    parts = [quantize_int4_rtn(torch.randn(n, 576, generator=g), 64) for n in (576, 192, 192)]
    fused = Int4WeightOnly.concat(parts)
    assert fused is not None and fused.out_features == 960 and fused.nbytes == sum(p.nbytes for p in parts)
    x = torch.randn(3, 576, generator=g)
    assert torch.equal(fused(x), ConcatLinear(parts)(x))
    other_group = quantize_int4_rtn(torch.randn(16, 576, generator=g), 32)
    assert Int4WeightOnly.concat([parts[0], other_group]) is None
    pqs = [Int4WeightOnly.from_codes(p.codes(), *p.scales_and_zeros()[:1], 64,
                                     pre_quant_scale=torch.rand(576, generator=g) + 0.5) for p in parts[:2]]
    assert Int4WeightOnly.concat(pqs) is None, "different AWQ scales cannot share one activation scaling"


@needs_ops
def test_avx2_layout_round_trips_and_matches_torch_layout(monkeypatch) -> None:
    """Storage is the portable nibble layout whatever the kernel; the torch fallback layout gives the same
    codes and (to bf16 rounding) the same outputs (ours with fp32 activations: only torch's rounding counts)."""
    monkeypatch.setenv("MORPHSERVE_QACTIVATIONS", "fp32")
    g = _gen(11)
    codes = torch.randint(0, 16, (48, 128), generator=g, dtype=torch.int32)
    scales = torch.rand(48, 2, generator=g) + 0.1
    ours = Int4WeightOnly.from_codes(codes, scales, 64)
    again = Int4WeightOnly.from_tensors(ours.tensors(), ours.metadata())
    assert again.layout == "avx2" and torch.equal(again.packed, ours.packed) and torch.equal(again.codes(), codes)
    x = torch.randn(4, 128, generator=g)
    y_ours, w_ours = ours(x), ours.dequantize()
    monkeypatch.setattr(kernels, "ops", lambda: None)
    theirs = Int4WeightOnly.from_codes(codes, scales, 64)
    assert theirs.layout == "cpu" and torch.equal(theirs.codes(), codes)
    assert torch.equal(theirs.dequantize(), w_ours)
    rel = ((theirs(x) - y_ours).norm() / y_ours.norm()).item()
    assert rel < 6e-3  # torch's kernel: bf16 activations and outputs


def test_fallback_when_the_kernels_are_unavailable(monkeypatch) -> None:
    """With no kernels (no AVX2, build failed, MORPHSERVE_QKERNELS=torch) the layers run torch's kernels."""
    monkeypatch.setattr(kernels, "ops", lambda: None)
    w = torch.randn(32, 128, generator=_gen(5))
    x = torch.randn(3, 128, generator=_gen(6))
    for layer in (quantize_int8_rtn(w), quantize_int4_rtn(w, 64)):
        ref = x @ layer.dequantize().t()
        assert ((layer(x) - ref).norm() / ref.norm()).item() < 6e-3
    assert quantize_int4_rtn(w, 64).layout == "cpu"


def test_build_failure_falls_back_with_one_warning(monkeypatch, caplog) -> None:
    def broken(verbose: bool = False):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "build", broken)
    monkeypatch.delenv("MORPHSERVE_QKERNELS", raising=False)
    with caplog.at_level("WARNING", logger=kernels.__name__):
        assert kernels.ops() is None and kernels.ops() is None
    if kernels.cpu_supported():
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        assert "compiler exploded" in caplog.text and "torch" in kernels.describe()


# ------------------------------------------------------------------------------------- the int8-block LM head


@needs_ops
@pytest.mark.parametrize("n,k", [(1, 32), (19, 96), (100, 576)])
@pytest.mark.parametrize("m", [1, 3, 4, 6])
def test_int8_block_kernel_matches_float_reference(n: int, k: int, m: int) -> None:
    g = _gen(n + k + m)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    d = torch.rand(n, k // 32, generator=g) * 1e-2
    w = (q.float().view(n, -1, 32) * d.unsqueeze(-1)).view(n, k)
    x = torch.randn(m, k, generator=g)
    _check_close(OPS.int8_block_linear(x, q, d), x, w)
    with pytest.raises(RuntimeError, match="d must be"):
        OPS.int8_block_linear(x, q, torch.zeros(n, k // 32 + 1))


def test_int8_blocks_are_recovered_bit_for_bit_or_not_at_all() -> None:
    """GGUF Q8_0 data dequantized to fp32 (what the loader holds) gives back its int8 values and scales exactly;
    weights that were never int8 blocks, or that differ from them by one fp32 unit, are left alone."""
    import gguf
    import numpy as np

    from serve.model.lm_head import int8_blocks

    x = np.random.default_rng(0).standard_normal((70, 96)).astype(np.float32)
    x[3, :32] = 0.0  # an all-zero block
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)))
    blocks = int8_blocks(w)
    assert blocks is not None
    q, d = blocks
    assert q.dtype == torch.int8 and d.shape == (70, 3)
    assert torch.equal((q.float().view(70, 3, 32) * d.unsqueeze(-1)).view(70, 96), w)
    nudged = w.clone()
    nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(float("inf")))
    assert int8_blocks(nudged) is None
    assert int8_blocks(torch.from_numpy(x)) is None
    assert int8_blocks(w[:, :40].contiguous()) is None, "K not a multiple of 32"


@needs_ops
def test_embedded_model_runs_its_q8_0_head_from_int8_blocks(smollm, monkeypatch) -> None:
    """The embedded GGUF's tied embedding is Q8_0: the model keeps its int8 blocks (counted in its bytes) and
    logits up to the current ``int8_head_max_rows`` (the default, or this machine's) come from them, matching the
    fp32 head within fp32 summation error; larger batches use the fp32 head."""
    from serve.model.llama import LlamaModel

    model = LlamaModel(smollm.config, smollm.weights, torch.device("cpu"), torch.float32, max_positions=64)
    assert model.int8_head is not None
    q, d = model.int8_head
    w = smollm.weights["model.embed_tokens.weight"]
    assert model.non_layer_nbytes == (w.nbytes + model.norm.nbytes + q.nbytes + d.nbytes
                                      + 2 * model.rope.cos.nbytes)
    calls: list[int] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(OPS, name)

        @staticmethod
        def int8_block_linear(x, q, d):
            calls.append(x.shape[0])
            return OPS.int8_block_linear(x, q, d)

    monkeypatch.setattr(kernels, "ops", lambda: Counting())
    for limit in (crossovers.DEFAULTS.int8_head_max_rows, 3):
        with crossovers.using(int8_head_max_rows=limit):
            for rows in (1, limit, limit + 1, 32):
                calls.clear()
                h = torch.randn(rows, smollm.config.hidden_size, generator=_gen(rows))
                _check_close(model.logits(h), h, w)
                assert calls == ([rows] if rows <= limit else []), (limit, rows)


@needs_ops
def test_tied_embedding_is_one_blocked_copy_that_serves_lookup_and_head(smollm) -> None:
    """The tied embedding is stored once, in oneDNN's blocked layout: token lookups gather exactly the plain rows
    from it (every id, including the last block's), and the head above the int8 rows is oneDNN on those bytes."""
    from serve.model.llama import LlamaModel

    model = LlamaModel(smollm.config, smollm.weights, torch.device("cpu"), torch.float32, max_positions=64)
    w = smollm.weights["model.embed_tokens.weight"]
    assert model.embedding is model.head and model.head.layout is not None
    assert model.head.weight.shape == (w.shape[0] // model.head.layout.block, w.shape[1], model.head.layout.block)
    ids = torch.cat([torch.arange(0, w.shape[0], 97), torch.tensor([w.shape[0] - 1, 0, 63, 64, 65])])
    assert torch.equal(model.embedding.weight_rows(ids), w[ids])
    assert torch.equal(model.embedding.weight_rows(ids.view(2, -1)), w[ids].view(2, -1, w.shape[1]))
    assert torch.equal(model.head.plain_weight(), w)


def test_the_ninja_binary_is_found_where_ninja_bin_dir_is_empty(monkeypatch) -> None:
    """The Dynamo venv sees the project venv's packages through a .pth file, and there ``ninja.BIN_DIR`` is "":
    the build then ran the system's ninja, whose build log the project's ninja discards (and back), so every
    switch recompiled the extension (~3 min). The project's binary must be found there too."""
    ninja = pytest.importorskip("ninja")
    found = kernels.project_ninja_dir()
    assert found is not None and os.path.isfile(os.path.join(found, "ninja"))
    monkeypatch.setattr(ninja, "BIN_DIR", "")
    assert kernels.project_ninja_dir() == found


@needs_ops
@pytest.mark.parametrize(("rows", "inter"), [(1, 16), (3, 1536), (37, 13), (300, 64)])
def test_silu_mul_is_bit_identical_to_torch(rows: int, inter: int) -> None:
    """The fused SwiGLU equals ``F.silu(gate) * up`` bit for bit (same formula, torch's own SLEEF exp) wherever
    torch runs its vector loop (widths that are a multiple of its vector length, as SmolLM2's 1536); torch
    computes a ragged tail with libm's expf instead, so there they agree to an ulp or two. Values from deep
    negative (exp underflow side) to large positive."""
    g = _gen(rows * 7 + inter)
    gu = torch.randn(rows, 2 * inter, generator=g) * 6
    gu[0, :4] = torch.tensor([-100.0, -88.5, 90.0, 0.0])
    ref = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    if inter % 16 == 0:
        assert torch.equal(OPS.silu_mul(gu), ref)
    else:
        torch.testing.assert_close(OPS.silu_mul(gu), ref, rtol=3e-7, atol=1e-37)
    with pytest.raises(RuntimeError, match="gu must be"):
        OPS.silu_mul(gu[:, :-1].contiguous())


@needs_ops
@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(9, 3, 64), (4, 4, 18), (2, 1, 6)])
def test_rope_kv_write_is_bit_identical_to_rotate_and_index_copy(heads: int, kv_heads: int, hd: int) -> None:
    """In place on the fused qkv rows: q and k rotated exactly as serve.model.rope.rotate does (torch ops), v left
    as is; k and v copied to exactly the KV rows kv.write's index_copy_ fills (layer offset, V offset), and no
    other row of the storage touched. Head dims with and without a vector body (tails of 1-3 lanes)."""
    from serve.model.rope import rotate

    g = _gen(heads * 100 + hd)
    T, width = 11, (heads + 2 * kv_heads) * hd
    qkv = torch.randn(T, width, generator=g)
    pos = torch.randint(0, 500, (T,), generator=g)
    angles = pos[:, None].float() * torch.rand(hd // 2, generator=g)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    storage = torch.randn(64, kv_heads, hd, generator=g)
    k_rows = torch.randperm(20, generator=g)[:T]
    layer_offset, v_offset = 3, 40
    ref_qk = rotate(qkv[:, : (heads + kv_heads) * hd].view(T, heads + kv_heads, hd), cos[:, None], sin[:, None])
    ref_v = qkv[:, (heads + kv_heads) * hd:].clone()
    ref_storage = storage.clone()
    ref_storage.index_copy_(0, k_rows + layer_offset, ref_qk[:, heads:])
    ref_storage.index_copy_(0, k_rows + layer_offset + v_offset, ref_v.view(T, kv_heads, hd))
    OPS.rope_kv_write_(qkv, cos, sin, heads, kv_heads, storage, k_rows, layer_offset, v_offset)
    assert torch.equal(qkv[:, : (heads + kv_heads) * hd], ref_qk.reshape(T, -1))
    assert torch.equal(qkv[:, (heads + kv_heads) * hd:], ref_v)
    assert torch.equal(storage, ref_storage)
    with pytest.raises(RuntimeError, match="out of range"):
        OPS.rope_kv_write_(qkv, cos, sin, heads, kv_heads, storage, k_rows, 60, v_offset)
    with pytest.raises(RuntimeError, match="qkv width"):
        OPS.rope_kv_write_(qkv[:, :-1].contiguous(), cos, sin, heads, kv_heads, storage, k_rows, 0, 0)


@needs_ops
@pytest.mark.parametrize(("heads", "kv_heads", "hd", "mixed"), [(9, 3, 64, True), (9, 3, 64, False), (2, 1, 6, True)])
def test_rope_kv_write_q8_equals_rotate_quantize_and_index_copy(heads: int, kv_heads: int, hd: int,
                                                                mixed: bool) -> None:
    """The int8 KV write: q and k rotated as rope.rotate does; each 8-bit token's k and v quantized exactly as
    kv_format.quantize does (codes and scales equal, at the rows and scale rows BlockStore.write fills), its k / v in
    qkv replaced by the dequantized values (kv_format.dequantize, bit for bit); fp32 tokens (mixed) copied to their
    fp32 rows; nothing else in either storage touched. Rows with ties (x * inv = n + 0.5), zeros and one all-zero
    head exercise the rounding and the zero scale."""
    from serve.model.kv_format import dequantize, quantize
    from serve.model.rope import rotate

    g = _gen(heads * 1000 + hd + mixed)
    T, width, kvw = 13, (heads + 2 * kv_heads) * hd, (heads + kv_heads) * hd
    qkv = torch.randn(T, width, generator=g) * 3
    qkv[2, kvw: kvw + hd] = 0.0  # an all-zero V head: scale 0, codes 0
    # a V head of absmax 127 (scale 1): its halves are ties, rounded to even (2.5 -> 2, -3.5 -> -4)
    qkv[4, kvw: kvw + hd] = torch.tensor([127.0] + [(j % 7) - 3 + 0.5 for j in range(hd - 1)])
    angles = torch.randint(0, 500, (T,), generator=g)[:, None].float() * torch.rand(hd // 2, generator=g)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    full = torch.randn(96, kv_heads, hd, generator=g)
    codes = torch.randint(-128, 128, (96, kv_heads, hd), generator=g, dtype=torch.int8)
    scales = torch.rand(90, kv_heads, generator=g)
    is8 = torch.rand(T, generator=g) < 0.6 if mixed else torch.ones(T, dtype=torch.bool)
    is8[2] = is8[4] = True
    k_rows = torch.randperm(30, generator=g)[:T]
    s_rows = torch.randperm(40, generator=g)[:T]
    layer_offset, v_offset = 2, 45
    ref_qk = rotate(qkv[:, :kvw].view(T, heads + kv_heads, hd), cos[:, None], sin[:, None]).reshape(T, -1)
    ref_k, ref_v = ref_qk[:, heads * hd:].reshape(T, kv_heads, hd), qkv[:, kvw:].reshape(T, kv_heads, hd).clone()
    ref_full, ref_codes, ref_scales = full.clone(), codes.clone(), scales.clone()
    q8, fp = is8.nonzero().view(-1), (~is8).nonzero().view(-1)
    ref_full.index_copy_(0, k_rows[fp] + layer_offset, ref_k[fp])
    ref_full.index_copy_(0, k_rows[fp] + layer_offset + v_offset, ref_v[fp])
    kc, ks = quantize(ref_k[q8], "int8")
    vc, vs = quantize(ref_v[q8], "int8")
    for c, sc, off in ((kc, ks, 0), (vc, vs, v_offset)):
        ref_codes.index_copy_(0, k_rows[q8] + layer_offset + off, c)
        ref_scales.index_copy_(0, s_rows[q8] + layer_offset + off, sc)
    ref_k8, ref_v8 = ref_k.clone(), ref_v.clone()
    ref_k8[q8], ref_v8[q8] = dequantize(kc, ks, "int8", torch.float32), dequantize(vc, vs, "int8", torch.float32)
    assert bool((vs == 0).any()) and bool((vs == 1).any())  # the zero head and the tie head are 8-bit
    OPS.rope_kv_write_q8_(qkv, cos, sin, heads, kv_heads, full if mixed else torch.empty(0), codes, scales, k_rows,
                          s_rows, is8 if mixed else torch.empty(0, dtype=torch.bool), layer_offset, v_offset)
    assert torch.equal(qkv[:, : heads * hd], ref_qk[:, : heads * hd])
    assert torch.equal(qkv[:, heads * hd: kvw].view(T, kv_heads, hd), ref_k8)
    assert torch.equal(qkv[:, kvw:].view(T, kv_heads, hd), ref_v8)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    if mixed:
        assert torch.equal(full, ref_full)
    with pytest.raises(RuntimeError, match="scale row of token"):
        OPS.rope_kv_write_q8_(qkv, cos, sin, heads, kv_heads, full, codes, scales, k_rows, s_rows + 60,
                              torch.ones(T, dtype=torch.bool), 0, 0)
    with pytest.raises(RuntimeError, match="KV row of token"):
        OPS.rope_kv_write_q8_(qkv, cos, sin, heads, kv_heads, torch.empty(0), codes, scales, k_rows, s_rows,
                              torch.zeros(T, dtype=torch.bool), 0, 0)


@needs_ops
@pytest.mark.parametrize("m", [5, 21])
def test_weight_only_kernels_compute_each_row_as_if_alone(m: int) -> None:
    """Rows computed together (several tiles of 4, over several 64-row weight sub-ranges: for_tiles) equal each row
    computed alone, bit for bit: a speculative verify reads the LM head's int8 blocks and morphed layers at k + 1
    rows per sequence and must round as the plain one-row step does. Not so the fp32-activation kernels
    (``int8_linear``, ``int4_linear``, used only with ``MORPHSERVE_QACTIVATIONS=fp32``): they split a row's sum into 4 /
    T chains by tile size T; there a verify over morphed layers may flip a near tie, which bench.speculation counts."""
    n, k, group = 200, 576, 64
    g = _gen(m * 7 + 3)
    x = torch.randn(m, k, generator=g)
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    d = torch.rand(n, k // 32, generator=g) * 1e-2
    sc = (torch.rand(n, generator=g) * 0.01 + 1e-4).bfloat16()
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    sz = torch.stack([torch.rand(k // group, n, generator=g) * 0.02 + 1e-3,
                      torch.randn(k // group, n, generator=g) * 0.01], dim=-1).bfloat16().contiguous()
    packed = pack_int4_blocked(codes)
    calls = {"int8_block_linear": lambda x: OPS.int8_block_linear(x, q8, d),
             "int8_linear_q8": lambda x: OPS.int8_linear_q8(x, q8, sc),
             "int4_linear_q8": lambda x: OPS.int4_linear_q8(x, packed, sz, group)}
    differ = [name for name, fn in calls.items()
              if not torch.equal(fn(x), torch.cat([fn(x[i:i + 1].contiguous()) for i in range(m)]))]
    assert differ == [], differ
