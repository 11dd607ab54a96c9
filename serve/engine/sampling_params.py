"""Per-request generation options, validated at construction so bad input never reaches the engine loop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from serve.guided.spec import GuidedDecoding

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-40 gives
# inf/NaN probabilities, which used to fail the whole batch.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_STOP_STRINGS = 16        # per request (vLLM/OpenAI allow 4; a few MB of stop strings slowed everyone)
MAX_STOP_STRING_CHARS = 256  # per stop string
MAX_STOP_TOKEN_IDS = 64
SEED_RANGE = (0, 2**64 - 1)  # torch.Generator.manual_seed's range; Triton's seed input is UINT64


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Options with vLLM's meanings. temperature == 0 means greedy (so does any temperature below
    GREEDY_TEMPERATURE_EPS: it is stored as 0.0); top_k == 0 means no top-k. Every value is checked here,
    once, with an error meant for the client (ValueError, or TypeError for a wrong type).

    Penalties follow TensorRT-LLM (and transformers for repetition_penalty): all three look at every
    token of the sequence so far, prompt included. repetition_penalty divides positive logits and
    multiplies negative ones of the tokens seen (1 = off); presence_penalty subtracts a constant from
    them, frequency_penalty subtracts its value times the token's count (0 = off). min_tokens blocks
    every end token (EOS unless ignore_eos, stop_token_ids) until that many tokens are generated.
    bad_words are strings the engine tokenizes; a word's last token is banned wherever the tokens
    before it were just generated (transformers' NoBadWordsLogitsProcessor). logprobs: report each
    sampled token's log-probability under the distribution it was drawn from (after penalties, bans
    and temperature, before top-k/top-p). guided_decoding: the output follows a JSON schema, regex, EBNF
    grammar or choice (serve/guided); the request ends when the grammar is complete (finish reason stop) or
    at max_tokens (length: the output is then incomplete and will not parse).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    logprobs: bool = False
    include_stop_str_in_output: bool = False  # vLLM's name; TensorRT-LLM's stop_words behave this way
    guided_decoding: GuidedDecoding | Any = None  # structured output (serve/guided); a dict is converted
    speculate: bool = True  # False: this request decodes without speculation (docs/speculation.md)
    perf_metrics: bool = False  # every output carries the request's numbers so far (RequestMetrics), not only the last

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens and self.stop:
            raise ValueError("min_tokens together with stop strings is not supported (stop strings would fire early)")
        if not _is_real(self.temperature) or not (0.0 <= self.temperature < math.inf):  # also rejects NaN
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            object.__setattr__(self, "temperature", 0.0)
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [0, 2**64 - 1] or None, got {self.seed!r}")
        self._check_stops()
        object.__setattr__(self, "guided_decoding", GuidedDecoding.from_value(self.guided_decoding))
        if self.guided_decoding is not None and self.min_tokens:
            raise ValueError("min_tokens together with guided decoding is not supported (the grammar decides "
                             "where the output ends)")

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str):
                raise TypeError("stop must be a string or a sequence of strings, got an element of type "
                                f"{type(s).__name__}")
            if s == "":
                raise ValueError("stop strings must be non-empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if not _is_int(t):
                raise TypeError(f"stop_token_ids must be integers, got {t!r}")
        self._validate_penalties()

    def _validate_penalties(self) -> None:
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        elif isinstance(self.bad_words, list):
            object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError("repetition_penalty must be a finite number > 0 (1 = off), got "
                             f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-math.inf < value < math.inf):
                raise ValueError(f"{name} must be a finite number (0 = off), got {value!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for w in self.bad_words:
            if not isinstance(w, str):
                raise TypeError(f"bad_words must be strings, got an element of type {type(w).__name__}")
            if w == "":
                raise ValueError("bad_words must be non-empty strings")
        for name in ("logprobs", "include_stop_str_in_output", "speculate", "perf_metrics"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def needs_history(self) -> bool:
        """Whether the sampler must look at the sequence's tokens (penalties, min_tokens, bad words)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0 or bool(self.bad_words))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """The sampler only takes the argmax of this row's raw logits (greedy, no history-dependent processor,
        no log-probabilities): what structured output's mask may skip when the argmax is allowed."""
        return self.greedy and not self.needs_history and not self.logprobs
