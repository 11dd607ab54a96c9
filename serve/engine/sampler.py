"""Next-token selection: greedy, temperature, top-k, top-p, with per-request seeded generators; the
history-dependent processors (penalties, bad words, min_tokens) and log-probabilities when asked for."""

from __future__ import annotations

from typing import Sequence

import torch

from serve.engine.logits_processors import RowContext, process_row
from serve.engine.sampling_params import SamplingParams
from serve.engine.sequence import Sequence as Request
from serve.guided.state import mask_guided_rows


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None], default_generator: torch.Generator) -> list[int]:
    """logits: [S, vocab] fp32, one row per sequence. Returns one token id per row.

    A request with a seed owns its generator, so its samples do not depend on what else is in the batch.
    """
    return sample_with_logprobs(logits, params, generators, default_generator)[0]


def sample_with_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
                         generators: Sequence[torch.Generator | None], default_generator: torch.Generator,
                         contexts: Sequence[RowContext | None] | None = None,
                         ) -> tuple[list[int], list[float | None]]:
    """Like ``sample``; rows whose params need the sequence's history get it from ``contexts``.
    Returns (token ids, log-probabilities: None for rows that did not ask for them)."""
    out = logits.argmax(dim=-1).tolist()
    logprobs: list[float | None] = [None] * len(out)
    for row, p in enumerate(params):
        ctx = contexts[row] if contexts is not None else None
        history = p.needs_history and ctx is not None
        if p.greedy and not history and not p.logprobs:
            continue
        row_logits = process_row(logits[row], p, ctx) if history else logits[row]
        if history and p.greedy:
            out[row] = int(row_logits.argmax().item())
        if not p.greedy:
            scaled = row_logits / p.temperature
            probs = filtered_probs(scaled, p)
            gen = generators[row] if generators[row] is not None else default_generator
            out[row] = int(torch.multinomial(probs, 1, generator=gen).item())
        else:
            scaled = row_logits
        if p.logprobs:
            logprobs[row] = float(torch.log_softmax(scaled, dim=-1)[out[row]].item())
    return out, logprobs


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits already divided by the temperature -> top-k / top-p filtered probabilities."""
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop = (cumulative - sorted_probs) >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def target_probs(logits: torch.Tensor, p: SamplingParams, ctx: RowContext | None) -> torch.Tensor:
    """The distribution a sampled row is drawn from: processed on the history (when it needs it), divided by the
    temperature, top-k / top-p filtered (what ``sample_with_logprobs`` draws from)."""
    row = process_row(logits, p, ctx) if p.needs_history and ctx is not None else logits
    return filtered_probs(row / p.temperature, p)


def row_context(seq: Request, eos_token_ids: Sequence[int]) -> RowContext:
    """What the history-dependent processors read of a request: its tokens, prompt length, end and bad tokens."""
    p = seq.params
    ends = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos_token_ids))
    return RowContext(seq.token_ids, seq.num_prompt_tokens, ends, seq.bad_words_ids)


def sample_isolated(logits: torch.Tensor, seqs: list[Request], eos_token_ids: Sequence[int],
                    default_generator: torch.Generator) -> list[tuple[int | BaseException, float | None]]:
    """Sample the batch (token, log-prob), guided rows masked first; if that raises, row by row so only the
    offending rows fail (their exception in place of the token)."""
    def run(rows_logits: torch.Tensor, rows: list[Request]) -> list[tuple[int, float | None]]:
        contexts = [row_context(s, eos_token_ids) if s.params.needs_history else None for s in rows]
        guides = [s.guide for s in rows]
        if any(g is not None for g in guides):  # nothing per step for batches without a guide
            mask_guided_rows(rows_logits, guides, [s.params.argmax_only for s in rows])
        tokens, logprobs = sample_with_logprobs(rows_logits, [s.params for s in rows], [s.generator for s in rows],
                                                default_generator, contexts)
        return list(zip(tokens, logprobs))
    try:
        return run(logits, seqs)
    except Exception:  # noqa: BLE001
        out: list[tuple[int | BaseException, float | None]] = []
        for i, s in enumerate(seqs):
            try:
                out.append(run(logits[i:i + 1], [s])[0])
            except Exception as exc:  # noqa: BLE001
                out.append((exc, None))
        return out

