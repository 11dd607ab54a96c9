"""The torch executor: turns a scheduled batch into tensors, runs the model, returns logits.

It owns the model weights' placement and the KV tensors; it makes no decisions.

Every ``HEAP_RELEASE_INTERVAL_S`` it hands the C heap's free pages back to the OS before a batch (issue 36): each
step's temporaries (activations, batch tensors) come in a new size whenever the batch does, so glibc's heap
fragments and its resident size crept up under steady load (+33 MiB over the second half of a 5-minute replay in
mode off with the C heap's bytes in use flat; about 0 with the release). A release costs ~1-10 ms.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from serve.engine.scheduler import ScheduledChunk
from serve.model.heap import release_free_heap
from serve.model.kv_cache import PagedKVCache
from serve.model.llama import ForwardBatch, LlamaModel, PrefillChunk

HEAP_RELEASE_INTERVAL_S = 10.0
"""Seconds between two releases of the C heap's free pages (at most one per batch; none while idle)."""


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

    def _context_slots(self, block_ids: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """Slot ids ``[len(block_ids), max(lengths)]`` of positions 0.. of each sequence, from its block table
        (one tensor expression, not a Python loop per token). A row shorter than the longest is padded with
        slots of the sequence's own blocks: always mapped, and masked out by the attention."""
        bs = self.block_size
        width = -(-max(lengths) // bs)
        table = torch.tensor([ids[:width] + [ids[0]] * (width - len(ids[:width])) for ids in block_ids])
        slots = (table[:, :, None] * bs + torch.arange(bs)).view(len(block_ids), width * bs)[:, : max(lengths)]
        return slots.to(self.device)

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, list[ScheduledChunk]]:
        """Flatten decodes first, then prefill chunks. Returns the batch and the chunks in sampling order."""
        decodes = [c for c in chunks if c.num_tokens == 1 and c.start > 0]
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.start > 0)]
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
            batch.decode_slots = self._context_slots([c.seq.block_ids for c in decodes], lens)
            lmax = max(lens)
            if any(n != lmax for n in lens):
                lens_t = torch.tensor(lens, device=dev)
                batch.decode_mask = (torch.arange(lmax, device=dev)[None, :] < lens_t[:, None]).view(len(decodes), 1, 1, lmax)
            for i, c in enumerate(decodes):
                if c.samples:
                    sample_idx.append(i)
                    sampled.append(c)
        for c in prefills:
            t0 = len(ids)
            end = c.start + c.num_tokens
            ids.extend(c.seq.token_ids[c.start:end])
            pos.extend(range(c.start, end))
            ctx = self._context_slots([c.seq.block_ids], [end])[0]
            slots.extend(ctx[c.start:].tolist())
            mask = None
            if c.start > 0:
                q_pos = torch.arange(c.start, end, device=dev)
                mask = torch.arange(end, device=dev)[None, :] <= q_pos[:, None]
            batch.prefills.append(PrefillChunk(t0, c.num_tokens, ctx, mask))
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
