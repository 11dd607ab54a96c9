"""What a request must satisfy before it is admitted, checked in the caller's thread: a prompt that tokenizes to
something, token ids in the vocabulary, prompt + max_tokens within the context, bad words that are tokens, and a
KV need that some configuration of this engine's mode can hold (else it would preempt forever)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from serve.engine.sampling_params import SamplingParams
from serve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestValidator:
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    block_size: int
    reachable_blocks: int  # the most KV blocks the engine's mode can ever have
    reach_note: str        # how that bound comes about, for the error message
    morph_mode: str

    def tokenize(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int],
                                                                                 tuple[tuple[int, ...], ...]]:
        """(prompt token ids, bad words as token sequences); ValueError / TypeError naming what is wrong."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if not ids:
            raise ValueError("prompt is empty after tokenization")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens "
                             f"(prompt + at least one generated token must fit)")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                             f"length {self.max_model_len}; lower max_tokens to at most "
                             f"{self.max_model_len - len(ids)}")
        bad_words = self.bad_words_ids(params)
        blocks = math.ceil((len(ids) + params.max_tokens) / self.block_size)
        if blocks > self.reachable_blocks:
            raise ValueError(f"request needs {blocks} KV blocks (prompt {len(ids)} + max_tokens {params.max_tokens}) "
                             f"but the KV pool can never hold more than {self.reachable_blocks} in morph mode "
                             f"{self.morph_mode!r} ({self.reach_note}); lower max_tokens, raise "
                             "device_memory, or use a mode that quantizes more layers")
        return ids, bad_words

    def bad_words_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """params.bad_words as token sequences (no special tokens added)."""
        out = []
        for word in params.bad_words:
            ids = self.tokenizer.backend.encode(word, add_special_tokens=False).ids
            if not ids:
                raise ValueError(f"bad word {word!r} tokenizes to nothing")
            out.append(tuple(ids))
        return tuple(out)
