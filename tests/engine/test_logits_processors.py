"""Penalties, bad words, min_tokens and log-probs against transformers' logits processors and generate().

Unit level: the engine's processing of one row of logits equals transformers' processors on the same
logits (same values, hence the same next-token choice). Engine level: greedy generation through the
engine with penalties / bad words equals transformers' generate() with the same options on the same
weights, and the reported log-probs equal log_softmax of transformers' logits.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.logits_processors import RowContext, banned_tokens, process_row
from serve.engine.sampling_params import SamplingParams
from tests.conftest import hf_reference_model

VOCAB = 512
PROMPT_LEN = 12


def _case(seed: int) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=g) * 3
    history = torch.randint(0, 40, (PROMPT_LEN + 10,), generator=g).tolist()  # repeats guaranteed
    return logits, history


def _hf(processor, history: list[int], logits: torch.Tensor) -> torch.Tensor:
    return processor(torch.tensor([history]), logits[None].clone())[0]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(seed: int, penalty: float) -> None:
    logits, history = _case(seed)
    ours = process_row(logits, SamplingParams(repetition_penalty=penalty), RowContext(history, PROMPT_LEN))
    ref = _hf(RepetitionPenaltyLogitsProcessor(penalty), history, logits)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert ours.argmax() == ref.argmax()
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("presence", "frequency"), [(0.8, 0.0), (0.0, 0.5), (1.2, -0.4), (-0.5, 0.9)])
def test_presence_frequency_match_sequence_bias(seed: int, presence: float, frequency: float) -> None:
    """Presence/frequency penalties = a per-token bias of -(presence + frequency * count) on every token seen;
    transformers' SequenceBiasLogitsProcessor applies such biases."""
    logits, history = _case(seed)
    p = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    ours = process_row(logits, p, RowContext(history, PROMPT_LEN))
    bias = {(tok,): -(presence + frequency * n) for tok, n in Counter(history).items()}
    ref = _hf(SequenceBiasLogitsProcessor(sequence_bias=[[list(k), v] for k, v in bias.items()]), history, logits)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert ours.argmax() == ref.argmax()


@pytest.mark.parametrize("seed", range(5))
def test_bad_words_match_transformers(seed: int) -> None:
    logits, history = _case(seed)
    words = ((history[-1],), (history[-1], 301), (7, 8, 450), (history[-2], history[-1], 300), (history[-1], 2, 302))
    ours = process_row(logits, SamplingParams(bad_words=("x",)), RowContext(history, PROMPT_LEN, (), words))
    ref = _hf(NoBadWordsLogitsProcessor([list(w) for w in words]), history, logits)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert ours.argmax() == ref.argmax()
    expected = {history[-1], 301, 300} | ({450} if history[-2:] == [7, 8] else set())
    assert banned_tokens(history, words) == expected


@pytest.mark.parametrize("generated", [0, 3, 5, 9])
def test_min_tokens_matches_transformers(generated: int) -> None:
    logits, history = _case(generated)
    ends = (5, 17)
    logits[ends[0]] = 50.0  # EOS would win
    history = history[: PROMPT_LEN + generated]
    ours = process_row(logits, SamplingParams(min_tokens=5), RowContext(history, PROMPT_LEN, ends))
    ref = _hf(MinNewTokensLengthLogitsProcessor(PROMPT_LEN, 5, list(ends)), history, logits)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert (ours.argmax().item() == ends[0]) == (generated >= 5)


def test_all_processors_compose_in_documented_order() -> None:
    logits, history = _case(11)
    words = ((history[-1], 3),)
    p = SamplingParams(max_tokens=32, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2,
                       min_tokens=20,
                       bad_words=("x",))
    ours = process_row(logits, p, RowContext(history, PROMPT_LEN, (9,), words))
    ref = logits.clone()
    bias = [[[t], -(0.3 + 0.2 * n)] for t, n in Counter(history).items()]
    for proc in (RepetitionPenaltyLogitsProcessor(1.4), SequenceBiasLogitsProcessor(sequence_bias=bias),
                 NoBadWordsLogitsProcessor([list(w) for w in words]),
                 MinNewTokensLengthLogitsProcessor(PROMPT_LEN, 20, [9])):
        ref = _hf(proc, history, ref)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs", [{"repetition_penalty": 0.0}, {"repetition_penalty": float("nan")},
                                    {"presence_penalty": float("inf")}, {"min_tokens": -1},
                                    {"min_tokens": 20, "max_tokens": 10}, {"bad_words": ("",)},
                                    {"bad_words": (3,)}, {"logprobs": 1}])
def test_bad_values_rejected(kwargs: dict) -> None:
    with pytest.raises((ValueError, TypeError)):
        SamplingParams(**kwargs)


# ---- engine level: greedy generation vs transformers' generate() on the same weights ----------------

NEW = 24


@pytest.fixture(scope="module")
def engine(tiny) -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=64, morph_mode="off"), loaded=tiny)


@pytest.fixture(scope="module")
def hf_tiny(tiny):
    return hf_reference_model(tiny)


def _hf_generate(model, ids: list[int], **kwargs) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                           min_new_tokens=NEW, **kwargs)
    return y[0, len(ids):].tolist()


def _ours(engine: LLMEngine, ids: list[int], **kwargs) -> dict:
    return engine.generate([ids], SamplingParams(max_tokens=NEW, ignore_eos=True, **kwargs))[0]


PROMPT = "The lighthouse keeper counted the steps, the steps, the steps"


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_engine_repetition_penalty_equals_transformers_generate(engine, hf_tiny, penalty: float) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    ours = _ours(engine, ids, repetition_penalty=penalty)["token_ids"]
    assert ours == _hf_generate(hf_tiny, ids, repetition_penalty=penalty)
    assert ours != _ours(engine, ids)["token_ids"], "the penalty changed nothing: a weak test"


def test_engine_bad_words_equal_transformers_generate(engine, hf_tiny) -> None:
    tok = engine.tokenizer
    ids = tok.encode(PROMPT)
    plain = _ours(engine, ids)["token_ids"]
    # A one-token and a two-token bad word taken from the unconstrained output, so the ban bites.
    words, words_ids = [], []
    for a, b in zip(plain, plain[1:]):
        text = tok.decode([a, b], skip_special_tokens=False)
        if tok.backend.encode(text, add_special_tokens=False).ids == [a, b] and len(words) < 1:
            words.append(text)
            words_ids.append([a, b])
    single = tok.decode([plain[0]], skip_special_tokens=False)
    assert tok.backend.encode(single, add_special_tokens=False).ids == [plain[0]]
    words.append(single)
    words_ids.append([plain[0]])
    assert len(words) == 2
    ours = _ours(engine, ids, bad_words=tuple(words))["token_ids"]
    assert ours == _hf_generate(hf_tiny, ids, bad_words_ids=words_ids)
    assert ours != plain and plain[0] not in ours


def test_engine_logprobs_equal_transformers_log_softmax(engine, hf_tiny) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    got: list[float] = []
    toks: list[int] = []

    def collect(out) -> None:
        toks.extend(out.new_token_ids)
        got.extend(out.new_logprobs or [])

    engine.add_request(ids, SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=True,
                                           repetition_penalty=1.2), callback=collect)
    while engine.has_unfinished_requests():
        engine.step()
    x = torch.tensor([ids])
    with torch.inference_mode():
        y = hf_tiny.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                             min_new_tokens=NEW, repetition_penalty=1.2, output_scores=True,
                             return_dict_in_generate=True)
    ref_tokens = y.sequences[0, len(ids):].tolist()
    ref = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(y.scores, ref_tokens)]
    assert toks == ref_tokens
    assert len(got) == NEW
    assert got == pytest.approx(ref, abs=1e-4)
    assert all(v <= 0 for v in got)
