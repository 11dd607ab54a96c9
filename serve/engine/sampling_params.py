"""Per-request generation options, validated at construction so bad input never reaches the engine loop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Options with vLLM's meanings. temperature == 0 means greedy; top_k == 0 means no top-k."""

    max_tokens: int = 16
    min_tokens: int = 0    # EOS and stop_token_ids cannot be sampled before this many output tokens
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.min_tokens and self.stop:
            raise ValueError("min_tokens together with stop strings is not supported (stop strings would fire early)")
        if not (0.0 <= self.temperature < math.inf):  # also rejects NaN
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str):
                raise TypeError(f"stop must be a string or a sequence of strings, got an element of type {type(s).__name__}")
            if s == "":
                raise ValueError("stop strings must be non-empty")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool):
                raise TypeError(f"stop_token_ids must be integers, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
