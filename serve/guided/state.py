"""A request's grammar state: the matcher that says which tokens may come next, advanced on every token the
engine accepts, and the batch step that masks the logits of guided rows before sampling.

Two grammar engines stand behind the same three calls (``fill`` a row of a packed int32 bitmask, ``accept`` a
token, ``terminated``): xgrammar (the default) and llguidance; both use the same bitmask layout (bit j of word
i allows token 32 * i + j).

Preemption needs no rollback here: the engine recomputes a preempted request's KV from the tokens it kept, so
the matcher, which has seen exactly those tokens, stays right. A morph swap changes weights, not tokens."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from serve.guided.spec import GuidedDecoding


class GuideViolation(RuntimeError):
    """A token the grammar does not allow reached the matcher (a processor such as bad_words removed every
    token the grammar allows), or the grammar allows no token at all (a dead end): the request fails with this
    reason, as its own input's fault (the engine's kind invalid input); others go on."""


class GuideState:
    """The grammar state of one request (base of the engines' matchers)."""

    backend = ""

    def __init__(self, spec: GuidedDecoding) -> None:
        self.spec = spec
        self.num_accepted = 0

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        raise NotImplementedError

    def _accept(self, token: int) -> bool:
        raise NotImplementedError

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its end token was accepted: the request is done."""
        raise NotImplementedError

    def accept(self, token: int) -> None:
        if not self._accept(int(token)):
            raise GuideViolation(f"token {token} is not allowed by the {self.spec.kind} guide after "
                                 f"{self.num_accepted} tokens (bad_words or another option left no allowed token)")
        self.num_accepted += 1


class XgrammarState(GuideState):
    backend = "xgrammar"

    def __init__(self, spec: GuidedDecoding, compiled: Any) -> None:
        import xgrammar as xgr

        super().__init__(spec)
        self.matcher = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def _accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class LlguidanceState(GuideState):
    backend = "llguidance"

    def __init__(self, spec: GuidedDecoding, matcher: Any) -> None:
        super().__init__(spec)
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def _accept(self, token: int) -> bool:
        return bool(self.matcher.consume_token(token)) and not self.matcher.is_error()

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_stopped())


def mask_guided_rows(logits: torch.Tensor, states: Sequence[GuideState | None],
                     argmax_only: Sequence[bool] | None = None) -> None:
    """Set, in place, the logits of every token a row's grammar forbids to -inf (rows without a guide
    unchanged). ``logits``: ``[rows, vocab]`` fp32.

    ``argmax_only[i]``: row i is only ever reduced to its argmax (greedy, no penalties, no log-probs). Such a
    row is left unmasked when the grammar allows its argmax, which is then also the argmax of the masked row
    (the first maximum overall is the first allowed maximum): the same token, without writing -inf over the
    vocabulary (~0.1 ms a row here)."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return
    words = (logits.shape[-1] + 31) // 32
    bitmask = torch.full((logits.shape[0], words), -1, dtype=torch.int32)  # all allowed
    for i in rows:
        state = states[i]
        state.fill(bitmask, i)  # type: ignore[union-attr]
        if not bool(bitmask[i].any()):  # a dead end: sampling from no token at all would fail as an engine error
            raise GuideViolation(f"the {state.spec.kind} guide allows no token after "  # type: ignore[union-attr]
                                 f"{state.num_accepted} tokens: it cannot be completed")  # type: ignore[union-attr]
    if argmax_only is not None:  # a greedy row whose argmax the grammar allows keeps it: no mask needed
        top = logits.argmax(dim=-1).tolist()
        rows = [i for i in rows if not (argmax_only[i] and int(bitmask[i, top[i] // 32]) >> (top[i] % 32) & 1)]
        if not rows:
            return
    if logits.device.type == "cpu":
        import xgrammar as xgr  # its CPU kernel applies the mask of the rows named, whichever engine filled it

        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    else:
        apply_bitmask(logits, bitmask.to(logits.device), rows)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """The mask in plain torch ops, for devices xgrammar's CPU kernel does not serve (no triton here): bit j of
    word i of a row allows token ``32 * i + j``; the named rows' forbidden logits become -inf."""
    index = torch.as_tensor(list(rows), device=logits.device)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (bitmask.index_select(0, index).unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(len(index), -1)[:, : logits.shape[-1]].bool()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
