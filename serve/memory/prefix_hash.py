"""Content hashes of a sequence's full KV blocks, for prefix caching (serve/memory/block_pool.py).

Block j's hash covers every token up to the end of block j: sha256 over the previous block's hash and block
j's token ids, starting from the pool's cache root (its epoch and the layer configuration the cache serves,
``BlockPool.cache_root``). Equal hashes mean equal token prefixes (sha256, as vLLM's default, so one request
cannot craft a collision with another's prefix), computed under the same root.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int,
                        root: bytes) -> list[bytes]:
    """Append to ``hashes`` (block 0 onwards, computed under ``root``) until it covers ``num_blocks`` full blocks."""
    parent = hashes[-1] if hashes else hashlib.sha256(root).digest()
    for j in range(len(hashes), num_blocks):
        block = token_ids[j * block_size: (j + 1) * block_size]
        if len(block) != block_size:
            raise ValueError(f"block {j} is not full ({len(block)} of {block_size} tokens)")
        parent = hashlib.sha256(parent + array("q", block).tobytes()).digest()
        hashes.append(parent)
    return hashes
