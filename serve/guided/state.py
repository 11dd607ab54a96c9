"""A request's grammar state: the matcher that says which tokens may come next, advanced on every token the
engine accepts, and the batch step that masks the logits of guided rows before sampling.

Preemption needs no rollback here: the engine recomputes a preempted request's KV from the tokens it kept, so
the matcher, which has seen exactly those tokens, stays right. A morph swap changes weights, not tokens."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from serve.guided.spec import GuidedDecoding


class GuideViolation(RuntimeError):
    """A token the grammar does not allow reached the matcher (a processor such as bad_words or min_tokens
    removed every token the grammar allows): the request fails with this reason; others go on."""


class GuideState:
    def __init__(self, spec: GuidedDecoding, compiled: Any) -> None:
        import xgrammar as xgr

        self.spec = spec
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(int(token)):
            raise GuideViolation(f"token {token} is not allowed by the {self.spec.kind} guide after "
                                 f"{self.num_accepted} tokens (bad_words or another option left no allowed token)")
        self.num_accepted += 1

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its end token was accepted: the request is done."""
        return bool(self.matcher.is_terminated())


def mask_guided_rows(logits: torch.Tensor, states: Sequence[GuideState | None]) -> None:
    """Set, in place, the logits of every token a row's grammar forbids to -inf (rows without a guide
    unchanged). ``logits``: ``[rows, vocab]`` fp32."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for i in rows:
        states[i].matcher.fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
