"""From an executed batch's logits to accepted tokens: one sampled token per plain chunk, and for a chunk verified
with a draft (serve/engine/spec_executor.py) the longest accepted prefix of the draft plus the target's own token.

Each token is taken into its sequence in order (its grammar, its tokens, stop tokens, stop strings, max_tokens,
the text it releases), so nothing is emitted past a stop: the first token that finishes a request ends its run,
accepted draft or not. What happened comes back to the engine (:class:`Appended`, one per sampled chunk, in batch
order), which counts the tokens, makes the outputs, finishes or fails the requests and only then lets a drafted
chunk settle its KV blocks; the appender never touches the engine's state.

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

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from serve.engine.outputs import FinishReason
from serve.engine.sampler import row_context, sample_isolated, target_probs
from serve.engine.scheduler import ScheduledChunk
from serve.engine.sequence import Sequence
from serve.engine.spec_executor import DraftedChunk, rows_of


@dataclass
class Token:
    """One token taken into its sequence: the text it releases (a possible stop string is held back until final)
    and, when it ends the request, why."""

    token: int
    text: str
    finish: FinishReason | None = None
    logprob: float | None = None


@dataclass
class Failure:
    """Why a request fails here (``where``: sample or postprocess) and whether the token at fault was already in
    its sequence (it then counts as generated, as every token taken in does)."""

    where: str
    error: BaseException
    token_taken: bool = False


@dataclass
class Appended:
    """What one sampled chunk did to its sequence, at ``now``: its tokens in order, then its failure, if any, and
    for a drafted chunk its KV rollback (``settle``), which the engine runs after applying the tokens."""

    seq: Sequence
    now: float
    tokens: list[Token] = field(default_factory=list)
    failed: Failure | None = None
    settle: Callable[[], None] | None = None


class TokenAppender:
    def __init__(self, eos_token_ids: Seq[int], default_generator: torch.Generator, max_model_len: int,
                 clock: Callable[[], float]) -> None:
        self.eos_token_ids = eos_token_ids
        self.default_generator = default_generator
        self.max_model_len = max_model_len
        self.clock = clock

    def append(self, sampled: list[ScheduledChunk], logits: torch.Tensor) -> list[Appended]:
        if not sampled:
            return []
        if not any(isinstance(c, DraftedChunk) for c in sampled):
            return self._plain([c.seq for c in sampled], logits)
        appended: list[Appended] = []
        row = 0
        for c in sampled:
            n = rows_of(c)
            rows = logits[row: row + n]
            row += n
            appended += [self._verified(c, rows)] if isinstance(c, DraftedChunk) else self._plain([c.seq], rows)
        return appended

    def _plain(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Appended]:
        """One token per row, the whole batch sampled together."""
        tokens = sample_isolated(logits, seqs, self.eos_token_ids, self.default_generator)
        now = self.clock()
        appended: list[Appended] = []
        for seq, (tok, lp) in zip(seqs, tokens):
            out = Appended(seq, now)
            appended.append(out)
            if isinstance(tok, BaseException):
                out.failed = Failure("sample", tok)
                continue
            before = len(seq.token_ids)
            try:
                taken = self._take(seq, tok)
            except Exception as exc:  # noqa: BLE001 - e.g. the detokenizer: fail this request only
                out.failed = Failure("postprocess", exc, token_taken=len(seq.token_ids) > before)
                continue
            taken.logprob = lp
            out.tokens.append(taken)
        return appended

    def _verified(self, c: DraftedChunk, rows: torch.Tensor) -> Appended:
        """The accepted run of one drafted chunk (module docstring), then the manager's rollback."""
        seq = c.seq
        out = Appended(seq, self.clock())
        accepted = 0
        for j in range(c.rows):
            before = len(seq.token_ids)
            try:
                tok, agrees = self._target_token(c, rows, j)
                taken = self._take(seq, tok)
            except Exception as exc:  # noqa: BLE001 - this request only
                out.failed = Failure("sample", exc, token_taken=len(seq.token_ids) > before)
                break
            out.tokens.append(taken)
            if agrees:
                accepted += 1
            if taken.finish is not None or not agrees:
                break
        out.settle = lambda: c.settle(accepted)
        return out

    def _take(self, seq: Sequence, tok: int) -> Token:
        """``tok`` into ``seq``: its grammar (GuideViolation: the request fails), its tokens, its stop rules and
        detokenizer; the text it releases and, when it ends the request, why."""
        if seq.guide is not None:
            seq.guide.accept(tok)
        seq.token_ids.append(tok)
        reason = self._stop_reason(seq, tok)
        return Token(tok, seq.detokenizer.delta(reason is not None), reason)

    def _stop_reason(self, seq: Sequence, tok: int) -> FinishReason | None:
        """Feed the token to the detokenizer (unless it is an end token) and say whether seq is done."""
        p = seq.params
        if tok in p.stop_token_ids:
            seq.stop_reason = tok  # which stop ended it: a stop token id, or below a stop string (not the end token)
            return FinishReason.STOP
        if not p.ignore_eos and tok in self.eos_token_ids:
            return FinishReason.STOP
        seq.detokenizer.add(tok)
        if seq.detokenizer.stopped_by is not None:
            seq.stop_reason = seq.detokenizer.stopped_by
            return FinishReason.STOP
        if seq.guide is not None and seq.guide.terminated:  # the grammar is done (its end token, or nothing can follow)
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

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
