"""The torch executor: turns a scheduled batch into tensors, runs the model, returns logits.

It owns the model weights' placement and the KV tensors; it makes no decisions.

Every ``HEAP_RELEASE_INTERVAL_S`` it hands the C heap's free pages back to the OS before a batch: each
step's temporaries (activations, batch tensors) come in a new size whenever the batch does, so glibc's heap
fragments and its resident size crept up under steady load (+33 MiB over the second half of a 5-minute replay in
mode off with the C heap's bytes in use flat; about 0 with the release). A release costs ~1-10 ms.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

from serve.engine.scheduler import ScheduledChunk
from serve.model.kv_cache import PagedKVCache
from serve.model.llama import ForwardBatch, LlamaModel, PrefillChunk
from serve.process.heap import release_free_heap

HEAP_RELEASE_INTERVAL_S = 10.0
"""Seconds between two releases of the C heap's free pages (at most one per batch; none while idle)."""


class Executor(Protocol):
    """What the loop runs a batch with: the torch executor (or the speculative one around it), or the planner's
    simulated one (sim/executor.py), which advances a virtual clock instead of computing."""

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """The batch's logits (a row per sampled position, decodes first) and the chunks that sample, in row
        order."""
        ...


class TorchExecutor:
    def __init__(self, model: LlamaModel, kv: PagedKVCache, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.device = model.device
        self.clock = clock
        self.heap_releases = 0
        self._next_release = clock() + HEAP_RELEASE_INTERVAL_S

    def release_heap_if_due(self) -> bool:
        """Hand the C heap's free pages back once ``HEAP_RELEASE_INTERVAL_S`` has passed since the last time."""
        now = self.clock()
        if now < self._next_release:
            return False
        self._next_release = now + HEAP_RELEASE_INTERVAL_S
        self.heap_releases += release_free_heap()
        return True

    def _block_tables(self, block_ids: list[list[int]], lengths: list[int]) -> tuple[torch.Tensor, bool]:
        """Logical block tables ``[len(block_ids), nb]`` covering ``max(lengths)`` tokens, and whether some
        context is shorter than ``nb * block_size`` (ragged). A shorter row is padded with its sequence's first
        block: always mapped, and never attended (the model masks by length)."""
        width = -(-max(lengths) // self.block_size)
        rows = [ids[:width] + [ids[0]] * (width - len(ids[:width])) for ids in block_ids]
        return torch.tensor(rows, device=self.device), min(lengths) < width * self.block_size

    def _chunk_slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """Slots (``block * block_size + offset``) of positions ``start..end-1``: a range per block, no loop per
        token."""
        bs = self.block_size
        first = start // bs
        slots: list[int] = []
        for b in block_ids[first: -(-end // bs)]:
            slots.extend(range(b * bs, b * bs + bs))
        return slots[start - first * bs: end - first * bs]

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, list[ScheduledChunk]]:
        """Flatten decodes first, then prefill chunks. Returns the batch and the chunks in sampling order."""
        decodes = [c for c in chunks if c.is_decode]
        prefills = [c for c in chunks if not c.is_decode]
        bs = self.block_size
        ids: list[int] = [c.seq.token_ids[c.start] for c in decodes]
        pos: list[int] = [c.start for c in decodes]
        slots: list[int] = [c.seq.block_ids[c.start // bs] * bs + c.start % bs for c in decodes]
        sample_idx: list[int] = []
        sampled: list[ScheduledChunk] = []
        dev = self.device
        batch = ForwardBatch(input_ids=None, positions=None, slot_mapping=None, num_decodes=len(decodes))  # type: ignore[arg-type]
        if decodes:
            lens = [c.start + 1 for c in decodes]
            batch.decode_block_tables, batch.decode_ragged = self._block_tables([c.seq.block_ids for c in decodes],
                                                                                lens)
            batch.decode_context_lens = torch.tensor(lens, device=dev)
            for i, c in enumerate(decodes):
                if c.samples:
                    sample_idx.append(i)
                    sampled.append(c)
        for c in prefills:
            t0 = len(ids)
            end = c.start + c.num_tokens
            ids.extend(c.seq.token_ids[c.start:end])
            pos.extend(range(c.start, end))
            slots.extend(self._chunk_slots(c.seq.block_ids, c.start, end))
            table = torch.tensor(c.seq.block_ids[: -(-end // bs)], device=dev) if c.start > 0 else None
            batch.prefills.append(PrefillChunk(t0, c.num_tokens, c.start, table))
            if c.samples:
                sample_idx.append(len(ids) - 1)
                sampled.append(c)
        batch.input_ids = torch.tensor(ids, device=dev)
        batch.positions = torch.tensor(pos, device=dev)
        batch.slot_mapping = torch.tensor(slots, device=dev)
        batch.sample_indices = torch.tensor(sample_idx, device=dev, dtype=torch.long)
        return batch, sampled

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        self.release_heap_if_due()  # between batches: the last one's temporaries are free
        batch, sampled = self.prepare(chunks)
        logits = self.model.forward(batch, self.kv) if chunks else torch.empty(0)
        return logits, sampled
