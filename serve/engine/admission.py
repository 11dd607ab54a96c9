"""Admission that never waits for a forward: add_request tokenizes in the caller's thread and hands the
sequence over through this queue; the engine loop moves it into the scheduler at the next iteration
boundary. The queue is bounded together with the scheduler's waiting list (``max_num_waiting``): past
it, add_request raises EngineOverloaded ("retry later") instead of letting the backlog grow.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from serve.engine.errors import EngineOverloaded, InvalidRequest
from serve.engine.sequence import Sequence
from serve.error_kinds import DEFAULT_RETRY_AFTER_S

__all__ = ["EngineOverloaded", "Handoff"]  # EngineOverloaded lives in serve/engine/errors.py with the other kinds


class Handoff:
    """Thread-safe FIFO of sequences not yet in the scheduler, plus the loop's wake-up event."""

    def __init__(self, max_waiting: int | None) -> None:
        if max_waiting is not None and max_waiting <= 0:
            raise ValueError(f"max_num_waiting must be positive, got {max_waiting}")
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._items: deque[Sequence] = deque()
        self.work = threading.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, seq: Sequence, waiting_in_scheduler: Callable[[], int], requests: dict[str, Sequence]) -> None:
        """Queue ``seq`` and claim its id in ``requests`` (the engine's live requests; under this queue's lock, so
        ids are claimed one at a time). EngineOverloaded when the queue is full, InvalidRequest for an id in use."""
        with self._lock:
            waiting = waiting_in_scheduler() + len(self._items)
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise EngineOverloaded(
                    f"overloaded: {waiting} requests already waiting (max_num_waiting={self.max_waiting}); retry later",
                    DEFAULT_RETRY_AFTER_S)
            if seq.request_id in requests:
                raise InvalidRequest(f"request id {seq.request_id!r} is already in use")
            requests[seq.request_id] = seq
            self._items.append(seq)
        self.work.set()

    def drain(self) -> list[Sequence]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items
