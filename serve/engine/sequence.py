"""A request's state inside the engine: tokens, KV blocks, progress, and its output channel."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from serve.engine.outputs import FinishReason, RequestMetrics, RequestOutput
from serve.engine.sampling_params import SamplingParams
from serve.engine.slo import RequestSLO
from serve.guided.state import GuideState
from serve.memory.kv_cache_manager import KVBlockCounts
from serve.model.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # guided: its grammar compiles; not schedulable (grammar_wait.py)
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    detokenizer: IncrementalDetokenizer
    callback: Callable[[RequestOutput], None] | None = None
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)   # prompt + output
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    slo: RequestSLO = field(default_factory=RequestSLO)  # resolved by the engine: every target set
    first_scheduled_time: float | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()   # params.bad_words, tokenized at admission
    block_hashes: list[bytes] = field(default_factory=list)  # prefix caching: hashes of its full blocks so far
    hash_root: bytes | None = None     # the pool's cache root its KV is being computed under (None: not caching)
    guide: GuideState | None = None    # structured output: the grammar's state, advanced on every accepted token
    deadline: float | None = None      # engine clock: past it the request ends as deadline exceeded (lifecycle.py)
    kv_counts: KVBlockCounts = field(default_factory=KVBlockCounts)  # its blocks reused / missed / new (the manager's)
    num_draft_tokens: int = 0          # self-speculative decoding: draft tokens verified for it
    num_accepted_draft_tokens: int = 0  # of which accepted
    served_quantized_tokens: int = 0   # quality meter: its tokens served while some layer was quantized
    served_kv_8bit_tokens: int = 0     # ... while it read 8-bit KV blocks
    quality_samples: int = 0           # its positions the meter sampled, and of those agreeing with full precision
    quality_agreed: int = 0
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (not the model's end token)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    def metrics(self) -> RequestMetrics:
        """Its numbers so far (serve/engine/outputs.py says what each counts)."""
        kv = self.kv_counts
        return RequestMetrics(self.arrival_time, self.first_scheduled_time, self.first_token_time, self.last_token_time,
                              kv.reused, kv.missed, kv.new, self.num_draft_tokens, self.num_accepted_draft_tokens,
                              self.served_quantized_tokens, self.served_kv_8bit_tokens, self.quality_samples,
                              self.quality_agreed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_decoding(self) -> bool:
        """In its generation phase: it has emitted a token and only the last sampled one is left to compute (a
        recompute after preemption is not decoding until it is caught up). What SLO-aware scheduling gives a
        time-between-tokens deadline; its next chunk is a ``ScheduledChunk.is_decode`` (not conversely)."""
        return self.num_output_tokens > 0 and self.num_tokens - self.num_computed_tokens == 1

    def blocks_needed(self, num_new_tokens: int, block_size: int) -> int:
        """Extra blocks required to hold num_computed_tokens + num_new_tokens tokens."""
        return max(0, math.ceil((self.num_computed_tokens + num_new_tokens) / block_size) - len(self.block_ids))
