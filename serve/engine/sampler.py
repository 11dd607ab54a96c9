"""Next-token selection: greedy, temperature, top-k, top-p, with per-request seeded generators."""

from __future__ import annotations

from typing import Sequence

import torch

from serve.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None], default_generator: torch.Generator) -> list[int]:
    """logits: [S, vocab] fp32, one row per sequence. Returns one token id per row.

    A request with a seed owns its generator, so its samples do not depend on what else is in the batch.
    """
    out = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        probs = _filtered_probs(logits[row], p)
        gen = generators[row] if generators[row] is not None else default_generator
        out[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / p.temperature
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
