"""Paged KV storage. A block holds K and V of every layer for ``block_size`` tokens in one slot of the engine's
memory arena (so a block can sit where a quantized layer's full weights used to be), in the cache's format
(serve/model/kv_format.py): full precision, a typed storage ``[slots, 2, layers, block_size, kv_heads, head_dim]``;
8-bit (``kv_cache_dtype`` int8 / fp8), the arena's bytes cut into blocks of codes followed by their scales.

The block pool hands out *logical* block ids (contiguous, chunked, LIFO; see serve/memory/block_pool.py);
``block_map`` says which physical slot each one occupies. A token's slot index in the scheduler's terms is
``logical_block * block_size + offset``; :meth:`locate` turns a tensor of those (where new tokens are written)
into (physical slot, offset) once per forward, and every layer reuses it. Reads take whole blocks: a block
table of logical ids maps through ``block_map`` to physical slots for :meth:`read_blocks`.

Writes go through one flat row view of the codes (``[rows, kv_heads, head_dim]``; at full precision the storage
itself): a token's K row in layer ``l`` is ``slot * rows_per_block + l * block_size + offset`` and its V row is
``layers * block_size`` further (an 8-bit block has ``entries_per_block * block_size`` rows, its padding and
scales included, so its rows are never written past the codes). A layer's write is then one ``index_copy_`` of
contiguous ``kv_heads * head_dim`` rows (and its gather one ``index_select`` of whole blocks, ``blocks``), instead
of advanced indexing over two index tensors, which costs several times more per call on CPU. An 8-bit write
quantizes the rows first and copies their scales the same way into the fp32 scale rows (``scale_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from serve.model.kv_format import KVLayout, dequantize, quantize
from serve.model.model_config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV block: at the engine's ``dtype`` (``auto``), or 8-bit codes with their scales."""
    return KVLayout.of(config, block_size, dtype, kv_cache_dtype).block_bytes


def block_shape(config: ModelConfig, block_size: int) -> tuple[int, ...]:
    """The shape of one full-precision slot viewed as KV: ``[2 (K, V), layers, block_size, kv_heads, head_dim]``."""
    return (2, config.num_layers, block_size, config.num_kv_heads, config.head_dim)


@dataclass(frozen=True)
class KVIndex:
    """Where tokens' K/V live: physical slot and offset in the block, same shape as the slot indices, and
    the flat row of each token's layer-0 K (see the module docstring); 8-bit: also its layer-0 K scale row."""

    slot: torch.Tensor
    offset: torch.Tensor
    row: torch.Tensor
    scale_row: torch.Tensor | None = None


class PagedKVCache:
    def __init__(self, config: ModelConfig, block_size: int, storage: torch.Tensor, max_logical_blocks: int) -> None:
        """A full-precision cache over ``storage`` ``[slots, *block_shape]`` (8-bit: :meth:`quantized`)."""
        expected = block_shape(config, block_size)
        if tuple(storage.shape[1:]) != expected:
            raise ValueError(f"KV storage slots must be {expected}, got {tuple(storage.shape[1:])}")
        self.layout = KVLayout.of(config, block_size, storage.dtype)
        self.block_size = block_size
        self.storage = storage
        self.dtype = storage.dtype
        self.k = [storage[:, 0, layer] for layer in range(config.num_layers)]  # [slots, bs, kvh, hd] views
        self.v = [storage[:, 1, layer] for layer in range(config.num_layers)]
        self.rows = storage.view(-1, config.num_kv_heads, config.head_dim)  # the flat row view (docstring)
        self.slot_rows = 2 * config.num_layers * block_size
        # one (slot, K|V, layer) block of block_size contiguous rows per entry: decode gathers whole blocks
        self.blocks = storage.view(-1, block_size, config.num_kv_heads, config.head_dim)
        self.entries_per_block = 2 * config.num_layers
        self.num_slots = storage.shape[0]
        self._init_common(config, max_logical_blocks, storage.device)

    def _init_common(self, config: ModelConfig, max_logical_blocks: int, device: torch.device) -> None:
        self.num_layers = config.num_layers
        self.v_rows = config.num_layers * self.block_size
        self.bytes_per_block = self.layout.block_bytes
        self.max_blocks = max_logical_blocks
        self.block_map = torch.full((max_logical_blocks,), -1, dtype=torch.long, device=device)

    @classmethod
    def quantized(cls, config: ModelConfig, block_size: int, buf: torch.Tensor, max_logical_blocks: int,
                  kv_cache_dtype: str, dtype: torch.dtype) -> PagedKVCache:
        """An 8-bit cache over the bytes ``buf`` (uint8, a whole number of blocks of ``kv_cache_dtype``'s layout);
        reads dequantize to ``dtype``, the engine's."""
        layout = KVLayout.of(config, block_size, dtype, kv_cache_dtype)
        if not layout.quantized:
            raise ValueError("PagedKVCache.quantized needs an 8-bit kv_cache_dtype (int8 or fp8)")
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() % layout.block_bytes:
            raise ValueError(f"8-bit KV storage must be bytes in whole blocks of {layout.block_bytes}, got "
                             f"{buf.dtype} {tuple(buf.shape)}")
        kv = cls.__new__(cls)
        kv.layout, kv.block_size, kv.dtype = layout, block_size, dtype
        kv.storage = None
        kv.num_slots = buf.numel() // layout.block_bytes
        codes = buf.view(torch.int8)
        kv.rows = codes.view(-1, config.num_kv_heads, config.head_dim)
        kv.blocks = codes.view(-1, block_size, config.num_kv_heads, config.head_dim)
        kv.entries_per_block = layout.entries_per_block
        kv.slot_rows = layout.entries_per_block * block_size
        scales = buf.view(torch.float32)
        kv.scale_rows = scales.view(-1, config.num_kv_heads)
        kv.scale_blocks = scales.view(-1, block_size, config.num_kv_heads)
        kv.scale_entries_per_block = layout.scale_entries_per_block
        kv.scale_entry_offset = layout.scale_entry_offset
        kv._init_common(config, max_logical_blocks, buf.device)
        return kv

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
        return self.layout.kv_cache_dtype

    @property
    def is_quantized(self) -> bool:
        return self.layout.quantized

    def map_blocks(self, logical_start: int, physical_slots: list[int]) -> None:
        """Logical blocks ``logical_start ...`` now live in ``physical_slots`` (a new pool chunk)."""
        if logical_start + len(physical_slots) > self.max_blocks:
            raise ValueError(f"logical blocks up to {logical_start + len(physical_slots)} exceed {self.max_blocks}")
        if any(not 0 <= s < self.num_slots for s in physical_slots):
            raise ValueError(f"physical slot out of range 0..{self.num_slots - 1}")
        ids = torch.tensor(physical_slots, dtype=torch.long)
        self.block_map[logical_start: logical_start + len(physical_slots)] = ids.to(self.block_map.device)

    def unmap_blocks(self, logical_start: int, count: int) -> None:
        self.block_map[logical_start: logical_start + count] = -1

    def physical_slot(self, logical_block: int) -> int:
        return int(self.block_map[logical_block])

    def locate(self, slots: torch.Tensor) -> KVIndex:
        slot, offset = self.block_map[slots // self.block_size], slots % self.block_size
        scale_row = None
        if self.is_quantized:
            scale_row = (slot * self.scale_entries_per_block + self.scale_entry_offset) * self.block_size + offset
        return KVIndex(slot, offset, slot * self.slot_rows + offset, scale_row)

    def write(self, layer: int, where: KVIndex, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: ``[N, kv_heads, head_dim]`` for the N tokens of ``where`` (1-D). Returns K and V as a read gives
        them back: ``k, v`` at full precision, their dequantized codes at 8 bits (what attention over the fresh
        tokens must use, so a prompt attends to exactly what its later chunks and decodes read)."""
        k_rows = where.row + layer * self.block_size
        if not self.is_quantized:
            self.rows.index_copy_(0, k_rows, k)
            self.rows.index_copy_(0, k_rows + self.v_rows, v)
            return k, v
        n = k.shape[0]
        codes, scales = quantize(torch.cat([k, v]), self.kv_cache_dtype)
        self.rows.index_copy_(0, torch.cat([k_rows, k_rows + self.v_rows]), codes)
        s_rows = where.scale_row + layer * self.block_size
        self.scale_rows.index_copy_(0, torch.cat([s_rows, s_rows + self.v_rows]), scales)
        values = dequantize(codes, scales, self.kv_cache_dtype, self.dtype)
        return values[:n], values[n:]

    def block_entries(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Entries of ``self.blocks`` holding layer ``layer``'s K for the physical slots ``slots`` (V: + num_layers)."""
        return slots * self.entries_per_block + layer

    def scale_entries(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """8-bit: entries of ``self.scale_blocks`` holding layer ``layer``'s K scales (V: + num_layers)."""
        return slots * self.scale_entries_per_block + self.scale_entry_offset + layer

    def read_blocks(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, nb * block_size, kv_heads, head_dim]`` of the physical slots ``[B, nb]`` in the engine's
        dtype: whole blocks (contiguous runs of block_size rows) in one ``index_select`` each, 16x fewer index
        entries than rows; 8-bit blocks dequantized with their scales."""
        b, nb = slots.shape
        flat = slots.reshape(-1)
        base = self.block_entries(layer, flat)
        shape = (b, nb * self.block_size, *self.blocks.shape[2:])
        k, v = self.blocks.index_select(0, base), self.blocks.index_select(0, base + self.num_layers)
        if not self.is_quantized:
            return k.view(shape), v.view(shape)
        s = self.scale_entries(layer, flat)
        ks, vs = self.scale_blocks.index_select(0, s), self.scale_blocks.index_select(0, s + self.num_layers)
        return (dequantize(k, ks, self.kv_cache_dtype, self.dtype).view(shape),
                dequantize(v, vs, self.kv_cache_dtype, self.dtype).view(shape))

    # ---- the CPU decode kernels ------------------------------------------------------------------------------
    def decode_index(self, slots: torch.Tensor) -> Any:
        """What :meth:`paged_decode` needs of the decodes' physical slots ``[B, nb]``, computed once per forward."""
        entries = self.block_entries(0, slots)
        return (entries, self.scale_entries(0, slots)) if self.is_quantized else entries

    def paged_decode(self, ops: Any, q: torch.Tensor, index: Any, layer: int, lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
        """One query token per sequence over its paged blocks, read in place (attention_avx2.cpp at full precision,
        attention_q8_avx2.cpp over int8 codes): ``q [B, heads * head_dim]`` fp32 -> the same shape."""
        if not self.is_quantized:
            return ops.paged_decode_attention(q, self.blocks, index, layer, self.num_layers, lens, scale)
        entries, scale_entries = index
        return ops.paged_decode_attention_q8(q, self.blocks, self.scale_blocks, entries, scale_entries, layer,
                                             self.num_layers, lens, scale)
