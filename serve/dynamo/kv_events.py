"""The engine's prefix cache as KV events for Dynamo's KV-aware router (``--router-mode kv``).

Dynamo 1.6.1's ``KvEventPublisher`` (handed to the worker through ``PushSource``) takes ``stored`` events
(a block's token ids, its id, its parent's id) and ``removed`` events (ids). The router hashes the token ids
itself (xxh3 per block of the card's ``kv_cache_block_size`` tokens), so our ids only name blocks: the first
8 bytes of our sha256 prefix hash as a signed int64. The publisher counts references, so every id is stored
at most once until removed, and a block is published only after its parent (the router drops a store whose
parent it does not know).

What the router is told is what the cache *serves now*: under ``prefix_cache_across_morph = exact`` blocks
computed under another layer configuration stay cached but do not serve, so a transition removes every
published block and publishes those cached under the new configuration (parents first); when a configuration
comes back its blocks are published again. A cache reset removes everything. Push mode has no "all blocks
cleared" event in 1.6.1, so both use removes.

The pool calls ``stored``/``removed``/``root_changed``/``cleared`` on the engine thread under the engine lock
(they only queue); ``flush`` runs as a step listener and hands the queue to the publisher in order.
"""

from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass
from typing import Any

from serve.logging_setup import get_logger

log = get_logger("morphserve.dynamo.kv_events")


def block_id(block_hash: bytes) -> int:
    """A block's id for the router: the hash's first 8 bytes as a signed int64 (Dynamo's id type)."""
    return int.from_bytes(block_hash[:8], "little", signed=True)


@dataclass(frozen=True)
class HeldBlock:
    root: bytes
    parent: bytes | None
    tokens: array  # the block's token ids, 4 bytes each (a pool may hold 10^5 blocks)
    depth: int


class KvEventBridge:
    """Mirrors the pool's registered blocks and queues the router's view of them (see the module docstring)."""

    def __init__(self, max_pending: int = 100_000) -> None:
        self.root: bytes | None = None              # the cache root in force (set_cache_events tells it first)
        self.max_pending = max_pending
        self.held: dict[bytes, HeldBlock] = {}     # every registered block, whatever its root
        self.published: set[bytes] = set()          # what the router was told this worker holds
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._publisher: Any = None
        self.sent = {"stored": 0, "removed": 0}
        self.dropped = 0                            # events lost: the queue was full (no publisher attached)
        self.unreachable = 0                        # blocks not published: their parent was not published

    # ---- CacheEvents (engine thread, engine lock held) --------------------------------------------------
    def stored(self, block_hash: bytes, parent: bytes | None, tokens: list[int], root: bytes) -> None:
        parent_block = self.held.get(parent) if parent is not None else None
        depth = parent_block.depth + 1 if parent_block is not None else 0
        self.held[block_hash] = HeldBlock(root, parent, array("i", tokens), depth)
        if root == self.root:
            self._publish_stored(block_hash)

    def removed(self, block_hash: bytes) -> None:
        self.held.pop(block_hash, None)
        if block_hash in self.published:
            self.published.discard(block_hash)
            self._queue({"type": "removed", "block_hashes": [block_id(block_hash)]})

    def root_changed(self, root: bytes) -> None:
        self._unpublish_all()
        self.root = root
        serving = sorted((h for h, b in self.held.items() if b.root == root), key=lambda h: self.held[h].depth)
        for h in serving:
            self._publish_stored(h)

    def cleared(self, root: bytes) -> None:
        self.held.clear()
        self.root_changed(root)  # withdraws everything published; nothing is held to publish again

    # ---- publishing --------------------------------------------------------------------------------------
    def attach(self, publisher: Any) -> None:
        """``PushSource.on_ready``: Dynamo's ``KvEventPublisher`` for this worker; what was queued goes first."""
        with self._lock:
            self._publisher = publisher
        log.info("kv_events_attached", queued=len(self._pending))
        self.flush()

    def flush(self) -> None:
        """Hand the queued events to the publisher, in order (a step listener: engine thread, no engine lock)."""
        with self._lock:
            publisher = self._publisher
            if publisher is None or not self._pending:
                return
            batch, self._pending = self._pending, []
        try:
            publisher.publish_batch(batch)
        except Exception as exc:  # noqa: BLE001 - routing hints must never stop the engine
            log.warning("kv_events_publish_failed", events=len(batch), error=f"{type(exc).__name__}: {exc}")
            return
        for ev in batch:
            self.sent[ev["type"]] += len(ev["block_hashes"])

    def _publish_stored(self, block_hash: bytes) -> None:
        b = self.held[block_hash]
        if b.parent is not None and b.parent not in self.published:
            self.unreachable += 1
            return
        self.published.add(block_hash)
        self._queue({"type": "stored", "token_ids": b.tokens.tolist(), "num_block_tokens": [len(b.tokens)],
                     "block_hashes": [block_id(block_hash)],
                     "parent_hash": block_id(b.parent) if b.parent is not None else None})

    def _unpublish_all(self) -> None:
        if self.published:
            self._queue({"type": "removed", "block_hashes": [block_id(h) for h in self.published]})
            self.published.clear()

    def _queue(self, event: dict[str, Any]) -> None:
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self.dropped += 1
                return
            self._pending.append(event)
