"""Speculative sampling keeps the target distribution: the acceptance rule on a small vocabulary (many draws), and on
the real SmolLM2 engine the first speculative tokens of many seeded requests (top-k 3) against plain sampling's;
a seeded request repeats itself with speculation on."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.engine.spec_manager import SpeculationManager
from serve.engine.token_append import speculative_sample


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at upper-tail probability 0.001 (z = 3.09), Wilson-Hilferty's approximation."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_two_samples(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over the outcomes both saw (cells expected below 5 pooled), and its df."""
    na, nb = sum(a.values()), sum(b.values())
    cells, pooled = [], [0, 0]
    for key in set(a) | set(b):
        if (a[key] + b[key]) * min(na, nb) / (na + nb) < 5:
            pooled[0] += a[key]
            pooled[1] += b[key]
        else:
            cells.append((a[key], b[key]))
    if sum(pooled):
        cells.append(tuple(pooled))
    stat = 0.0
    for x, y in cells:
        ex, ey = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return stat, len(cells) - 1


def test_the_acceptance_rule_emits_the_target_distribution():
    p = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10, 0.0])
    q = torch.tensor([0.30, 0.10, 0.25, 0.05, 0.10, 0.20])  # differs everywhere it can, puts mass where p has none
    gen = torch.Generator().manual_seed(7)
    n = 20000
    counts = collections.Counter()
    accepted = 0
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=gen))
        tok, ok = speculative_sample(p, q, d, gen)
        counts[tok] += 1
        accepted += ok
    assert counts[5] == 0  # never a token the target excludes
    stat = sum((counts[i] - n * float(p[i])) ** 2 / (n * float(p[i])) for i in range(5))
    assert stat < chi2_critical(4), (stat, counts)
    assert abs(accepted / n - float(torch.minimum(p, q).sum())) < 0.02  # acceptance = sum min(p, q)


@pytest.fixture(scope="module")
def engines(smollm):
    cfg = dict(num_kv_blocks=512, max_num_seqs=64, enable_prefix_caching=False)
    plain = LLMEngine(EngineConfig(speculation="off", **cfg), loaded=smollm)
    drafting = LLMEngine(EngineConfig(speculation="always", **cfg), loaded=smollm)
    yield plain, drafting
    plain.shutdown()
    drafting.shutdown()


def test_first_speculative_tokens_follow_plain_samplings_distribution(engines):
    """Token 1 comes from the prompt's step, token 2 from the first drafting step (a draft of one token verified:
    accepted, or resampled from max(0, p - q)): their joint distribution over 320 seeds matches plain sampling's."""
    plain, drafting = engines
    prompt = "My favourite colour is"
    n = 320
    joint = []
    for engine, seeds in ((plain, range(n)), (drafting, range(10_000, 10_000 + n))):  # independent samples
        params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=s, ignore_eos=True) for s in seeds]
        outs = []
        for i in range(0, n, 64):  # waves that fit the batch: nothing waits, so every decode step drafts
            outs += engine.generate([prompt] * len(params[i:i + 64]), params[i:i + 64])
        joint.append(collections.Counter(tuple(o["token_ids"][:2]) for o in outs))
    manager = drafting.resource_manager(SpeculationManager)
    assert manager.num_draft_tokens >= n  # every request's second token went through a draft
    assert 0 < manager.num_accepted_tokens < manager.num_draft_tokens
    stat, df = chi2_two_samples(*joint)
    assert df >= 3 and stat < chi2_critical(df), (stat, df, joint)


def test_a_seeded_request_repeats_itself_with_speculation(engines):
    _, drafting = engines
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    first = drafting.generate(["Once upon a time"], sp)[0]["token_ids"]
    assert drafting.generate(["Once upon a time"], sp)[0]["token_ids"] == first
