"""KV block pool: fixed-size blocks, exact accounting, and capacity that grows and shrinks in extents.

The base extent holds ids [0, base). An extent added later (e.g. the bytes freed by quantizing a layer) gets
the next ids above everything present. Allocation always takes the lowest free ids, so the base pool
fills before any extra extent, and extra extents drain first as load falls. Extents leave in LIFO order and
only when all their blocks are free: no migration of in-use blocks (MorphServe section 4).

Prefix caching (vLLM's automatic prefix caching, same semantics): a full block whose KV is known by a content
hash (``register``) stays *cached* when its last holder frees it: it counts as free and is handed out again
only after the never-cached free blocks are gone, least recently freed first, and its hash is dropped then.
Until that happens a new sequence with the same prefix can ``take`` it (``lookup``) instead of recomputing
it; a block taken by several sequences is freed when the last one lets it go. ``clear_cache`` forgets every
hash (``LLMEngine.reset_prefix_cache``).

Across morph transitions (``EngineConfig.prefix_cache_across_morph``): every hash chain starts from the pool's
``cache_root``, its epoch, its KV format (``kv_cache_dtype``: int8 KV is never served as, nor found by, another
format's) plus the layer configuration the cache serves (``set_config_tag``). Under ``exact`` the
runtime sets the tag to the new configuration at every transition: blocks computed under another configuration
stay cached, are not found until that configuration comes back (the LIFO ladder makes that likely), and are
evicted as usual. Under ``preserve`` the tag never changes: cached blocks serve under any configuration, as the
KV of running requests already does.

``events`` (optional, ``CacheEvents``) hears every registration's end (``removed``), every change of the root
(``root_changed``) and every reset (``cleared``, with the new root); registrations themselves are reported by the
KV-cache manager, which knows their tokens. Dynamo's KV-aware router is fed from them (serve/dynamo/kv_events.py).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol


class BlockPoolError(RuntimeError):
    pass


@dataclass(frozen=True)
class Extent:
    owner: str
    start: int
    num_blocks: int
    quantized: bool = False  # 8-bit KV blocks (the KV-precision rung's extents); full precision otherwise

    @property
    def end(self) -> int:
        return self.start + self.num_blocks


class CacheEvents(Protocol):
    """What happens to the prefix cache, for a listener outside the engine (called under the engine lock)."""

    def stored(self, block_hash: bytes, parent: bytes | None, tokens: list[int], root: bytes) -> None: ...

    def removed(self, block_hash: bytes) -> None: ...

    def root_changed(self, root: bytes) -> None: ...

    def cleared(self, root: bytes) -> None: ...


class BlockPool:
    def __init__(self, num_blocks: int, max_blocks: int | None = None, kv_format: str = "auto") -> None:
        """``kv_format``: the KV cache's ``kv_cache_dtype``; every hash chain starts from it (``cache_root``)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.max_blocks = max_blocks if max_blocks is not None else num_blocks
        if self.max_blocks < num_blocks:
            raise ValueError(f"max_blocks ({self.max_blocks}) < num_blocks ({num_blocks})")
        self.extents: list[Extent] = [Extent("base", 0, num_blocks)]
        self._free: list[int] = list(range(num_blocks))  # a heap; sorted list is a valid heap
        self._free_set: set[int] = set(self._free)
        self._refs: dict[int, int] = {}            # in-use block -> number of sequences holding it
        self._cached: OrderedDict[int, None] = OrderedDict()  # free blocks that keep a hash, oldest first
        self._hash_of: dict[int, bytes] = {}       # registered block (in use or cached) -> content hash
        self._block_of: dict[bytes, int] = {}
        self.cache_epoch = 0                       # bumped by clear_cache(); part of every hash chain
        self.config_tag = b""                      # the layer configuration the cache serves (set_config_tag)
        # the KV format in every root: a block computed at one KV precision is never found under another (an
        # engine's static format, and every worker's root a KV-aware router sees); nothing for "auto"
        self.kv_tag = b"" if kv_format == "auto" else f"kv={kv_format};".encode()
        self.events: CacheEvents | None = None
        self._retired: set[int] = set()            # free blocks out of service: their bytes hold 8-bit blocks now
        self.register_quantized = True             # 8-bit blocks may hold registered prefixes (False: exact)

    @property
    def num_blocks(self) -> int:
        return self.extents[-1].end - len(self._retired)

    @property
    def num_retired(self) -> int:
        return len(self._retired)

    @property
    def base_blocks(self) -> int:
        return self.extents[0].num_blocks

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out: never-cached free ones plus cached ones it may evict."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a registered prefix (reusable until evicted)."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """n lowest free block ids, or None (nothing taken) if fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            return None
        ids = [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]
        self._free_set.difference_update(ids)
        while len(ids) < n:  # evict cached prefixes, least recently freed first
            block, _ = self._cached.popitem(last=False)
            self._unregister(block)
            ids.append(block)
        for i in ids:
            self._refs[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        """Release one hold on each block. Walked from the end, so a sequence's tail blocks are evicted
        before its head blocks (the head is the prefix other requests are likeliest to share)."""
        for i in reversed(ids):
            refs = self._refs.get(i)
            if refs is None:
                raise BlockPoolError(f"double free or foreign block id {i}")
            if refs > 1:
                self._refs[i] = refs - 1
                continue
            del self._refs[i]
            if i in self._hash_of:
                self._cached[i] = None
            else:
                self._free_set.add(i)
                heapq.heappush(self._free, i)

    # ---- prefix caching --------------------------------------------------------------------------
    @property
    def cache_root(self) -> bytes:
        """Where every hash chain starts now: the epoch, the KV format and the configuration tag."""
        return self.cache_epoch.to_bytes(8, "little") + self.kv_tag + self.config_tag

    @property
    def cache_root_8bit(self) -> bytes:
        """Where a chain whose first block is an 8-bit one starts (the KV-precision rung's blocks under
        ``exact``): the same prefix computed into 8-bit blocks is other KV than at full precision, so it is keyed
        apart and never served to a lookup of the full-precision chain."""
        return self.cache_root + b"kv8-chain;"

    def set_config_tag(self, tag: bytes) -> None:
        """The cache now serves KV computed under configuration ``tag`` (blocks of other tags stay cached)."""
        if tag != self.config_tag:
            self.config_tag = tag
            if self.events is not None:
                self.events.root_changed(self.cache_root)

    def register(self, block: int, block_hash: bytes) -> bool:
        """Block ``block`` (in use, full) holds the KV of the prefix ``block_hash`` names. The first block
        registered for a hash keeps it; a block keeps its first hash. True when this registered it."""
        if block not in self._refs:
            raise BlockPoolError(f"block {block} is not in use")
        if block_hash not in self._block_of and block not in self._hash_of:
            self._hash_of[block] = block_hash
            self._block_of[block_hash] = block
            return True
        return False

    def registered_hashes(self) -> set[bytes]:
        """Every hash the pool holds a block for (in use or cached), whatever its root."""
        return set(self._block_of)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest run of ``hashes``, from the first, that are registered (nothing taken)."""
        found: list[int] = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def take(self, ids: list[int]) -> None:
        """Add one hold on each registered block (cached ones leave the cache and count as used again)."""
        for i in ids:
            if i in self._cached:
                del self._cached[i]
                self._refs[i] = 1
            elif i in self._refs and i in self._hash_of:
                self._refs[i] += 1
            else:
                raise BlockPoolError(f"block {i} holds no registered prefix")

    def clear_cache(self) -> None:
        """Forget every registered prefix: cached blocks become plain free blocks, in-use ones stay in use."""
        self.cache_epoch += 1
        if self.events is not None:
            self.events.cleared(self.cache_root)
        for i in self._cached:
            self._free_set.add(i)
            heapq.heappush(self._free, i)
        self._cached.clear()
        self._hash_of.clear()
        self._block_of.clear()

    def _unregister(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            if self.events is not None:
                self.events.removed(h)

    # ---- the KV-precision rung: free blocks out of service while their bytes hold 8-bit blocks ---------------
    def free_full_ids(self) -> list[int]:
        """Every free full-precision block id (never-cached and cached; the base pool's and the layer extents', not
        the 8-bit extents'), ascending."""
        eight = [(c.start, c.end) for c in self.extents if c.quantized]
        return sorted(i for i in (*self._free_set, *self._cached) if not any(a <= i < b for a, b in eight))

    @property
    def num_free_full(self) -> int:
        """How many :meth:`free_full_ids` lists, without listing them (the rung's telemetry, every step): the free
        blocks less those of the 8-bit extents (none to count while nothing is converted)."""
        n = self.num_free
        for c in self.extents:
            if c.quantized:
                n -= sum(1 for i in range(c.start, c.end) if i in self._free_set or i in self._cached)
        return n

    def retire(self, ids: list[int]) -> None:
        """Take free blocks out of service (cached ones lose their prefix): they count nowhere until
        :meth:`unretire`. Their bytes are the caller's (8-bit blocks of a quantized extent)."""
        for i in ids:
            if i not in self._free_set and i not in self._cached:
                raise BlockPoolError(f"block {i} is not free")
        for i in ids:
            if i in self._cached:
                del self._cached[i]
                self._unregister(i)
            else:
                self._free_set.discard(i)
        self._free = [i for i in self._free if i in self._free_set]
        heapq.heapify(self._free)
        self._retired.update(ids)

    def unretire(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._retired:
                raise BlockPoolError(f"block {i} is not retired")
        for i in ids:
            self._retired.discard(i)
            self._free_set.add(i)
            heapq.heappush(self._free, i)

    def holders(self, block: int) -> int:
        """Sequences holding ``block`` (0: free, cached or retired)."""
        return self._refs.get(block, 0)

    def move_holds(self, moves: dict[int, int]) -> None:
        """Each in-use block ``old`` (one holder) now lives in the free block ``moves[old]`` (its KV was copied there,
        8-bit, by the caller, who repoints the holder): the new block takes the hold, ``old`` is retired (its bytes
        hold 8-bit blocks now). A registered prefix follows the block when 8-bit blocks may hold one
        (``register_quantized``: ``preserve``; the hash is unchanged, so a KV-aware router hears nothing), else it
        ends (``exact``: ``events.removed``)."""
        for old, new in moves.items():
            if self._refs.get(old) != 1:
                raise BlockPoolError(f"block {old} is not in use by exactly one sequence")
            if new not in self._free_set:
                raise BlockPoolError(f"block {new} is not free (or holds a cached prefix)")
        for old, new in moves.items():
            self._free_set.discard(new)
            self._refs[new] = self._refs.pop(old)
            h = self._hash_of.get(old)
            if h is not None and self.may_register(new):
                del self._hash_of[old]
                self._hash_of[new], self._block_of[h] = h, new
            else:
                self._unregister(old)
            self._retired.add(old)
        self._free = [i for i in self._free if i in self._free_set]
        heapq.heapify(self._free)

    @property
    def num_quantized_extents(self) -> int:
        """The KV-precision rung's 8-bit extents in the pool now."""
        return sum(c.quantized for c in self.extents)

    def is_quantized(self, block: int) -> bool:
        """Whether ``block`` lies in an 8-bit extent."""
        return any(c.quantized and c.start <= block < c.end for c in self.extents[1:])

    def may_register(self, block: int) -> bool:
        """Whether ``block`` may hold a registered prefix: not an 8-bit one unless they are shared
        (``register_quantized``, False under ``prefix_cache_across_morph = exact``)."""
        return self.register_quantized or not self.is_quantized(block)

    def add_extent(self, owner: str, n: int, quantized: bool = False) -> Extent:
        if n <= 0:
            raise ValueError(f"an extent needs at least one block, got {n}")
        if any(c.owner == owner for c in self.extents):
            raise BlockPoolError(f"extent owner {owner!r} already present")
        if self.extents[-1].end + n > self.max_blocks:
            raise BlockPoolError(f"extent of {n} blocks exceeds max_blocks {self.max_blocks} (have ids up to "
                                 f"{self.extents[-1].end})")
        extent = Extent(owner, self.extents[-1].end, n, quantized)
        self.extents.append(extent)
        for i in range(extent.start, extent.end):
            heapq.heappush(self._free, i)
            self._free_set.add(i)
        return extent

    def extent_is_free(self, owner: str) -> bool:
        extent = self._extent(owner)
        return all(i in self._free_set or i in self._cached for i in range(extent.start, extent.end))

    def remove_extent(self, owner: str) -> Extent:
        """Remove the most recently added extent; it must be `owner`'s and entirely free."""
        extent = self._extent(owner)
        if extent is self.extents[0]:
            raise BlockPoolError("the base extent cannot be removed")
        if extent is not self.extents[-1]:
            raise BlockPoolError(f"extents leave in LIFO order: {owner!r} is not the newest "
                                 f"({self.extents[-1].owner!r})")
        if not self.extent_is_free(owner):
            raise BlockPoolError(f"extent {owner!r} still has blocks in use (or retired)")
        self.extents.pop()
        for i in [i for i in self._cached if i >= extent.start]:  # cached prefixes in the extent are evicted
            del self._cached[i]
            self._unregister(i)
        self._free_set.difference_update(range(extent.start, extent.end))
        self._free = [i for i in self._free if i < extent.start]
        heapq.heapify(self._free)
        return extent

    def _extent(self, owner: str) -> Extent:
        for c in self.extents:
            if c.owner == owner:
                return c
        raise BlockPoolError(f"no extent owned by {owner!r}")

    def check_invariants(self) -> None:
        """free + used = total, free ids unique and in range (tests call this after every step)."""
        assert len(self._free) == len(self._free_set), "free heap and set disagree"
        assert all(0 <= i < self.extents[-1].end for i in self._free_set), "free id out of range"
        assert not self._free_set & self._cached.keys() and not self._free_set & self._refs.keys(), "a block is twice"
        assert not self._cached.keys() & self._refs.keys(), "a cached block is also in use"
        assert all(i in self._hash_of for i in self._cached), "a cached block has no hash"
        assert not self._retired & (self._free_set | self._cached.keys() | self._refs.keys()), "a retired block is live"
        assert all(0 <= i < self.extents[-1].end for i in self._retired), "retired id out of range"
        assert len(self._free_set) + len(self._cached) + len(self._refs) == self.num_blocks, "blocks lost or invented"
        assert all(self._block_of[h] == i for i, h in self._hash_of.items()), "hash index disagrees"
