"""Per-request logits processing that depends on the sequence so far: repetition / presence / frequency
penalties, bad words and min_tokens. Applied to one row of logits before temperature and top-k/top-p.

Order (fixed, documented in SamplingParams): repetition penalty, presence and frequency penalties,
bad words, min_tokens. Each step matches a transformers logits processor on the same logits
(tests/engine/test_logits_processors.py): RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor
(presence/frequency as per-token biases), NoBadWordsLogitsProcessor, MinNewTokensLengthLogitsProcessor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from serve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowContext:
    """What the processors need to know about one sequence besides its logits."""

    token_ids: Sequence[int]                 # prompt + output so far
    num_prompt_tokens: int
    end_token_ids: tuple[int, ...] = ()      # tokens min_tokens blocks (EOS unless ignore_eos, stop ids)
    bad_words_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def process_row(logits: torch.Tensor, p: SamplingParams, ctx: RowContext) -> torch.Tensor:
    """A processed copy of one row of logits ([vocab], fp32)."""
    logits = logits.clone()
    if ctx.token_ids and (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
        ids = torch.as_tensor(list(ctx.token_ids), dtype=torch.long, device=logits.device)
        if p.repetition_penalty != 1.0:
            seen = ids.unique()
            score = logits[seen]
            logits[seen] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            counts = torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
            logits -= p.presence_penalty * (counts > 0).to(logits.dtype) + p.frequency_penalty * counts
    if ctx.bad_words_ids:
        banned = banned_tokens(ctx.token_ids, ctx.bad_words_ids)
        if banned:
            logits[list(banned)] = float("-inf")
    if p.min_tokens and ctx.num_output_tokens < p.min_tokens and ctx.end_token_ids:
        logits[list(ctx.end_token_ids)] = float("-inf")
    return logits


def banned_tokens(token_ids: Sequence[int], bad_words_ids: Sequence[Sequence[int]]) -> set[int]:
    """Last tokens of the bad words whose other tokens are exactly the end of ``token_ids``."""
    out: set[int] = set()
    n = len(token_ids)
    for word in bad_words_ids:
        prefix = len(word) - 1
        if prefix == 0 or (prefix <= n and list(token_ids[n - prefix:]) == list(word[:-1])):
            out.add(word[-1])
    return out
