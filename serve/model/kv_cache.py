"""Paged KV storage: per layer, K and V tensors of [slots, kv_heads, head_dim], slot = block * block_size + offset.

The tensors are sized for the pool's max_blocks (its largest possible capacity); which ids are usable is
the BlockPool's business. On CPU, torch.empty maps pages lazily, so unused capacity costs no memory
until a block is first written; the budget is enforced by accounting in the pool.
"""

from __future__ import annotations

import torch

from serve.model.model_config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * block_size * config.kv_size * torch.empty((), dtype=dtype).element_size()


class PagedKVCache:
    def __init__(self, config: ModelConfig, max_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        slots = max_blocks * block_size
        shape = (slots, config.num_kv_heads, config.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.bytes_per_block = kv_bytes_per_block(config, block_size, dtype)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)
