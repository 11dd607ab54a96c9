"""What the engine hands back to callers, one object per request per step that produced something."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class FinishReason(str, Enum):
    LENGTH = "length"      # max_tokens reached
    STOP = "stop"          # EOS, a stop token id or a stop string
    ABORT = "abort"        # cancelled by the caller
    ERROR = "error"        # rejected or failed; `error` says why


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    # Monotonic timestamps (time.perf_counter) filled by the engine, for TTFT/ITL accounting.
    arrival_time: float = 0.0
    first_token_time: float | None = None
    # When the scheduler first gave the request a slot (queue time = this - arrival_time).
    first_scheduled_time: float | None = None
    # Log-probability of each token in new_token_ids, when SamplingParams.logprobs asked for them.
    new_logprobs: list[float] | None = None
