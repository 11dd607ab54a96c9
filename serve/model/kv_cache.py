"""Paged KV storage. A block holds K and V of every layer for ``block_size`` tokens in the engine's memory arena
(so a block can sit where a quantized layer's full weights used to be), in one of two formats
(serve/model/kv_format.py): full precision, a typed storage ``[slots, 2, layers, block_size, kv_heads, head_dim]``;
8-bit (int8 / fp8 codes followed by their fp32 scales), the arena's bytes cut into 8-bit blocks. Each format's
blocks form a grid of their own (:class:`BlockStore`): physical block p of a format lies at bytes
``[p * block_bytes, (p + 1) * block_bytes)`` of the storage. A cache holds one format (``kv_cache_dtype``: the
arena's slot is then exactly one block) or both over the same bytes (the KV precision rung: free full-precision
slots turned into 8-bit blocks, serve/engine/kv_rung.py), and ``block_format`` says which each logical block is.

The block pool hands out *logical* block ids (contiguous, in extents, LIFO; see serve/memory/block_pool.py);
``block_map`` says which physical block (in its format's grid) each one occupies. A token's slot index in the
scheduler's terms is ``logical_block * block_size + offset``; :meth:`locate` turns a tensor of those (where new
tokens are written) into (physical block, offset, format) once per forward, and every layer reuses it. Reads take
whole blocks: a block table of logical ids maps through ``block_map`` (and ``block_format``) for :meth:`read_blocks`.

Writes go through one flat row view per format (``[rows, kv_heads, head_dim]``; at full precision the storage
itself): a token's K row in layer ``l`` is ``block * rows_per_block + l * block_size + offset`` and its V row is
``layers * block_size`` further (an 8-bit block has ``entries_per_block * block_size`` rows, its padding and
scales included, so its rows are never written past the codes). A layer's write is then one ``index_copy_`` of
contiguous ``kv_heads * head_dim`` rows (and its gather one ``index_select`` of whole blocks, ``blocks``), instead
of advanced indexing over two index tensors, which costs several times more per call on CPU. An 8-bit write
quantizes the rows first and copies their scales the same way into the fp32 scale rows (``scale_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from serve.model.kv_format import KVLayout, dequantize, quantize
from serve.model.model_config import ModelConfig

FULL_BLOCK, Q8_BLOCK = 0, 1
"""``block_format`` values: a full-precision block, an 8-bit block."""


class HasLayout(Protocol):
    layout: KVLayout


class KVBlocks(Protocol):
    """What the pool's resource managers change in a KV cache: which physical block backs each logical one, in which
    format. :class:`PagedKVCache` here; the planner's ``SimKV`` (sim/bank.py), which stores no KV, keeps the same
    table. ``full`` / ``q8``: each format's blocks (their layout), None where the cache holds no such format."""

    full: HasLayout | None
    q8: HasLayout | None

    @property
    def mixes_formats(self) -> bool: ...

    def map_blocks(self, logical_start: int, physical_slots: list[int], block_format: int = FULL_BLOCK) -> None: ...

    def unmap_blocks(self, logical_start: int, count: int) -> None: ...

    def physical_slot(self, logical_block: int) -> int: ...

    def quantize_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Re-write the full-precision blocks in slots ``sources`` as 8-bit blocks ``targets`` (the KV rung)."""
        ...


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV block: at the engine's ``dtype`` (``auto``), or 8-bit codes with their scales."""
    return KVLayout.of(config, block_size, dtype, kv_cache_dtype).block_bytes


def block_shape(config: ModelConfig, block_size: int) -> tuple[int, ...]:
    """The shape of one full-precision slot viewed as KV: ``[2 (K, V), layers, block_size, kv_heads, head_dim]``."""
    return (2, config.num_layers, block_size, config.num_kv_heads, config.head_dim)


@dataclass
class BlockStore:
    """One format's views over its storage: ``rows`` for writes, ``blocks`` (one (block, K|V, layer) run of
    block_size rows per entry) for gathers and the decode kernels, and for 8-bit blocks their scales likewise."""

    layout: KVLayout
    rows: torch.Tensor
    blocks: torch.Tensor
    num_blocks: int
    scale_rows: torch.Tensor | None = None
    scale_blocks: torch.Tensor | None = None

    @classmethod
    def full(cls, config: ModelConfig, block_size: int, storage: torch.Tensor) -> BlockStore:
        expected = block_shape(config, block_size)
        if tuple(storage.shape[1:]) != expected:
            raise ValueError(f"KV storage slots must be {expected}, got {tuple(storage.shape[1:])}")
        return cls(KVLayout.of(config, block_size, storage.dtype), storage.view(-1, *expected[-2:]),
                   storage.view(-1, *expected[-3:]), storage.shape[0])

    @classmethod
    def quantized(cls, layout: KVLayout, buf: torch.Tensor) -> BlockStore:
        """8-bit blocks over the bytes ``buf`` (uint8; a whole number of entries of both views)."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() % layout.unit:
            raise ValueError(f"8-bit KV storage must be bytes in whole units of {layout.unit}, got {buf.dtype} "
                             f"{tuple(buf.shape)}")
        codes, scales = buf.view(torch.int8), buf.view(torch.float32)
        bs, kvh, hd = layout.block_size, layout.kv_heads, layout.head_dim
        return cls(layout, codes.view(-1, kvh, hd), codes.view(-1, bs, kvh, hd), buf.numel() // layout.block_bytes,
                   scales.view(-1, kvh), scales.view(-1, bs, kvh))

    @property
    def quantized_codes(self) -> bool:
        return self.layout.quantized

    @property
    def entries_per_block(self) -> int:
        return self.layout.entries_per_block if self.layout.quantized else 2 * self.layout.num_layers

    @property
    def rows_per_block(self) -> int:
        return self.entries_per_block * self.layout.block_size

    def rows_of(self, block: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        return block * self.rows_per_block + offset

    def scale_rows_of(self, block: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        return (block * lay.scale_entries_per_block + lay.scale_entry_offset) * lay.block_size + offset

    def entries(self, layer: int, block: torch.Tensor) -> torch.Tensor:
        return block * self.entries_per_block + layer

    def scale_entries(self, layer: int, block: torch.Tensor) -> torch.Tensor:
        return block * self.layout.scale_entries_per_block + self.layout.scale_entry_offset + layer

    def write(self, layer: int, rows: torch.Tensor, scale_rows: torch.Tensor | None, k: torch.Tensor,
              v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V rows of layer-0 ``rows`` (and scales at ``scale_rows``) for layer ``layer``; returns K/V as stored."""
        lay = self.layout
        k_rows, v_off = rows + layer * lay.block_size, lay.num_layers * lay.block_size
        if not lay.quantized:
            self.rows.index_copy_(0, k_rows, k)
            self.rows.index_copy_(0, k_rows + v_off, v)
            return k, v
        n = k.shape[0]
        codes, scales = quantize(torch.cat([k, v]), lay.kv_cache_dtype)
        self.rows.index_copy_(0, torch.cat([k_rows, k_rows + v_off]), codes)
        s_rows = scale_rows + layer * lay.block_size
        self.scale_rows.index_copy_(0, torch.cat([s_rows, s_rows + v_off]), scales)
        values = dequantize(codes, scales, lay.kv_cache_dtype, dtype)
        return values[:n], values[n:]

    def read(self, layer: int, block: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, block_size, kv_heads, head_dim]`` of the blocks ``block`` (1-D) in ``dtype``."""
        base, v_off = self.entries(layer, block), self.layout.num_layers
        k, v = self.blocks.index_select(0, base), self.blocks.index_select(0, base + v_off)
        if not self.layout.quantized:
            return k, v
        s = self.scale_entries(layer, block)
        ks, vs = self.scale_blocks.index_select(0, s), self.scale_blocks.index_select(0, s + v_off)
        fmt = self.layout.kv_cache_dtype
        return dequantize(k, ks, fmt, dtype), dequantize(v, vs, fmt, dtype)


@dataclass(frozen=True)
class KVIndex:
    """Where tokens' K/V live: physical block and offset in it (same shape as the slot indices), each token's
    layer-0 K row in its format's row view (and 8-bit: its layer-0 K scale row), and the formats: ``kind`` "full",
    "q8" or "mixed" (then ``is8`` says which tokens are 8-bit)."""

    slot: torch.Tensor
    offset: torch.Tensor
    row: torch.Tensor
    scale_row: torch.Tensor | None = None
    kind: str = "full"
    is8: torch.Tensor | None = None


class PagedKVCache:
    def __init__(self, config: ModelConfig, block_size: int, storage: torch.Tensor | None, max_logical_blocks: int,
                 quantized: BlockStore | None = None) -> None:
        """A full-precision cache over ``storage`` ``[slots, *block_shape]`` (None: 8-bit only, :meth:`quantized`);
        ``quantized``: 8-bit blocks over the same (or other) bytes, for blocks mapped with :data:`Q8_BLOCK`."""
        self.full = BlockStore.full(config, block_size, storage) if storage is not None else None
        self.q8 = quantized
        if self.full is None and self.q8 is None:
            raise ValueError("a KV cache needs full-precision storage, 8-bit storage or both")
        primary = self.full or self.q8
        self.layout = primary.layout
        self.dtype = storage.dtype if storage is not None else quantized.layout.model_dtype
        self.block_size = block_size
        self.storage = storage
        if storage is not None:
            self.k = [storage[:, 0, layer] for layer in range(config.num_layers)]  # [slots, bs, kvh, hd] views
            self.v = [storage[:, 1, layer] for layer in range(config.num_layers)]
        # the primary format's views (the only format's, unless the cache mixes them)
        self.rows, self.blocks, self.num_slots = primary.rows, primary.blocks, primary.num_blocks
        self.slot_rows, self.entries_per_block = primary.rows_per_block, primary.entries_per_block
        self.num_layers = config.num_layers
        self.v_rows = config.num_layers * block_size
        self.bytes_per_block = primary.layout.block_bytes
        self.max_blocks = max_logical_blocks
        device = primary.rows.device
        self.block_map = torch.full((max_logical_blocks,), -1, dtype=torch.long, device=device)
        self.block_format = torch.full((max_logical_blocks,), FULL_BLOCK if self.full else Q8_BLOCK,
                                       dtype=torch.uint8, device=device)
        # rope_write_'s "none" operands (no fp32 rows / every token 8-bit), made once rather than per layer and step
        self._no_rows = torch.empty(0, device=device)
        self._all_8bit = torch.empty(0, dtype=torch.bool, device=device)

    @classmethod
    def quantized(cls, config: ModelConfig, block_size: int, buf: torch.Tensor, max_logical_blocks: int,
                  kv_cache_dtype: str, dtype: torch.dtype) -> PagedKVCache:
        """An 8-bit cache over the bytes ``buf`` (uint8, a whole number of blocks of ``kv_cache_dtype``'s layout);
        reads dequantize to ``dtype``, the engine's."""
        layout = KVLayout.of(config, block_size, dtype, kv_cache_dtype)
        if not layout.quantized:
            raise ValueError("PagedKVCache.quantized needs an 8-bit kv_cache_dtype (int8 or fp8)")
        if buf.numel() % layout.block_bytes:
            raise ValueError(f"8-bit KV storage must be bytes in whole blocks of {layout.block_bytes}, got "
                             f"{tuple(buf.shape)}")
        return cls(config, block_size, None, max_logical_blocks, BlockStore.quantized(layout, buf))

    @classmethod
    def standalone(cls, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                   dtype: torch.dtype, kv_cache_dtype: str = "auto") -> PagedKVCache:
        """A cache with storage of its own and logical block b in slot b (tools that run a bare model)."""
        layout = KVLayout.of(config, block_size, dtype, kv_cache_dtype)
        if layout.quantized:
            buf = torch.zeros(num_blocks * layout.block_bytes, dtype=torch.uint8, device=device)
            kv = cls.quantized(config, block_size, buf, num_blocks, kv_cache_dtype, dtype)
        else:
            storage = torch.zeros((num_blocks, *block_shape(config, block_size)), device=device, dtype=dtype)
            kv = cls(config, block_size, storage, num_blocks)
        kv.map_blocks(0, list(range(num_blocks)))
        return kv

    @property
    def kv_cache_dtype(self) -> str:
        """The format of the blocks (the 8-bit one when the cache holds 8-bit blocks, static or mixed)."""
        return self.q8.layout.kv_cache_dtype if self.q8 is not None else "auto"

    @property
    def is_quantized(self) -> bool:
        """Every block is 8-bit (a static 8-bit cache)."""
        return self.full is None

    @property
    def scale_blocks(self) -> torch.Tensor | None:
        return self.q8.scale_blocks if self.q8 is not None else None

    @property
    def mixes_formats(self) -> bool:
        return self.full is not None and self.q8 is not None

    def map_blocks(self, logical_start: int, physical_slots: list[int], block_format: int | None = None) -> None:
        """Logical blocks ``logical_start ...`` now live in ``physical_slots`` of ``block_format``'s grid (the
        cache's own format by default; a new pool extent)."""
        fmt = (FULL_BLOCK if self.full is not None else Q8_BLOCK) if block_format is None else block_format
        store = self.full if fmt == FULL_BLOCK else self.q8
        if store is None:
            raise ValueError(f"this KV cache holds no {'full-precision' if fmt == FULL_BLOCK else '8-bit'} blocks")
        if logical_start + len(physical_slots) > self.max_blocks:
            raise ValueError(f"logical blocks up to {logical_start + len(physical_slots)} exceed {self.max_blocks}")
        if any(not 0 <= s < store.num_blocks for s in physical_slots):
            raise ValueError(f"physical slot out of range 0..{store.num_blocks - 1}")
        ids = torch.tensor(physical_slots, dtype=torch.long)
        end = logical_start + len(physical_slots)
        self.block_map[logical_start: end] = ids.to(self.block_map.device)
        self.block_format[logical_start: end] = fmt

    def unmap_blocks(self, logical_start: int, count: int) -> None:
        self.block_map[logical_start: logical_start + count] = -1

    def physical_slot(self, logical_block: int) -> int:
        return int(self.block_map[logical_block])

    def locate(self, slots: torch.Tensor) -> KVIndex:
        logical, offset = slots // self.block_size, slots % self.block_size
        slot = self.block_map[logical]
        if not self.mixes_formats:
            store = self.full or self.q8
            scale_row = store.scale_rows_of(slot, offset) if store.quantized_codes else None
            return KVIndex(slot, offset, store.rows_of(slot, offset), scale_row, "q8" if self.is_quantized else "full")
        is8 = self.block_format[logical] == Q8_BLOCK
        n8 = int(is8.sum())
        kind = "full" if n8 == 0 else "q8" if n8 == is8.numel() else "mixed"
        row = torch.where(is8, self.q8.rows_of(slot, offset), self.full.rows_of(slot, offset))
        return KVIndex(slot, offset, row, self.q8.scale_rows_of(slot, offset), kind, is8)

    def write(self, layer: int, where: KVIndex, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: ``[N, kv_heads, head_dim]`` for the N tokens of ``where`` (1-D). Returns K and V as a read gives
        them back: ``k, v`` in full-precision blocks, their dequantized codes in 8-bit ones (what attention over the
        fresh tokens must use, so a prompt attends to exactly what its later chunks and decodes read)."""
        if where.kind == "full":
            return self.full.write(layer, where.row, None, k, v, self.dtype)
        if where.kind == "q8":
            return self.q8.write(layer, where.row, where.scale_row, k, v, self.dtype)
        k_out, v_out = k.clone(), v.clone()
        q8, fp = where.is8.nonzero().view(-1), (~where.is8).nonzero().view(-1)
        self.full.write(layer, where.row[fp], None, k[fp], v[fp], self.dtype)
        k_out[q8], v_out[q8] = self.q8.write(layer, where.row[q8], where.scale_row[q8], k[q8], v[q8], self.dtype)
        return k_out, v_out

    def rope_write_(self, ops: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                    kv_heads: int, layer: int, where: KVIndex) -> bool:
        """RoPE on the fused ``qkv`` rows in place and their K/V written to ``where`` in one pass per token
        (elementwise_avx2.cpp: ``rope_kv_write_`` into fp32 blocks, ``rope_kv_write_q8_`` into int8 ones or a mix,
        the 8-bit tokens' k / v in ``qkv`` replaced by what a read returns, as :meth:`write` returns them). False
        (nothing done) where no kernel writes the format (fp8 codes): the caller rotates and calls :meth:`write`."""
        off = layer * self.block_size
        if where.kind == "full":
            ops.rope_kv_write_(qkv, cos, sin, heads, kv_heads, self.full.rows, where.row, off, self.v_rows)
            return True
        if self.q8.layout.kv_cache_dtype != "int8":
            return False
        mixed = where.kind == "mixed"
        ops.rope_kv_write_q8_(qkv, cos, sin, heads, kv_heads, self.full.rows if mixed else self._no_rows,
                              self.q8.rows, self.q8.scale_rows, where.row, where.scale_row,
                              where.is8 if mixed else self._all_8bit, off, self.v_rows)
        return True

    def quantize_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Full-precision blocks ``sources`` (physical slots) re-written as the 8-bit blocks ``targets`` (physical, the
        8-bit grid): every row quantized as the 8-bit writer does (``kv_format.quantize``: one scale per token and
        kv head), codes and scales stored at the targets' entries. Every source is read and quantized before any target
        is written, so targets may lie in the sources' own bytes (the rung converts blocks in place)."""
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} source blocks for {len(targets)} 8-bit blocks")
        if not sources:
            return
        if not self.mixes_formats:
            raise ValueError("quantize_blocks needs a cache holding full-precision and 8-bit blocks")
        lay, full, q8 = self.q8.layout, self.full, self.q8
        n_entries, kvh, hd = 2 * lay.num_layers, lay.kv_heads, lay.head_dim
        src = torch.tensor(sources, dtype=torch.long, device=full.blocks.device)
        rows = full.blocks.view(full.num_blocks, n_entries, -1, kvh, hd).index_select(0, src)
        codes, scales = quantize(rows.reshape(-1, kvh, hd), lay.kv_cache_dtype)  # copies: sources may be overwritten
        dst = torch.tensor(targets, dtype=torch.long, device=src.device)
        entries = (dst * q8.entries_per_block).unsqueeze(1) + torch.arange(n_entries, device=src.device)
        q8.blocks.index_copy_(0, entries.reshape(-1), codes.view(-1, lay.block_size, kvh, hd))
        s_entries = (dst * lay.scale_entries_per_block + lay.scale_entry_offset).unsqueeze(1) + \
            torch.arange(n_entries, device=src.device)
        q8.scale_blocks.index_copy_(0, s_entries.reshape(-1), scales.view(-1, lay.block_size, kvh))

    def block_entries(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Entries of ``self.blocks`` holding layer ``layer``'s K for the physical slots ``slots`` (V: + num_layers)."""
        return (self.full or self.q8).entries(layer, slots)

    def scale_entries(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """8-bit: entries of the scale view holding layer ``layer``'s K scales (V: + num_layers)."""
        return self.q8.scale_entries(layer, slots)

    def read_blocks(self, layer: int, slots: torch.Tensor,
                    formats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, nb * block_size, kv_heads, head_dim]`` of the physical blocks ``[B, nb]`` (of ``formats``,
        ``block_format`` of their logical ids, when the cache mixes formats) in the engine's dtype: whole blocks
        (contiguous runs of block_size rows) in one ``index_select`` each, 16x fewer index entries than rows; 8-bit
        blocks dequantized with their scales."""
        b, nb = slots.shape
        flat = slots.reshape(-1)
        shape = (b, nb * self.block_size, *self.rows.shape[1:])
        if not self.mixes_formats or formats is None or not bool((formats == Q8_BLOCK).any()):
            k, v = (self.full or self.q8).read(layer, flat, self.dtype)
            return k.view(shape), v.view(shape)
        is8 = formats.reshape(-1) == Q8_BLOCK
        if bool(is8.all()):
            k, v = self.q8.read(layer, flat, self.dtype)
            return k.view(shape), v.view(shape)
        k = torch.empty(flat.numel(), *self.full.blocks.shape[1:], dtype=self.dtype, device=flat.device)
        v = torch.empty_like(k)
        q8, fp = is8.nonzero().view(-1), (~is8).nonzero().view(-1)
        k[fp], v[fp] = self.full.read(layer, flat[fp], self.dtype)
        k[q8], v[q8] = self.q8.read(layer, flat[q8], self.dtype)
        return k.view(shape), v.view(shape)

    # ---- the CPU decode kernels ------------------------------------------------------------------------------
    def decode_index(self, slots: torch.Tensor, formats: torch.Tensor | None = None) -> Any:
        """What :meth:`paged_decode` needs of the decodes' physical blocks ``[B, nb]`` (``formats``: their
        ``block_format`` in a mixed cache), computed once per forward: the layer-0 entries of each block in its own
        format's grid, and for 8-bit blocks their scale entries. A batch of one format goes to that format's kernel,
        a batch mixing fp32 and int8 blocks (in one table or across tables) to the mixed kernel; None for fp8 codes
        (no CPU kernel reads them: the dense path does)."""
        if self.mixes_formats and formats is not None:
            is8 = formats == Q8_BLOCK
            any8 = bool(is8.any())
            if any8 and not bool(is8.all()):
                if self.q8.layout.kv_cache_dtype == "fp8":
                    return None
                entries = torch.where(is8, self.q8.entries(0, slots), self.full.entries(0, slots))
                scale_entries = torch.where(is8, self.q8.scale_entries(0, slots), 0)
                return "mixed", entries, scale_entries, is8.to(torch.uint8)
            store = self.q8 if any8 else self.full
        else:
            store = self.full or self.q8
        if store.layout.kv_cache_dtype == "fp8":
            return None
        entries = store.entries(0, slots)
        return ("q8", entries, store.scale_entries(0, slots)) if store.quantized_codes else ("full", entries)

    def paged_decode(self, ops: Any, q: torch.Tensor, index: Any, layer: int, lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
        """One query token per sequence over its paged blocks, read in place (attention_avx2.cpp at full precision,
        attention_q8_avx2.cpp over int8 codes, attention_mixed_avx2.cpp over tables mixing the two):
        ``q [B, heads * head_dim]`` fp32 -> the same shape."""
        kind = index[0]
        if kind == "full":
            return ops.paged_decode_attention(q, self.full.blocks, index[1], layer, self.num_layers, lens, scale)
        if kind == "q8":
            _, entries, scale_entries = index
            return ops.paged_decode_attention_q8(q, self.q8.blocks, self.q8.scale_blocks, entries, scale_entries,
                                                 layer, self.num_layers, lens, scale)
        _, entries, scale_entries, is8 = index
        return ops.paged_decode_attention_mixed(q, self.full.blocks, self.q8.blocks, self.q8.scale_blocks, entries,
                                                scale_entries, is8, layer, self.num_layers, lens, scale)
