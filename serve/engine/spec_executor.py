"""The speculative executor: the torch executor, plus draft-and-verify when the speculation manager says so.

A drafting batch (every chunk a decode; serve/engine/spec_manager.py decides) runs in two phases:

* draft: ``k`` decode forwards with the draft's weights (each layer one ladder step below the one it serves at, a
  quantized LM head; serve/morph/draft.py). Step ``j`` feeds each sequence's newest token (its last one, then its
  own draft tokens) at position ``n - 1 + j`` and writes that position's K/V into the sequence's own blocks: the
  draft reads the target's K/V for every token before ``n - 1`` and its own for the speculative positions.
* verify: ONE forward of the target (the engine's layers as they are now) over ``k + 1`` tokens per sequence (its
  last token and the ``k`` drafts) after the cached context. Each is run as a decode row of its own with the
  context length its position has (row ``j`` attends to ``n + j`` tokens; all rows' K/V are written before any
  row attends), so every verified token goes through the very attention kernel a plain decode step runs, and the
  verify pass overwrites each speculative position's K/V with the target's. With ``match_kernels`` the linears and
  the LM head run the kernel a plain step of the same batch would choose at the rows it would have (the row-count
  crossovers of serve/model/crossovers.py raised to the verify's row count where the plain step is below them), so
  greedy verification rounds as the plain step does.

The logits of every verified row go back to the engine with each chunk as a :class:`DraftedChunk` (its draft, the
draft's distributions when it sampled); serve/engine/token_append.py accepts the agreeing prefix and the target's
next token, and the manager's ``settle`` rolls back the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from serve.engine.executor import TorchExecutor
from serve.engine.logits_processors import RowContext, process_row
from serve.engine.sampler import filtered_probs, row_context
from serve.engine.scheduler import ScheduledChunk
from serve.engine.spec_manager import DraftPlan, SpeculationManager
from serve.model import crossovers
from serve.model.llama import ForwardBatch


@dataclass(eq=False)
class DraftedChunk(ScheduledChunk):
    """A decode chunk verified with its draft: ``len(draft) + 1`` logits rows, in order."""

    draft: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # q per draft token (sampled requests only)
    precision: str = ""
    settle: Callable[[int], None] = lambda accepted: None  # accepted draft tokens -> exact KV state

    @property
    def rows(self) -> int:
        return len(self.draft) + 1


def rows_of(chunk: ScheduledChunk) -> int:
    """Logits rows the executor returned for a sampled chunk."""
    return chunk.rows if isinstance(chunk, DraftedChunk) else 1


class SpeculativeExecutor:
    def __init__(self, inner: TorchExecutor, manager: SpeculationManager, eos_token_ids: tuple[int, ...],
                 seed: int = 0, match_kernels: bool = True) -> None:
        self.inner = inner
        # draws for sampled requests without a seed of their own (one seed of the engine's, its own stream)
        self.generator = torch.Generator(device=inner.device).manual_seed(seed)
        self.manager = manager
        self.eos_token_ids = eos_token_ids
        self.match_kernels = match_kernels
        self.model, self.kv, self.device = inner.model, inner.kv, inner.device
        self.block_size = inner.block_size

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, list[ScheduledChunk]]:
        """A plain batch's tensors, as the torch executor lays them out (tests and tools look at them)."""
        return self.inner.prepare(chunks)

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        plan = self.manager.plan(chunks)
        clock = self.manager.clock
        if plan is None:
            t0 = clock()
            out = self.inner.execute(chunks)
            if chunks and all(c.is_decode for c in chunks) and self.manager.controller.costs is not None:
                c = self.manager.controller
                precisions = [layer.precision for layer in self.model.layers]
                c.observe("plain", c.plain_s(precisions, len(chunks), corrected=False), clock() - t0, len(chunks))
            return out
        self.inner.release_heap_if_due()
        t0 = clock()
        drafts, probs = self._draft(plan)
        t1 = clock()
        logits = self._verify(plan, drafts)
        t2 = clock()
        self._observe(plan, t1 - t0, t2 - t1)
        out = []
        for c, d, q in zip(plan.chunks, drafts, probs):
            settle = (lambda seq, precision,
                      n: lambda a: self.manager.settle(seq, precision, n, a))(c.seq, plan.decision.precision, len(d))
            out.append(DraftedChunk(c.seq, c.start, c.num_tokens, draft=d, draft_probs=q,
                                    precision=plan.decision.precision or "", settle=settle))
        return logits, out

    # ---- the two phases --------------------------------------------------------------------------------
    def _draft(self, plan: DraftPlan) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        precision = plan.decision.precision
        assert precision is not None
        layers, head = self.manager.drafts.layers(precision), self.manager.drafts.head(precision)
        drafts: list[list[int]] = [[] for _ in plan.chunks]
        probs: list[list[torch.Tensor]] = [[] for _ in plan.chunks]
        for j in range(max(plan.ks)):
            rows = [i for i, k in enumerate(plan.ks) if k > j]
            batch = self._rows_batch([(plan.chunks[i].seq, drafts[i][:j]) for i in rows], [j] * len(rows))
            logits = self.model.forward(batch, self.kv, layers=layers, head=head)
            for r, i in enumerate(rows):
                tok, q = self._draft_token(logits[r], plan.chunks[i], drafts[i])
                drafts[i].append(tok)
                if q is not None:
                    probs[i].append(q)
        return drafts, probs

    def _draft_token(self, logits: torch.Tensor, chunk: ScheduledChunk,
                     so_far: list[int]) -> tuple[int, torch.Tensor | None]:
        """The draft's next token: processed as the target's row will be (penalties, bans, min_tokens on the
        sequence's tokens plus the draft so far), then argmax (greedy) or sampled from q (q returned)."""
        seq, p = chunk.seq, chunk.seq.params
        if p.needs_history:
            base = row_context(seq, self.eos_token_ids)
            ctx = RowContext([*seq.token_ids, *so_far], base.num_prompt_tokens, base.end_token_ids, base.bad_words_ids)
            logits = process_row(logits, p, ctx)
        if p.greedy:
            return int(logits.argmax().item()), None
        q = filtered_probs(logits / p.temperature, p)
        gen = seq.generator if seq.generator is not None else self.generator
        return int(torch.multinomial(q, 1, generator=gen).item()), q

    def _verify(self, plan: DraftPlan, drafts: list[list[int]]) -> torch.Tensor:
        items, offsets = [], []
        for c, d in zip(plan.chunks, drafts):
            for j in range(len(d) + 1):
                items.append((c.seq, d[:j]))
                offsets.append(j)
        batch = self._rows_batch(items, offsets)
        with crossovers.using(self._matched(len(plan.chunks), len(items)) if self.match_kernels else None):
            return self.model.forward(batch, self.kv)

    def _matched(self, plain_rows: int, rows: int) -> crossovers.KernelCrossovers:
        """The crossovers under which ``rows`` rows run the kernels a plain step of ``plain_rows`` rows runs."""
        now = crossovers.current()
        raised = {name: (max(v, rows) if plain_rows <= v else v) for name, v in now.values().items()}
        return crossovers.KernelCrossovers(**raised, source=now.source)

    def _rows_batch(self, items: list[tuple], offsets: list[int]) -> ForwardBatch:
        """Decode rows: row ``r`` feeds ``(seq, draft so far)``'s newest token at position ``n - 1 + offset``,
        attending to ``n + offset`` tokens (``n``: the sequence's tokens)."""
        bs, dev = self.block_size, self.device
        ids, pos, slots, lens, tables = [], [], [], [], []
        for (seq, so_far), j in zip(items, offsets):
            at = seq.num_tokens - 1 + j
            ids.append(so_far[-1] if so_far else seq.token_ids[-1])
            pos.append(at)
            slots.append(seq.block_ids[at // bs] * bs + at % bs)
            lens.append(at + 1)
            tables.append(seq.block_ids)
        batch = ForwardBatch(input_ids=torch.tensor(ids, device=dev), positions=torch.tensor(pos, device=dev),
                             slot_mapping=torch.tensor(slots, device=dev), num_decodes=len(items))
        batch.decode_block_tables, batch.decode_ragged = self.inner._block_tables(tables, lens)
        batch.decode_context_lens = torch.tensor(lens, device=dev)
        batch.sample_indices = torch.arange(len(items), device=dev)
        return batch

    def _observe(self, plan: DraftPlan, draft_s: float, verify_s: float) -> None:
        c = self.manager.controller
        if c.costs is None:
            return
        b, k = len(plan.chunks), max(plan.ks)
        served = [layer.precision for layer in self.model.layers]
        precision = plan.decision.precision
        assert precision is not None
        c.observe("draft", k * c.draft_s(served, precision, b, corrected=False), draft_s, b)
        c.observe("verify", c.verify_s(served, b + sum(plan.ks), corrected=False), verify_s, b)
