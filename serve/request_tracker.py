"""Per-request latency and finish accounting, the same behind every front end.

A front end (the Triton model, the Dynamo worker) starts a record when a request arrives, hands the tracker
each of the engine's outputs for it with the time the front end saw it, and tells it when it ends a request
itself (the client went away before the engine's final output). A request the engine ended early (cancelled,
its deadline passed, shed at its queue deadline) is counted by its final output's ``error_kind``. The
tracker turns that into the request metrics of serve/metrics_catalogue.py: time to first token, inter-token
latency, end-to-end latency, queue time, and the finish-reason and prompt-token counters, through a sink
the front end provides (Triton's custom-metrics API, the Dynamo worker's exposition text).

A request is finished exactly once: its record leaves the tracker with its first finish, so a cancellation
racing the engine's final output, or a timeout noticed twice, is counted once.

Transport-neutral and engine-neutral: it reads the engine's ``RequestOutput`` by duck type and imports
nothing but the catalogue and the error kinds, so any front end (and serve.triton, which never imports the
engine) may use it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from serve.error_kinds import ErrorKind
from serve.metrics_catalogue import (
    E2E_REQUEST_LATENCY,
    INTER_TOKEN_LATENCY,
    REQUEST_QUEUE_TIME,
    TIER_INTER_TOKEN_LATENCY,
    TIME_TO_FIRST_TOKEN,
    RequestHistogram,
)

# Finish reasons besides the engine's own stop, length and error: a request ended before its answer.
CANCELLED = "cancelled"
TIMEOUT = "timeout"
OVERLOADED = "overloaded"
_ENGINE_REASONS = {"abort": CANCELLED}
KIND_REASONS = {ErrorKind.CANCELLED: CANCELLED, ErrorKind.DEADLINE_EXCEEDED: TIMEOUT, ErrorKind.OVERLOADED: OVERLOADED}
"""The finish reason a request ended with this error kind counts as; other kinds count as "error"."""
_UNANSWERED = frozenset(KIND_REASONS.values())  # ended before their answer: no end-to-end latency observed


class RequestMetricsSink(Protocol):
    """Where the tracker's numbers go (one per front end)."""

    def observe(self, metric: RequestHistogram, value: float, label: str | None = None) -> None:
        """``label``: the value of the histogram's one label (``metric.label``), None for an unlabelled one."""

    def count_finished(self, reason: str, prompt_tokens: int) -> None: ...


class EngineOutput(Protocol):
    """What the tracker reads of ``serve.engine.outputs.RequestOutput``."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: Any  # FinishReason (a str enum) or None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None
    error_kind: ErrorKind | None
    arrival_time: float
    first_scheduled_time: float | None
    priority: int | None


@dataclass
class TrackedRequest:
    """One request's timeline in the front end's clock (``time.perf_counter`` unless the tracker was given another)."""

    request_id: str
    arrival: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None
    finish_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival


def engine_finish_reason(out: EngineOutput) -> str:
    """The finish reason of a final output in the metrics' vocabulary: by its error kind when the engine ended it
    early ("error" when it failed without a reason)."""
    kind = getattr(out, "error_kind", None)
    if kind in KIND_REASONS:
        return KIND_REASONS[kind]
    reason = getattr(out.finish_reason, "value", out.finish_reason) or ""
    if not reason:
        return "error" if out.error else "unknown"
    return _ENGINE_REASONS.get(reason, reason)


class RequestTracker:
    """The requests a front end has in flight, and what their outputs tell the request metrics."""

    def __init__(self, sink: RequestMetricsSink, clock: Callable[[], float] = time.perf_counter) -> None:
        self._sink = sink
        self._clock = clock
        self._lock = threading.Lock()
        self._requests: dict[str, TrackedRequest] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def start(self, request_id: str, arrival: float | None = None) -> TrackedRequest:
        arrival = self._clock() if arrival is None else arrival
        record = TrackedRequest(request_id, arrival)
        with self._lock:
            self._requests[request_id] = record
        return record

    def on_output(self, out: EngineOutput, t: float | None = None) -> TrackedRequest | None:
        """Account one engine output seen at ``t``: the first tokens give the TTFT, later ones the
        inter-token gaps (a group of n tokens counts n gaps of 1/n of the wait each), a final output
        finishes the request. None when the request is not (or no longer) tracked."""
        t = self._clock() if t is None else t
        with self._lock:
            record = self._requests.get(out.request_id)
            if record is None:
                return None
            n_new = len(out.new_token_ids)
            if n_new:
                if record.last_token_time is None:
                    record.first_token_time = t
                    self._sink.observe(TIME_TO_FIRST_TOKEN, t - record.arrival)
                else:
                    gap = (t - record.last_token_time) / n_new
                    tier = getattr(out, "priority", None)
                    for _ in range(n_new):
                        self._sink.observe(INTER_TOKEN_LATENCY, gap)
                        if tier is not None:
                            self._sink.observe(TIER_INTER_TOKEN_LATENCY, gap, str(tier))
                record.last_token_time = t
            record.num_prompt_tokens = out.num_prompt_tokens
            record.num_output_tokens = out.num_output_tokens
            if out.finished:
                reason = engine_finish_reason(out)
                first = out.first_scheduled_time
                if reason not in _UNANSWERED:  # a cancelled, timed-out or shed request has no e2e latency
                    if first is not None:  # the engine's own clock, both ends
                        self._sink.observe(REQUEST_QUEUE_TIME, max(0.0, first - out.arrival_time))
                    self._sink.observe(E2E_REQUEST_LATENCY, t - record.arrival)
                self._finish_locked(record, reason, t)
            return record

    def finish(self, request_id: str, reason: str, t: float | None = None) -> TrackedRequest | None:
        """End a request the front end answers itself (``CANCELLED`` when its client left): its
        finish reason is counted, no end-to-end latency is observed (only the engine completes a request).
        None when it had finished already (then nothing is counted again)."""
        t = self._clock() if t is None else t
        with self._lock:
            record = self._requests.get(request_id)
            if record is not None:
                self._finish_locked(record, reason, t)
            return record

    def forget(self, request_id: str) -> None:
        """Drop a record without counting it (the engine refused the request, or the front end failed to answer
        it: it is an error response, not a finished request)."""
        with self._lock:
            self._requests.pop(request_id, None)

    def refused(self, reason: str) -> None:
        """A request turned away on arrival, before it was tracked (say, shed as ``OVERLOADED``)."""
        with self._lock:
            self._sink.count_finished(reason, 0)

    def _finish_locked(self, record: TrackedRequest, reason: str, t: float) -> None:
        del self._requests[record.request_id]
        record.finish_reason, record.finish_time = reason, t
        self._sink.count_finished(reason, record.num_prompt_tokens)
