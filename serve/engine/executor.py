"""The torch executor: turns a scheduled batch into tensors, runs the model, returns logits.

It owns the model weights' placement and the KV tensors; it makes no decisions.
"""

from __future__ import annotations

import torch

from serve.engine.scheduler import ScheduledChunk
from serve.model.kv_cache import PagedKVCache
from serve.model.llama import ForwardBatch, LlamaModel, PrefillChunk


class TorchExecutor:
    def __init__(self, model: LlamaModel, kv: PagedKVCache) -> None:
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.device = model.device

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, list[ScheduledChunk]]:
        """Flatten decodes first, then prefill chunks. Returns the batch and the chunks in sampling order."""
        decodes = [c for c in chunks if c.num_tokens == 1 and c.start > 0]
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.start > 0)]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        sampled: list[ScheduledChunk] = []
        dev = self.device
        decode_ctx: list[list[int]] = []
        for c in decodes:
            ids.append(c.seq.token_ids[c.start])
            pos.append(c.start)
            ctx = self._slots(c.seq.block_ids, 0, c.start + 1)
            slots.append(ctx[-1])
            decode_ctx.append(ctx)
        batch = ForwardBatch(input_ids=None, positions=None, slot_mapping=None, num_decodes=len(decodes))  # type: ignore[arg-type]
        if decodes:
            lmax = max(len(x) for x in decode_ctx)
            batch.decode_slots = torch.tensor([x + [0] * (lmax - len(x)) for x in decode_ctx], device=dev)
            if any(len(x) != lmax for x in decode_ctx):
                lens = torch.tensor([len(x) for x in decode_ctx], device=dev)
                batch.decode_mask = (torch.arange(lmax, device=dev)[None, :] < lens[:, None]).view(len(decodes), 1, 1, lmax)
            for i, c in enumerate(decodes):
                if c.samples:
                    sample_idx.append(i)
                    sampled.append(c)
        for c in prefills:
            t0 = len(ids)
            end = c.start + c.num_tokens
            ids.extend(c.seq.token_ids[c.start:end])
            pos.extend(range(c.start, end))
            ctx = self._slots(c.seq.block_ids, 0, end)
            slots.extend(ctx[c.start:])
            mask = None
            if c.start > 0:
                q_pos = torch.arange(c.start, end, device=dev)
                mask = torch.arange(end, device=dev)[None, :] <= q_pos[:, None]
            batch.prefills.append(PrefillChunk(t0, c.num_tokens, torch.tensor(ctx, device=dev), mask))
            if c.samples:
                sample_idx.append(len(ids) - 1)
                sampled.append(c)
        batch.input_ids = torch.tensor(ids, device=dev)
        batch.positions = torch.tensor(pos, device=dev)
        batch.slot_mapping = torch.tensor(slots, device=dev)
        batch.sample_indices = torch.tensor(sample_idx, device=dev, dtype=torch.long)
        return batch, sampled

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        batch, sampled = self.prepare(chunks)
        logits = self.model.forward(batch, self.kv) if chunks else torch.empty(0)
        return logits, sampled
