"""What the engine hands back to callers, one object per request per step that produced something."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from serve.error_kinds import ErrorKind


class FinishReason(str, Enum):
    LENGTH = "length"      # max_tokens reached
    STOP = "stop"          # EOS, a stop token id or a stop string
    ABORT = "abort"        # cancelled by the caller (error_kind: cancelled)
    ERROR = "error"        # ended by the engine: `error` says why, `error_kind` what kind of failure it is


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
    # A final output that is not an answer (finish_reason abort or error): what kind of error ended it
    # (serve/error_kinds.py) and, for a retryable kind, when to come back. Front ends answer by these.
    error_kind: ErrorKind | None = None
    retry_after_s: int | None = None


class OutputCollector:
    """Streamed outputs gathered per request into ``generate()``'s dicts: text, token_ids, and once finished
    finish_reason, num_prompt_tokens, ttft_s, error and error_kind. Use the instance as the requests' callback."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}

    def __call__(self, out: RequestOutput) -> None:
        r = self.results.setdefault(out.request_id, {"text": "", "token_ids": []})
        r["text"] += out.new_text
        r["token_ids"] += out.new_token_ids
        if out.finished:
            r["finish_reason"] = out.finish_reason.value if out.finish_reason else None
            r["num_prompt_tokens"] = out.num_prompt_tokens
            r["ttft_s"] = (out.first_token_time - out.arrival_time) if out.first_token_time else None
            r["error"] = out.error
            r["error_kind"] = out.error_kind.value if out.error_kind is not None else None

    def finished(self, request_id: str) -> bool:
        return "finish_reason" in self.results.get(request_id, {})

