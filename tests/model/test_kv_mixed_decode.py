"""The decode kernel over block tables that mix fp32 and int8 blocks (attention_mixed_avx2.cpp, the KV-precision
KV rung's tables): each block read in place from its own grid over the same arena bytes, against float64 attention and
torch SDPA over the same blocks read back (the dense path's values); bit for bit the single-format kernels on tables
of one format; :meth:`PagedKVCache.decode_index` sends a batch to the kernel that can read it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from serve.model import kernels
from serve.model.kv_cache import FULL_BLOCK, Q8_BLOCK, BlockStore, PagedKVCache, block_shape
from serve.model.kv_format import KVLayout

OPS = kernels.ops()
needs_ops = pytest.mark.skipif(OPS is None, reason=f"CPU kernels unavailable: {kernels.describe()}")
BS, LAYERS = 16, 2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mixed_cache(kvh: int, hd: int, slots: int, g: torch.Generator,
                 fmt: str = "int8") -> tuple[PagedKVCache, list[int], list[int]]:
    """A cache as the KV rung builds it: fp32 slots over an arena and an 8-bit grid over the same bytes. The first half
    of the slots serve fp32 blocks (in scattered order), the 8-bit blocks lying wholly in the second half's bytes
    serve 8-bit ones; every block of both layers is written through :meth:`PagedKVCache.write` with K and V whose
    magnitude varies by token and head over two orders (a scale read for the wrong token or head, or K's for V, is
    far outside the bounds). Returns the cache and the logical ids of its fp32 and of its 8-bit blocks."""
    cfg = SimpleNamespace(num_layers=LAYERS, num_kv_heads=kvh, head_dim=hd, kv_size=kvh * hd)
    storage = torch.zeros(slots, *block_shape(cfg, BS))
    layout = KVLayout.of(cfg, BS, torch.float32, fmt)
    buf = storage.view(-1).view(torch.uint8)
    buf = buf[: buf.numel() // layout.unit * layout.unit]
    slot_bytes, half = storage[0].numel() * 4, slots // 2
    q8_blocks = [p for p in range(buf.numel() // layout.block_bytes) if p * layout.block_bytes >= half * slot_bytes]
    full_slots = torch.randperm(half, generator=g).tolist()
    kv = PagedKVCache(cfg, BS, storage, len(full_slots) + len(q8_blocks), BlockStore.quantized(layout, buf))
    kv.map_blocks(0, full_slots, FULL_BLOCK)
    kv.map_blocks(len(full_slots), q8_blocks, Q8_BLOCK)
    tokens = torch.arange(kv.max_blocks * BS)
    for layer in range(LAYERS):
        k, v = (torch.randn(len(tokens), kvh, hd, generator=g) * torch.exp(torch.randn(len(tokens), kvh, 1, generator=g)
                                                                             * 1.5) for _ in range(2))
        kv.write(layer, kv.locate(tokens), k, v)
    return kv, list(range(len(full_slots))), list(range(len(full_slots), kv.max_blocks))


def _tables(lens: list[int], full: list[int], q8: list[int], g: torch.Generator, formats: str) -> torch.Tensor:
    """Logical block tables [B, nb] of distinct blocks, each block's format drawn at random (``mixed``; at least
    one of each in the batch, the longest row's first two blocks) or all of one (``full`` / ``q8``)."""
    nb = max(-(-n // BS) for n in lens)
    pools = {FULL_BLOCK: [full[i] for i in torch.randperm(len(full), generator=g)],
             Q8_BLOCK: [q8[i] for i in torch.randperm(len(q8), generator=g)]}
    if formats != "mixed":
        fmts = torch.full((len(lens), nb), FULL_BLOCK if formats == "full" else Q8_BLOCK)
    else:
        fmts = torch.randint(0, 2, (len(lens), nb), generator=g)
        longest = max(range(len(lens)), key=lambda b: lens[b])
        if nb > 1:
            fmts[longest, :2] = torch.tensor([FULL_BLOCK, Q8_BLOCK])
        elif len(lens) > 1:
            fmts[:2, 0] = torch.tensor([FULL_BLOCK, Q8_BLOCK])
    return torch.tensor([[pools[int(f)].pop() for f in row] for row in fmts])


def _f64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """One query token [heads * hd] over k, v [n, kvh, hd] (GQA), float64."""
    kvh, hd = k.shape[1], k.shape[2]
    qb = q.view(kvh, group, 1, hd).double()
    kb, vb = k.transpose(0, 1).double()[:, None], v.transpose(0, 1).double()[:, None]
    return (torch.softmax((qb @ kb.transpose(-1, -2)) * scale, -1) @ vb).reshape(-1)


SHAPES = [(3, 3, 64), (1, 2, 64), (4, 2, 72), (7, 2, 32)]
"""(query heads per kv head, kv heads, head_dim): SmolLM2-135M's GQA first, then every register-tile remainder."""
MIXED_LENS = [[33], [17, 5, 40], [3, 64, 33, 16, 1], [9] * 5, [100, 1, 47]]
"""Batches > 1 and one long sequence; partial last blocks; [9] * 5 mixes formats across tables of one block each."""


@needs_ops
@pytest.mark.parametrize(("group", "kvh", "hd"), SHAPES)
@pytest.mark.parametrize("lens", MIXED_LENS)
def test_the_mixed_kernel_equals_attention_over_the_blocks_read_back(group: int, kvh: int, hd: int,
                                                                     lens: list[int]) -> None:
    """Random formats per block (a table mixing them, layer 1 of 2): the kernel equals float64 attention over the
    blocks as the dense path reads them (read_blocks: fp32 as stored, int8 dequantized), per row only its own
    ``len`` tokens, and the dense path itself (SDPA under the length mask), to the bound of the single-format
    kernels' tests."""
    g = _gen(group * 1000 + kvh * 100 + sum(lens) + hd)
    nb = max(-(-n // BS) for n in lens)
    kv, full, q8 = _mixed_cache(kvh, hd, 4 * len(lens) * nb + 4, g)
    tables = _tables(lens, full, q8, g, "mixed")
    blocks, formats = kv.block_map[tables], kv.block_format[tables]
    assert bool((formats == Q8_BLOCK).any()) and bool((formats == FULL_BLOCK).any())
    index = kv.decode_index(blocks, formats)
    assert index[0] == "mixed"
    q = torch.randn(len(lens), kvh * group * hd, generator=g)
    lens_t = torch.tensor(lens)
    y = kv.paged_decode(OPS, q, index, 1, lens_t, 0.125)
    kd, vd = kv.read_blocks(1, blocks, formats)  # [B, nb * BS, kvh, hd]
    for b, n in enumerate(lens):
        ref = _f64_attention(q[b], kd[b, :n], vd[b, :n], group, 0.125)
        assert torch.allclose(y[b].double(), ref, atol=1e-5, rtol=1e-5), float((y[b].double() - ref).abs().max())
    mask = (torch.arange(nb * BS)[None, :] < lens_t[:, None]).view(-1, 1, 1, nb * BS)
    dense = F.scaled_dot_product_attention(q.view(-1, kvh, group, hd), kd.transpose(1, 2), vd.transpose(1, 2),
                                           attn_mask=mask, scale=0.125).reshape(y.shape)
    assert torch.allclose(y, dense, atol=1e-5, rtol=1e-5), float((y - dense).abs().max())


@needs_ops
@pytest.mark.parametrize(("group", "kvh", "hd"), SHAPES)
@pytest.mark.parametrize("lens", [[1], [16], [17, 5, 40], [3, 64, 33, 16, 1]])
def test_on_a_table_of_one_format_the_mixed_kernel_is_that_formats_kernel_bit_for_bit(group: int, kvh: int, hd: int,
                                                                                      lens: list[int]) -> None:
    """The same blocks read by the mixed kernel (told every block's format) and by the fp32 or the int8 kernel give
    identical outputs: the shared helpers do each format's arithmetic in the same order. decode_index itself sends
    such a batch to the single-format kernel."""
    g = _gen(group * 1000 + kvh * 100 + sum(lens) + hd + 7)
    nb = max(-(-n // BS) for n in lens)
    kv, full, q8 = _mixed_cache(kvh, hd, 4 * len(lens) * nb + 4, g)
    q, lens_t = torch.randn(len(lens), kvh * group * hd, generator=g), torch.tensor(lens)
    for formats, kind in (("full", "full"), ("q8", "q8")):
        tables = _tables(lens, full, q8, g, formats)
        blocks, fmts = kv.block_map[tables], kv.block_format[tables]
        index = kv.decode_index(blocks, fmts)
        assert index[0] == kind
        entries = index[1]
        scale_entries = index[2] if kind == "q8" else torch.zeros_like(entries)
        mixed = OPS.paged_decode_attention_mixed(q, kv.full.blocks, kv.q8.blocks, kv.q8.scale_blocks, entries,
                                                 scale_entries, (fmts == Q8_BLOCK).to(torch.uint8), 1, LAYERS, lens_t,
                                                 0.125)
        assert torch.equal(mixed, kv.paged_decode(OPS, q, index, 1, lens_t, 0.125)), kind


@needs_ops
def test_decode_index_sends_fp8_mixed_batches_to_the_dense_path() -> None:
    """No CPU kernel reads fp8 codes: a batch mixing fp32 and fp8 blocks, like an all-fp8 one, gets no index (the
    dense path attends); the same tables over an int8 grid get the mixed kernel's."""
    g = _gen(8)
    for fmt, kinds in (("fp8", (None, None)), ("int8", ("mixed", "q8"))):
        kv, full, q8 = _mixed_cache(2, 32, 12, g, fmt)
        tables = _tables([20, 40], full, q8, g, "mixed")
        only8 = _tables([20, 40], full, q8, g, "q8")
        got = [kv.decode_index(kv.block_map[t], kv.block_format[t]) for t in (tables, only8)]
        assert tuple(None if i is None else i[0] for i in got) == kinds


@needs_ops
def test_the_mixed_kernel_rejects_bad_operands() -> None:
    """Each block's entries are checked against its own format's grid (an fp32 entry fine in the 8-bit grid, which
    has more entries, is out of range of the fp32 one), scales only for 8-bit blocks; lengths, shapes, dtypes."""
    g = _gen(9)
    kv, full, q8 = _mixed_cache(1, 8, 6, g)
    tables = torch.tensor([[full[0], q8[0]]])
    kind, entries, scale_entries, is8 = kv.decode_index(kv.block_map[tables], kv.block_format[tables])
    assert kind == "mixed" and is8.tolist() == [[0, 1]]
    q, lens = torch.randn(1, 8), torch.tensor([20])

    def call(e=entries, s=scale_entries, f=is8, n=lens, codes=kv.q8.blocks):
        return OPS.paged_decode_attention_mixed(q, kv.full.blocks, codes, kv.q8.scale_blocks, e, s, f, 0, LAYERS, n,
                                                1.0)

    call()
    assert kv.q8.blocks.shape[0] > kv.full.blocks.shape[0] + LAYERS
    past_fp32 = entries.clone()
    past_fp32[0, 0] = kv.full.blocks.shape[0]  # inside the 8-bit grid, not the fp32 one
    with pytest.raises(RuntimeError, match=r"k_index\[0, 0\].*fp32 grid"):
        call(e=past_fp32)
    with pytest.raises(RuntimeError, match=r"k_index\[0, 1\].*8-bit grid"):
        call(e=entries + torch.tensor([[0, 10_000]]))
    call(s=scale_entries + torch.tensor([[10_000, 0]]))  # an fp32 block's scale entry is never read
    with pytest.raises(RuntimeError, match=r"s_index\[0, 1\]"):
        call(s=scale_entries + torch.tensor([[0, 10_000]]))
    with pytest.raises(RuntimeError, match="lens"):
        call(n=torch.tensor([33]))  # two blocks of 16
    with pytest.raises(RuntimeError, match="is8 must be"):
        call(f=is8.bool())
    with pytest.raises(RuntimeError, match="codes must be"):
        call(codes=kv.q8.blocks[:, :8])
