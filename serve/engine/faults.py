"""Engine fault bookkeeping: which iterations failed, whether the engine is still healthy, one JSON log
event (with the traceback) per failure.

A failure that can be pinned to requests (a row of the sampler, a detokenizer) fails only those
requests and does not count against health; a failed forward or morph step counts as a failed
iteration. After ``max_consecutive`` failed iterations in a row the engine reports unhealthy, and the
serving layer refuses new requests with the reason instead of failing every batch forever.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable

from serve.logging_setup import get_logger

log = get_logger("engine")

DEFAULT_MAX_CONSECUTIVE_FAILURES = 3


class FaultTracker:
    """Counts failed iterations; ``healthy`` is False after ``max_consecutive`` in a row."""

    def __init__(self, max_consecutive: int = DEFAULT_MAX_CONSECUTIVE_FAILURES) -> None:
        if max_consecutive <= 0:
            raise ValueError(f"max_consecutive must be positive, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.failed_iterations = 0
        self.failed_requests = 0
        self.last_error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.consecutive < self.max_consecutive

    def record(self, where: str, exc: BaseException, request_ids: Iterable[str] = (),
               iteration_failed: bool = True) -> str:
        """Log one ``engine_fault`` event with the traceback; return the message for the clients."""
        ids = list(request_ids)
        message = f"{type(exc).__name__}: {exc}"
        self.last_error = f"{where}: {message}"
        self.failed_requests += len(ids)
        if iteration_failed:
            self.consecutive += 1
            self.failed_iterations += 1
        log.error("engine_fault", where=where, error=message, request_ids=ids, iteration_failed=iteration_failed,
                  consecutive_failed_iterations=self.consecutive, healthy=self.healthy,
                  traceback="".join(traceback.format_exception(exc)))
        return message

    def iteration_ok(self) -> None:
        self.consecutive = 0
