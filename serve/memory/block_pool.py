"""KV block pool: fixed-size blocks, exact accounting, and capacity that grows and shrinks in chunks.

The base chunk holds ids [0, base). A chunk added later (e.g. the bytes freed by quantizing a layer) gets
the next ids above everything present. Allocation always takes the lowest free ids, so the base pool
fills before any extra chunk, and extra chunks drain first as load falls. Chunks leave in LIFO order and
only when all their blocks are free: no migration of in-use blocks (MorphServe section 4).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


class BlockPoolError(RuntimeError):
    pass


@dataclass(frozen=True)
class Chunk:
    owner: str
    start: int
    num_blocks: int

    @property
    def end(self) -> int:
        return self.start + self.num_blocks


class BlockPool:
    def __init__(self, num_blocks: int, max_blocks: int | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.max_blocks = max_blocks if max_blocks is not None else num_blocks
        if self.max_blocks < num_blocks:
            raise ValueError(f"max_blocks ({self.max_blocks}) < num_blocks ({num_blocks})")
        self.chunks: list[Chunk] = [Chunk("base", 0, num_blocks)]
        self._free: list[int] = list(range(num_blocks))  # a heap; sorted list is a valid heap
        self._free_set: set[int] = set(self._free)

    @property
    def num_blocks(self) -> int:
        return self.chunks[-1].end

    @property
    def base_blocks(self) -> int:
        return self.chunks[0].num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """n lowest free block ids, or None (nothing taken) if fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._free_set.difference_update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i in self._free_set or not 0 <= i < self.num_blocks:
                raise BlockPoolError(f"double free or foreign block id {i}")
            self._free_set.add(i)
            heapq.heappush(self._free, i)

    def add_chunk(self, owner: str, n: int) -> Chunk:
        if n <= 0:
            raise ValueError(f"a chunk needs at least one block, got {n}")
        if any(c.owner == owner for c in self.chunks):
            raise BlockPoolError(f"chunk owner {owner!r} already present")
        if self.num_blocks + n > self.max_blocks:
            raise BlockPoolError(f"chunk of {n} blocks exceeds max_blocks {self.max_blocks} (have {self.num_blocks})")
        chunk = Chunk(owner, self.num_blocks, n)
        self.chunks.append(chunk)
        for i in range(chunk.start, chunk.end):
            heapq.heappush(self._free, i)
            self._free_set.add(i)
        return chunk

    def chunk_is_free(self, owner: str) -> bool:
        chunk = self._chunk(owner)
        return all(i in self._free_set for i in range(chunk.start, chunk.end))

    def remove_chunk(self, owner: str) -> Chunk:
        """Remove the most recently added chunk; it must be `owner`'s and entirely free."""
        chunk = self._chunk(owner)
        if chunk is self.chunks[0]:
            raise BlockPoolError("the base chunk cannot be removed")
        if chunk is not self.chunks[-1]:
            raise BlockPoolError(f"chunks leave in LIFO order: {owner!r} is not the newest ({self.chunks[-1].owner!r})")
        if not self.chunk_is_free(owner):
            raise BlockPoolError(f"chunk {owner!r} still has blocks in use")
        self.chunks.pop()
        self._free_set.difference_update(range(chunk.start, chunk.end))
        self._free = [i for i in self._free if i < chunk.start]
        heapq.heapify(self._free)
        return chunk

    def _chunk(self, owner: str) -> Chunk:
        for c in self.chunks:
            if c.owner == owner:
                return c
        raise BlockPoolError(f"no chunk owned by {owner!r}")

    def check_invariants(self) -> None:
        """free + used = total, free ids unique and in range (tests call this after every step)."""
        assert len(self._free) == len(self._free_set), "free heap and set disagree"
        assert all(0 <= i < self.num_blocks for i in self._free_set), "free id out of range"
        assert self.num_free + self.num_used == self.num_blocks
