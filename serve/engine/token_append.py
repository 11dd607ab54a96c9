"""From an executed batch's logits to accepted tokens: one sampled token per plain chunk, and for a chunk verified
with a draft (serve/engine/spec_executor.py) the longest accepted prefix of the draft plus the target's own token.

Each token goes through the engine's ``accept_token`` in order (grammar, stop tokens, stop strings, max_tokens), so
nothing is emitted past a stop: the first token that finishes a request ends its run, accepted draft or not.

Acceptance, row ``j`` of a drafted chunk holding the target's logits after the sequence's tokens and drafts
``d_0 .. d_(j-1)``:

* greedy: the target's token ``g_j`` is sampled from row ``j`` exactly as a plain step samples (penalties and
  bans read the sequence's tokens, which by then include the accepted drafts); it is emitted, and the run goes on
  while ``g_j == d_j``. Output equals plain decoding's token for token, given equal logits;
* sampled: the standard speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023): with ``p`` the
  target's distribution and ``q`` the draft's at that position (both processed and filtered alike), ``d_j`` is
  accepted with probability ``min(1, p(d_j) / q(d_j))``; on rejection a token is drawn from
  ``max(0, p - q)`` normalized and the run ends; after ``k`` acceptances the target's next token is drawn from
  row ``k``. Each emitted token is then distributed as ``p``. Draws use the request's generator (its seed) or the
  engine's, so a seeded request repeats itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq

import torch

from serve.engine.outputs import RequestOutput
from serve.engine.sampler import row_context, sample_isolated, target_probs
from serve.engine.scheduler import ScheduledChunk
from serve.engine.sequence import Sequence
from serve.engine.spec_executor import DraftedChunk, rows_of

Produced = list[tuple[Sequence, RequestOutput]]
AcceptToken = Callable[[Sequence, int, float], tuple[Sequence, RequestOutput]]
FailSeqs = Callable[..., Produced]


class TokenAppender:
    def __init__(self, eos_token_ids: Seq[int], default_generator: torch.Generator, accept_token: AcceptToken,
                 fail_seqs: FailSeqs, clock: Callable[[], float]) -> None:
        self.eos_token_ids = eos_token_ids
        self.default_generator = default_generator
        self.accept_token = accept_token
        self.fail_seqs = fail_seqs
        self.clock = clock

    def append(self, sampled: list[ScheduledChunk], logits: torch.Tensor) -> Produced:
        if not sampled:
            return []
        if not any(isinstance(c, DraftedChunk) for c in sampled):
            return self._plain([c.seq for c in sampled], logits)
        produced: Produced = []
        row = 0
        for c in sampled:
            n = rows_of(c)
            rows = logits[row: row + n]
            row += n
            produced += self._verified(c, rows) if isinstance(c, DraftedChunk) else self._plain([c.seq], rows)
        return produced

    def _plain(self, seqs: list[Sequence], logits: torch.Tensor) -> Produced:
        """One token per row, the whole batch sampled together."""
        tokens = sample_isolated(logits, seqs, self.eos_token_ids, self.default_generator)
        now = self.clock()
        produced: Produced = []
        for seq, (tok, lp) in zip(seqs, tokens):
            if isinstance(tok, BaseException):
                produced += self.fail_seqs([seq], "sample", tok, iteration_failed=False)
                continue
            try:
                seq_out = self.accept_token(seq, tok, now)
                if lp is not None:
                    seq_out[1].new_logprobs = [lp]
                produced.append(seq_out)
            except Exception as exc:  # noqa: BLE001 - e.g. the detokenizer: fail this request only
                produced += self.fail_seqs([seq], "postprocess", exc, iteration_failed=False)
        return produced

    def _verified(self, c: DraftedChunk, rows: torch.Tensor) -> Produced:
        """The accepted run of one drafted chunk (module docstring), then the manager's rollback."""
        seq, now = c.seq, self.clock()
        produced: Produced = []
        accepted = 0
        for j in range(c.rows):
            try:
                tok, agrees = self._target_token(c, rows, j)
                out = self.accept_token(seq, tok, now)
            except Exception as exc:  # noqa: BLE001 - this request only
                produced += self.fail_seqs([seq], "sample", exc, iteration_failed=False)
                break
            produced.append(out)
            if agrees:
                accepted += 1
            if out[1].finished or not agrees:
                break
        c.settle(accepted)
        return produced

    def _target_token(self, c: DraftedChunk, rows: torch.Tensor, j: int) -> tuple[int, bool]:
        """Row ``j``'s token, and whether it is the draft's ``d_j`` accepted."""
        seq, p = c.seq, c.seq.params
        drafted = j < len(c.draft)
        if p.greedy:
            tok, _ = sample_isolated(rows[j: j + 1], [seq], self.eos_token_ids, self.default_generator)[0]
            if isinstance(tok, BaseException):
                raise tok
            return tok, drafted and tok == c.draft[j]
        gen = seq.generator if seq.generator is not None else self.default_generator
        target = target_probs(rows[j], p, row_context(seq, self.eos_token_ids))
        if not drafted:
            return int(torch.multinomial(target, 1, generator=gen).item()), False
        return speculative_sample(target, c.draft_probs[j], c.draft[j], gen)


def speculative_sample(target: torch.Tensor, draft: torch.Tensor, token: int,
                       generator: torch.Generator | None) -> tuple[int, bool]:
    """The speculative-sampling rule for one draft token ``token`` drawn from ``draft`` (q) against ``target`` (p):
    (``token``, True) with probability ``min(1, p / q)``, else (a token drawn from ``max(0, p - q)`` normalized,
    False). The emitted token is distributed as p whatever q is."""
    u = float(torch.rand(1, generator=generator, device=target.device).item())
    if draft[token] > 0 and u * float(draft[token]) < float(target[token]):  # u < min(1, p/q)
        return token, True
    residual = torch.clamp(target - draft, min=0.0)
    total = float(residual.sum())
    residual = residual / total if total > 0 else target
    return int(torch.multinomial(residual, 1, generator=generator).item()), False
