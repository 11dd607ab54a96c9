"""KV-cache manager: where every scheduler gets its KV blocks (the shape of vLLM v1's ``KVCacheManager``).

A scheduler decides who runs and with how many tokens; this manager says whether their KV fits and keeps
the prefix cache, so no scheduler hashes prompts, looks blocks up or registers them itself:

- ``get_computed_blocks(req)``: the longest run of a starting request's full prompt blocks already in the
  pool's prefix cache (nothing taken yet), None when no lookup applies;
- ``allocate_slots(req, n, computed)``: take those blocks and new ones for ``n`` more tokens, or nothing;
- ``cache_full_blocks(req, before)``: after execution, register the blocks a chunk filled;
- ``free(req)``: release a request's blocks (finished, aborted or preempted);
- prefix-hit accounting (prompt tokens looked up at admission, and of those found cached), and per request
  (``KVBlockCounts``: blocks reused, missed and newly allocated, TensorRT-LLM's per-request KV metrics).

Quantize before preempt: ``on_shortfall(blocks)`` (the engine wires it to the morph runtime) is offered the
shortfall a scheduler actually meets, in its own order, right before it would preempt
(``cover_shortfall``); the hook may grow the pool. Once in a step the hook leaves a shortfall uncovered
(the mode has no room left), it is not asked again until the next step and the scheduler preempts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from serve.memory.block_pool import BlockPool
from serve.memory.prefix_hash import extend_block_hashes


@dataclass
class KVBlockCounts:
    """One request's blocks, counted by the manager each time the request starts from scratch (admission, restart
    after preemption): ``reused`` taken from the prefix cache, ``missed`` its other prompt blocks, ``new`` every
    block allocated for it."""

    reused: int = 0
    missed: int = 0
    new: int = 0


class KVRequest(Protocol):
    """What the manager reads and writes of a request (the engine's Sequence)."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    block_hashes: list[bytes]
    hash_root: bytes | None
    kv_counts: KVBlockCounts

    @property
    def num_tokens(self) -> int: ...

    def blocks_needed(self, num_new_tokens: int, block_size: int) -> int: ...


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool = False,
                 on_shortfall: Callable[[int], object] | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.on_shortfall = on_shortfall
        self.prefix_queried_tokens = 0   # prompt tokens looked up in the prefix cache at admission
        self.prefix_hit_tokens = 0       # of which found there (not computed again)
        self._shortfall_left = False     # the hook left a shortfall uncovered in this step

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_needed(self, req: KVRequest, num_new_tokens: int) -> int:
        return req.blocks_needed(num_new_tokens, self.block_size)

    def get_computed_blocks(self, req: KVRequest) -> list[int] | None:
        """Blocks of the longest cached run of ``req``'s full blocks (always leaving its last token to compute:
        its logits give the next token). None when caching is off or ``req`` does not start from scratch."""
        if not (self.enable_caching and req.num_computed_tokens == 0 and not req.block_ids):
            return None
        root = self.pool.cache_root
        if req.hash_root != root:
            req.block_hashes, req.hash_root = [], root
        full = (req.num_tokens - 1) // self.block_size
        found = self.pool.lookup(extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, full,
                                                     root)[:full])
        if found or self.pool.register_quantized or not self.pool.num_quantized_extents:
            return found
        # under exact, the chains the KV-precision rung's 8-bit blocks started (cache_full_blocks): found there,
        # the request continues that chain
        root8 = self.pool.cache_root_8bit
        hashes8 = extend_block_hashes([], req.token_ids, self.block_size, full, root8)
        found = self.pool.lookup(hashes8[:full])
        if found:
            req.block_hashes, req.hash_root = hashes8, root8
        return found

    def allocate_slots(self, req: KVRequest, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Blocks for ``num_new_tokens`` more tokens of ``req`` (counted after ``computed_blocks``, what
        ``get_computed_blocks`` returned, which ``req`` takes first). False with nothing taken when the pool
        cannot hold them."""
        starts = req.num_computed_tokens == 0 and not req.block_ids
        if computed_blocks:
            self.pool.take(computed_blocks)
            req.block_ids = list(computed_blocks)
            req.num_computed_tokens = len(computed_blocks) * self.block_size
        blocks = self.pool.allocate(self.num_blocks_needed(req, num_new_tokens))
        if blocks is None:
            if computed_blocks:
                self.pool.free(computed_blocks)
                req.block_ids, req.num_computed_tokens = [], 0
            return False
        req.block_ids.extend(blocks)
        counts = req.kv_counts
        counts.new += len(blocks)
        if starts:
            reused = len(computed_blocks or ())
            counts.reused += reused
            counts.missed += -(-req.num_tokens // self.block_size) - reused
        if computed_blocks is not None:
            self.prefix_queried_tokens += req.num_tokens
            self.prefix_hit_tokens += len(computed_blocks) * self.block_size
        return True

    def cache_full_blocks(self, req: KVRequest, num_computed_before: int) -> None:
        """``req`` computed its tokens from ``num_computed_before`` to ``num_computed_tokens``: register the
        blocks this filled (they hold KV for a known prefix), only while the root ``req`` started computing under
        is current, so every block of a chain came from the same weights (or, under ``preserve``, the same epoch).
        Each block this registers is reported to the pool's ``events`` with its tokens and parent."""
        bs = self.block_size
        full = req.num_computed_tokens // bs
        root = req.hash_root
        if not (self.enable_caching and full > num_computed_before // bs) or root is None:
            return
        if root not in (self.pool.cache_root, self.pool.cache_root_8bit):
            # computed partly under another root: no later block of it is registered, even if the root comes
            # back (those blocks attend to KV another configuration computed); recomputing starts afresh
            req.hash_root = None
            return
        if num_computed_before < bs and root == self.pool.cache_root and not self.pool.may_register(req.block_ids[0]):
            # its first block is 8-bit (exact): the whole chain is keyed apart, a full-precision lookup never
            # finds it (get_computed_blocks tries it second)
            req.block_hashes, req.hash_root = [], self.pool.cache_root_8bit
            root = req.hash_root
        hashes = extend_block_hashes(req.block_hashes, req.token_ids, bs, full, root)
        events = self.pool.events
        for j in range(num_computed_before // bs, full):
            if root != self.pool.cache_root_8bit and not self.pool.may_register(req.block_ids[j]):
                req.hash_root = None  # an 8-bit block in a full-precision chain (exact): it and every later block
                return                # attend to 8-bit KV
            if self.pool.register(req.block_ids[j], hashes[j]) and events is not None:
                events.stored(hashes[j], hashes[j - 1] if j else None, req.token_ids[j * bs:(j + 1) * bs], root)

    def repoint(self, req: KVRequest, moves: dict[int, int]) -> None:
        """Blocks of ``req`` moved (the KV-precision rung re-wrote them as 8-bit blocks elsewhere; the pool moved
        their holds): its table follows. Under ``exact`` (the pool registers no 8-bit block) no later block of
        ``req`` is registered either: it attends to 8-bit KV now."""
        if any(b in moves for b in req.block_ids):
            req.block_ids = [moves.get(b, b) for b in req.block_ids]
            if not self.pool.register_quantized:
                req.hash_root = None

    def trim(self, req: KVRequest, num_tokens: int) -> int:
        """Free ``req``'s blocks past the ``num_tokens``-th token (the blocks a speculative draft took for tokens
        that were rejected); returns how many were freed. Never frees a block a kept token lies in."""
        keep = -(-num_tokens // self.block_size)
        extra = req.block_ids[keep:]
        if extra:
            self.pool.free(extra)
            del req.block_ids[keep:]
        return len(extra)

    def free(self, req: KVRequest) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []

    # ---- quantize before preempt ------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A new scheduling pass: the shortfall hook may be asked again."""
        self._shortfall_left = False

    def cover_shortfall(self, blocks: int) -> bool:
        """The scheduler needs ``blocks`` free blocks now and would preempt otherwise: offer what the pool lacks
        to ``on_shortfall``. True when that many are free afterwards."""
        short = blocks - self.pool.num_free
        if short > 0 and self.on_shortfall is not None and not self._shortfall_left:
            self.on_shortfall(short)
            short = blocks - self.pool.num_free
            self._shortfall_left = short > 0
        return short <= 0
