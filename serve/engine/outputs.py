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


@dataclass(frozen=True)
class RequestMetrics:
    """One request's life in numbers, as TensorRT-LLM's per-request perf metrics count it: its times on the engine
    clock (``time.perf_counter``, CLOCK_MONOTONIC on Linux; None until reached), its KV blocks and its speculation.

    KV blocks are counted each time the request starts computing from scratch (its admission, and again after a
    preemption): ``kv_reused_blocks`` came from the prefix cache, ``kv_missed_blocks`` are its prompt's other blocks
    (computed), ``kv_new_blocks`` every block allocated for it (draft blocks given back after verification
    included). Speculation: draft tokens verified for it and of those accepted. Quality (serve/engine/quality_meter.py):
    its output tokens served while some layer was quantized and while it read 8-bit KV blocks, and its positions the
    meter sampled, of which agreeing with full precision on the top-1 token."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    kv_reused_blocks: int = 0
    kv_missed_blocks: int = 0
    kv_new_blocks: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    quantized_layer_tokens: int = 0
    kv_8bit_tokens: int = 0
    quality_samples: int = 0
    quality_agreed: int = 0

    @property
    def kv_total_blocks(self) -> int:
        """Blocks it held from the pool in all: reused ones and newly allocated ones."""
        return self.kv_reused_blocks + self.kv_new_blocks

    @property
    def kv_hit_rate(self) -> float:
        """Share of its prompt blocks found in the prefix cache (0 when none was looked up)."""
        looked = self.kv_reused_blocks + self.kv_missed_blocks
        return self.kv_reused_blocks / looked if looked else 0.0

    @property
    def quality_agreement(self) -> float | None:
        """Its sampled top-1 agreement with full precision; None when the meter never sampled it."""
        return self.quality_agreed / self.quality_samples if self.quality_samples else None

    def quality_fields(self) -> dict[str, int | float | None]:
        """Its quality numbers (docs/quality.md) as the front ends pass them on: output tokens served while layers
        were quantized and while it read 8-bit KV, its sampled positions and their top-1 agreement (None: unsampled)."""
        return {"quantized_layer_tokens": self.quantized_layer_tokens, "kv_8bit_tokens": self.kv_8bit_tokens,
                "quality_samples": self.quality_samples, "quality_agreement": self.quality_agreement}

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted for it)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def perf_fields(self, final: bool) -> dict[str, int | float]:
        """TensorRT-LLM's per-request perf metrics under its Triton output names and units: times in integer ns of
        the engine clock (CLOCK_MONOTONIC, TensorRT-LLM's steady clock), 0 until reached; ``last_token_time_ns``
        only once the request is finished (``final``), as upstream's."""
        def ns(t: float | None) -> int:
            return 0 if t is None else int(round(t * 1e9))

        return {"kv_cache_reused_block": self.kv_reused_blocks, "kv_cache_missed_block": self.kv_missed_blocks,
                "kv_cache_alloc_new_blocks": self.kv_new_blocks, "kv_cache_alloc_total_blocks": self.kv_total_blocks,
                "kv_cache_hit_rate": self.kv_hit_rate, "arrival_time_ns": ns(self.arrival_time),
                "first_scheduled_time_ns": ns(self.first_scheduled_time),
                "first_token_time_ns": ns(self.first_token_time),
                "last_token_time_ns": ns(self.last_token_time) if final else 0, "acceptance_rate": self.acceptance_rate,
                "total_accepted_draft_tokens": self.accepted_draft_tokens, "total_draft_tokens": self.draft_tokens}


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
    # A request that stopped on a stop string or a stop token id (not the model's end token): which one.
    stop_reason: str | int | None = None
    # Its numbers as of the end of the step that produced this output: on every final output, and on every output
    # when SamplingParams.perf_metrics asked.
    metrics: RequestMetrics | None = None
    # The request's SLO tier as the engine resolved it (0 = strict): the front ends' per-tier latency metrics.
    priority: int | None = None


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

