"""Admission that never waits for a forward: add_request tokenizes in the caller's thread and hands the
sequence over through this queue; the engine loop moves it into the scheduler at the next iteration
boundary. The queue is bounded together with the requests the loop holds waiting (``max_num_waiting``): past
it, add_request raises EngineOverloaded ("retry later") instead of letting the backlog grow. The engine claims a
request's id and queues it in one step under its admission lock, which the loop also holds while it drains.
"""

from __future__ import annotations

import threading
from collections import deque

from serve.engine.errors import EngineOverloaded
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

    def put(self, seq: Sequence, waiting_elsewhere: int) -> None:
        """Queue ``seq``; EngineOverloaded when ``waiting_elsewhere`` (admitted requests the loop holds, not running)
        plus this queue reach ``max_num_waiting``."""
        with self._lock:
            waiting = waiting_elsewhere + len(self._items)
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise EngineOverloaded(
                    f"overloaded: {waiting} requests already waiting (max_num_waiting={self.max_waiting}); retry later",
                    DEFAULT_RETRY_AFTER_S)
            self._items.append(seq)
        self.work.set()

    def drain(self) -> list[Sequence]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items
