"""Paged KV storage. A block holds K and V of every layer for ``block_size`` tokens and lives in one slot
of a storage tensor ``[slots, 2, layers, block_size, kv_heads, head_dim]`` (the engine's memory arena, so
a block can sit where a quantized layer's full weights used to be).

The block pool hands out *logical* block ids (contiguous, chunked, LIFO; see serve/memory/block_pool.py);
``block_map`` says which physical slot each one occupies. A token's slot index in the scheduler's terms is
``logical_block * block_size + offset``; :meth:`locate` turns a tensor of those (where new tokens are written)
into (physical slot, offset) once per forward, and every layer reuses it. Reads take whole blocks: a block
table of logical ids maps through ``block_map`` to physical slots for :meth:`read_blocks`.

Writes go through one flat row view of the storage (``[slots * 2 * layers * block_size, kv_heads,
head_dim]``): a token's K row in layer ``l`` is ``slot * 2 * layers * block_size + l * block_size + offset``
and its V row is ``layers * block_size`` further. A layer's write is then one ``index_copy_`` of contiguous
``kv_heads * head_dim`` rows (and its gather one ``index_select`` of whole blocks, ``blocks``), instead of
advanced indexing over two index tensors, which costs several times more per call on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.model.model_config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * block_size * config.kv_size * torch.empty((), dtype=dtype).element_size()


def block_shape(config: ModelConfig, block_size: int) -> tuple[int, ...]:
    """The shape of one slot viewed as KV: ``[2 (K, V), layers, block_size, kv_heads, head_dim]``."""
    return (2, config.num_layers, block_size, config.num_kv_heads, config.head_dim)


@dataclass(frozen=True)
class KVIndex:
    """Where tokens' K/V live: physical slot and offset in the block, same shape as the slot indices, and
    the flat row of each token's layer-0 K (see the module docstring)."""

    slot: torch.Tensor
    offset: torch.Tensor
    row: torch.Tensor


class PagedKVCache:
    def __init__(self, config: ModelConfig, block_size: int, storage: torch.Tensor, max_logical_blocks: int) -> None:
        expected = block_shape(config, block_size)
        if tuple(storage.shape[1:]) != expected:
            raise ValueError(f"KV storage slots must be {expected}, got {tuple(storage.shape[1:])}")
        self.block_size = block_size
        self.storage = storage
        self.k = [storage[:, 0, layer] for layer in range(config.num_layers)]  # [slots, bs, kvh, hd] views
        self.v = [storage[:, 1, layer] for layer in range(config.num_layers)]
        self.rows = storage.view(-1, config.num_kv_heads, config.head_dim)  # the flat row view (docstring)
        self.slot_rows = 2 * config.num_layers * block_size
        # one (slot, K|V, layer) block of block_size contiguous rows per entry: decode gathers whole blocks
        self.blocks = storage.view(-1, block_size, config.num_kv_heads, config.head_dim)
        self.num_layers = config.num_layers
        self.v_rows = config.num_layers * block_size
        self.bytes_per_block = kv_bytes_per_block(config, block_size, storage.dtype)
        self.max_blocks = max_logical_blocks
        self.block_map = torch.full((max_logical_blocks,), -1, dtype=torch.long, device=storage.device)

    @classmethod
    def standalone(cls, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                   dtype: torch.dtype) -> PagedKVCache:
        """A cache with storage of its own and logical block b in slot b (tools that run a bare model)."""
        storage = torch.zeros((num_blocks, *block_shape(config, block_size)), device=device, dtype=dtype)
        kv = cls(config, block_size, storage, num_blocks)
        kv.map_blocks(0, list(range(num_blocks)))
        return kv

    def map_blocks(self, logical_start: int, physical_slots: list[int]) -> None:
        """Logical blocks ``logical_start ...`` now live in ``physical_slots`` (a new pool chunk)."""
        if logical_start + len(physical_slots) > self.max_blocks:
            raise ValueError(f"logical blocks up to {logical_start + len(physical_slots)} exceed {self.max_blocks}")
        if any(not 0 <= s < self.storage.shape[0] for s in physical_slots):
            raise ValueError(f"physical slot out of range 0..{self.storage.shape[0] - 1}")
        ids = torch.tensor(physical_slots, dtype=torch.long)
        self.block_map[logical_start: logical_start + len(physical_slots)] = ids.to(self.block_map.device)

    def unmap_blocks(self, logical_start: int, count: int) -> None:
        self.block_map[logical_start: logical_start + count] = -1

    def physical_slot(self, logical_block: int) -> int:
        return int(self.block_map[logical_block])

    def locate(self, slots: torch.Tensor) -> KVIndex:
        slot, offset = self.block_map[slots // self.block_size], slots % self.block_size
        return KVIndex(slot, offset, slot * self.slot_rows + offset)

    def write(self, layer: int, where: KVIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: ``[N, kv_heads, head_dim]`` for the N tokens of ``where`` (1-D)."""
        k_rows = where.row + layer * self.block_size
        self.rows.index_copy_(0, k_rows, k)
        self.rows.index_copy_(0, k_rows + self.v_rows, v)

    def block_entries(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Entries of ``self.blocks`` holding layer ``layer``'s K for the physical slots ``slots`` (V: + num_layers)."""
        return slots * (2 * self.num_layers) + layer

    def read_blocks(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, nb * block_size, kv_heads, head_dim]`` of the physical slots ``[B, nb]``: whole blocks
        (contiguous runs of block_size rows) in one ``index_select`` each, 16x fewer index entries than rows."""
        b, nb = slots.shape
        base = self.block_entries(layer, slots.reshape(-1))
        shape = (b, nb * self.block_size, *self.blocks.shape[2:])
        return (self.blocks.index_select(0, base).view(shape),
                self.blocks.index_select(0, base + self.num_layers).view(shape))
