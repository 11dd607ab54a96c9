"""8-bit KV blocks (serve/model/kv_format.py, serve/model/kv_cache.py) and the int8 decode kernel
(attention_q8_avx2.cpp): the block layout's bytes, the write/read round trip per format within its rounding bound,
and the kernel against float64 attention over the same stored K/V dequantized."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from serve.model import kernels
from serve.model.kv_cache import PagedKVCache, kv_bytes_per_block
from serve.model.kv_format import KVLayout, check_kv_cache_dtype, dequantize, quantize

OPS = kernels.ops()
needs_ops = pytest.mark.skipif(OPS is None, reason=f"CPU kernels unavailable: {kernels.describe()}")
SMOLLM2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, kv_size=192)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cfg(layers: int = 2, kvh: int = 2, hd: int = 32) -> SimpleNamespace:
    return SimpleNamespace(num_layers=layers, num_kv_heads=kvh, head_dim=hd, kv_size=kvh * hd)


def test_an_int8_block_of_smollm2_is_a_quarter_of_an_fp32_one_with_its_scales() -> None:
    """30 layers x 3 kv heads x 64 x 16 tokens: 184,320 bytes of codes + 11,520 of fp32 scales, padded to whole
    3,072-byte entries (one layer's K codes of a block): 196,608 bytes, 3.75x fewer than the 737,280 of fp32."""
    fp32 = kv_bytes_per_block(SMOLLM2, 16, torch.float32)
    int8 = KVLayout.of(SMOLLM2, 16, torch.float32, "int8")
    assert fp32 == 737_280
    assert (int8.code_bytes, int8.scale_bytes, int8.unit, int8.block_bytes) == (184_320, 11_520, 3_072, 196_608)
    assert fp32 / int8.block_bytes == 3.75
    assert (int8.entries_per_block, int8.scale_entries_per_block, int8.scale_entry_offset) == (64, 1024, 960)
    # fp8 codes are bytes too; against bf16 (CUDA's dtype) the gain is 1.875x
    assert kv_bytes_per_block(SMOLLM2, 16, torch.bfloat16, "fp8") == 196_608
    assert kv_bytes_per_block(SMOLLM2, 16, torch.bfloat16) / 196_608 == 1.875


def test_fp8_kv_is_refused_on_cpu_and_unknown_formats_everywhere() -> None:
    check_kv_cache_dtype("int8", "cpu")
    check_kv_cache_dtype("fp8", "cuda")
    with pytest.raises(ValueError, match="fp8.*CUDA"):
        check_kv_cache_dtype("fp8", "cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        check_kv_cache_dtype("int4", "cpu")


def test_quantize_is_the_documented_rounding() -> None:
    x = torch.tensor([[[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]]])  # [1 token, 2 heads, 4]
    codes, scales = quantize(x, "int8")
    assert torch.allclose(scales, torch.tensor([[1.0 / 127, 0.0]]))
    assert codes.tolist() == [[[127, -64, 32, 0], [0, 0, 0, 0]]]  # -63.5 -> -64 (half to even), 31.75 -> 32
    codes, scales = quantize(x, "fp8")
    assert torch.allclose(scales, torch.tensor([[1.0 / 448, 0.0]]))
    assert codes.view(torch.float8_e4m3fn).float()[0, 0].tolist() == [448.0, -224.0, 112.0, 0.0]
    assert torch.allclose(dequantize(codes, scales, "fp8", torch.float32)[0, 0], x[0, 0], rtol=1e-6, atol=0)


def _write_random(kv: PagedKVCache, slots: torch.Tensor, layer: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    n, kvh, hd = slots.numel(), kv.rows.shape[1], kv.rows.shape[2]
    k = torch.randn(n, kvh, hd, generator=g) * torch.rand(n, kvh, 1, generator=g) * 4
    v = torch.randn(n, kvh, hd, generator=g)
    k[0, 0] = 0.0  # an all-zero row: scale 0, codes 0, read back exactly
    got = kv.write(layer, kv.locate(slots), k, v)
    return k, v, *got


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_write_read_round_trip_within_the_formats_rounding(fmt: str) -> None:
    """Tokens written at scattered slots of layer 1 read back (read_blocks, dequantized) within the format's
    rounding: int8 half a code step (absmax / 254) per element; e4m3 2^-4 of the value (3 mantissa bits) or half
    its subnormal step (scale * 2^-10). What write returns is exactly what a read gives back, and nothing else in
    the blocks changed (layer 0 and the other tokens stay zero)."""
    cfg, bs = _cfg(), 4
    kv = PagedKVCache.standalone(cfg, 6, bs, torch.device("cpu"), torch.float32, fmt)
    g = _gen(1)
    slots = torch.tensor([4 * bs, 4 * bs + 3, 1 * bs + 1, 2 * bs + 2, 5 * bs + 3])  # logical = physical here
    k, v, k_back, v_back = _write_random(kv, slots, 1, g)
    rk, rv = kv.read_blocks(1, kv.block_map[slots // bs].view(-1, 1))  # [n, bs, kvh, hd]
    offs = slots % bs
    read_k, read_v = rk[torch.arange(len(slots)), offs], rv[torch.arange(len(slots)), offs]
    assert torch.equal(read_k, k_back) and torch.equal(read_v, v_back)
    for x, y in ((k, read_k), (v, read_v)):
        absmax = x.abs().amax(-1, keepdim=True)
        if fmt == "int8":
            bound = absmax / 254 * (1 + 1e-5)
        else:
            bound = torch.maximum(x.abs() * 2.0**-4, absmax / 448 * 2.0**-10) * (1 + 1e-5)
        assert ((x - y).abs() <= bound).all(), float(((x - y).abs() - bound).max())
    assert torch.equal(read_k[0, 0], torch.zeros_like(read_k[0, 0]))
    k0, v0 = kv.read_blocks(0, torch.arange(6).view(-1, 1))
    assert not k0.any() and not v0.any()
    written = torch.zeros(6 * bs, dtype=torch.bool)
    written[kv.block_map[slots // bs] * bs + offs] = True
    k1, v1 = kv.read_blocks(1, torch.arange(6).view(-1, 1))
    assert not k1.reshape(6 * bs, -1)[~written].any() and not v1.reshape(6 * bs, -1)[~written].any()


def test_an_8bit_cache_refuses_storage_that_is_not_whole_blocks() -> None:
    cfg = _cfg()
    block = KVLayout.of(cfg, 4, torch.float32, "int8").block_bytes
    with pytest.raises(ValueError, match="whole blocks"):
        PagedKVCache.quantized(cfg, 4, torch.zeros(block + 64, dtype=torch.uint8), 2, "int8", torch.float32)
    with pytest.raises(ValueError, match="8-bit"):
        PagedKVCache.quantized(cfg, 4, torch.zeros(block, dtype=torch.uint8), 1, "auto", torch.float32)


def _f64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """One query token [heads * hd] over k, v [n, kvh, hd] (GQA), float64."""
    kvh, hd = k.shape[1], k.shape[2]
    qb = q.view(kvh, group, 1, hd).double()
    kb, vb = k.transpose(0, 1).double()[:, None], v.transpose(0, 1).double()[:, None]
    return (torch.softmax((qb @ kb.transpose(-1, -2)) * scale, -1) @ vb).reshape(-1)


@needs_ops
@pytest.mark.parametrize(("group", "hd"), [(1, 64), (3, 64), (4, 72), (7, 32)])
@pytest.mark.parametrize("lens", [[1], [16], [17, 5, 40], [3, 64, 33, 16, 1], [9] * 5])
def test_int8_decode_kernel_matches_attention_over_the_dequantized_blocks(group: int, hd: int, lens: list[int]) -> None:
    """The int8 kernel reads codes and scales where they lie (scattered physical blocks, layer 1 of 2) and equals
    float64 attention over the same blocks dequantized (read_blocks), per row only its own ``len`` tokens. The
    scales vary by token and head over two orders of magnitude, so a scale applied to the wrong token or head (or
    K's scale used for V) is far outside the bound."""
    g = _gen(group * 100 + sum(lens) + hd)
    cfg, bs, B = _cfg(kvh=2, hd=hd), 16, len(lens)
    nb = max(-(-n // bs) for n in lens)
    num = 3 * B * nb
    kv = PagedKVCache.standalone(cfg, num, bs, torch.device("cpu"), torch.float32, "int8")
    for layer in range(2):
        slots = torch.arange(num * bs)
        k = torch.randn(len(slots), 2, hd, generator=g) * torch.exp(torch.randn(len(slots), 2, 1, generator=g) * 1.5)
        v = torch.randn(len(slots), 2, hd, generator=g) * torch.exp(torch.randn(len(slots), 2, 1, generator=g) * 1.5)
        kv.write(layer, kv.locate(slots), k, v)
    perm = torch.randperm(num, generator=g)[: B * nb].view(B, nb)  # physical blocks, scattered
    q = torch.randn(B, 2 * group * hd, generator=g)
    y = kv.paged_decode(OPS, q, kv.decode_index(perm), 1, torch.tensor(lens), 0.125)
    kd, vd = kv.read_blocks(1, perm)
    for b, n in enumerate(lens):
        ref = _f64_attention(q[b], kd[b, :n], vd[b, :n], group, 0.125)
        assert torch.allclose(y[b].double(), ref, atol=1e-5, rtol=1e-5), float((y[b].double() - ref).abs().max())


@needs_ops
def test_int8_decode_kernel_rejects_bad_operands() -> None:
    cfg = _cfg(layers=1, kvh=1, hd=8)
    kv = PagedKVCache.standalone(cfg, 2, 4, torch.device("cpu"), torch.float32, "int8")
    q = torch.randn(1, 8)
    kind, entries, scales = kv.decode_index(torch.tensor([[0]]))
    assert kind == "q8"
    with pytest.raises(RuntimeError, match="lens"):
        kv.paged_decode(OPS, q, (kind, entries, scales), 0, torch.tensor([5]), 1.0)  # one block holds 4 tokens
    with pytest.raises(RuntimeError, match="k_index.*out of range"):
        kv.paged_decode(OPS, q, (kind, entries + 10_000, scales), 0, torch.tensor([2]), 1.0)
    with pytest.raises(RuntimeError, match="s_index.*out of range"):
        kv.paged_decode(OPS, q, (kind, entries, scales + 10_000), 0, torch.tensor([2]), 1.0)
    with pytest.raises(RuntimeError, match="codes must be"):
        OPS.paged_decode_attention_q8(q, kv.blocks.float(), kv.scale_blocks, entries, scales, 0, 1, torch.tensor([2]),
                                      1.0)
