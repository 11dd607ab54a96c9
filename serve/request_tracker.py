"""Per-request latency and finish accounting, the same behind every front end.

A front end (the Triton model, the Dynamo worker) starts a record when a request arrives, hands the tracker
each of the engine's outputs for it with the time the front end saw it, and tells it when it ends a request
itself (the client cancelled, the request's deadline passed, it waited too long for a first token). The
tracker turns that into the request metrics of serve/metrics_catalogue.py: time to first token, inter-token
latency, end-to-end latency, queue time, and the finish-reason and prompt-token counters, through a sink
the front end provides (Triton's custom-metrics API, the Dynamo worker's exposition text).

A request is finished exactly once: its record leaves the tracker with its first finish, so a cancellation
racing the engine's final output, or a timeout noticed twice, is counted once.

Transport-neutral and engine-neutral: it reads the engine's ``RequestOutput`` by duck type and imports
nothing but the catalogue, so any front end (and serve.triton, which never imports the engine) may use it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from serve.metrics_catalogue import (E2E_REQUEST_LATENCY, INTER_TOKEN_LATENCY, REQUEST_QUEUE_TIME,
                                     TIME_TO_FIRST_TOKEN, RequestHistogram)

# Finish reasons the front ends decide (the engine's own are stop, length, error; its abort counts as cancelled).
CANCELLED = "cancelled"
TIMEOUT = "timeout"
OVERLOADED = "overloaded"
_ENGINE_REASONS = {"abort": CANCELLED}


class RequestMetricsSink(Protocol):
    """Where the tracker's numbers go (one per front end)."""

    def observe(self, metric: RequestHistogram, value: float) -> None: ...

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
    arrival_time: float
    first_scheduled_time: float | None


@dataclass
class TrackedRequest:
    """One request's timeline in the front end's clock (``time.perf_counter`` unless the tracker was given another)."""

    request_id: str
    arrival: float
    deadline: float | None = None  # past it the front end aborts the request (finish reason "timeout")
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
    def timeout_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - self.arrival

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline


def engine_finish_reason(out: EngineOutput) -> str:
    """The finish reason of a final output in the metrics' vocabulary ("error" when it failed without one)."""
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

    def start(self, request_id: str, arrival: float | None = None, timeout_s: float | None = None) -> TrackedRequest:
        arrival = self._clock() if arrival is None else arrival
        record = TrackedRequest(request_id, arrival, None if timeout_s is None else arrival + timeout_s)
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
                    for _ in range(n_new):
                        self._sink.observe(INTER_TOKEN_LATENCY, gap)
                record.last_token_time = t
            record.num_prompt_tokens = out.num_prompt_tokens
            record.num_output_tokens = out.num_output_tokens
            if out.finished:
                first = out.first_scheduled_time
                if first is not None:  # the engine's own clock, both ends
                    self._sink.observe(REQUEST_QUEUE_TIME, max(0.0, first - out.arrival_time))
                self._sink.observe(E2E_REQUEST_LATENCY, t - record.arrival)
                self._finish_locked(record, engine_finish_reason(out), t)
            return record

    def finish(self, request_id: str, reason: str, t: float | None = None) -> TrackedRequest | None:
        """End a request the front end answers itself (``CANCELLED``, ``TIMEOUT``, ``OVERLOADED``, ...): its
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

    def expired(self, now: float | None = None) -> list[TrackedRequest]:
        """The tracked requests whose deadline has passed (the front end aborts them and calls ``finish``)."""
        now = self._clock() if now is None else now
        with self._lock:
            return [r for r in self._requests.values() if r.expired(now)]

    def _finish_locked(self, record: TrackedRequest, reason: str, t: float) -> None:
        del self._requests[record.request_id]
        record.finish_reason, record.finish_time = reason, t
        self._sink.count_finished(reason, record.num_prompt_tokens)
