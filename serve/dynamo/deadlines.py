"""The Dynamo requests whose deadline passed, remembered so that the frontend's retries of them fail at once.

Dynamo 1.6.1's frontend answers a worker's ``ConnectionTimeout`` with 504 "Request deadline exceeded", the only
worker error it turns into 504, but it also takes it for a lost connection and migrates the request (sends it
again, to any worker, up to ``--migration-limit`` times) under the same context id. A retried request would get
a fresh deadline and run again; so the worker keeps the ids of the contexts it ended for their deadline, and
refuses a retry of one at once with the same error. Bounded: the newest ``max_entries`` ids, each for ``ttl_s``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable


class ExpiredContexts:
    """Context id -> the message its request ended with, for ``ttl_s`` seconds (at most ``max_entries``)."""

    def __init__(self, ttl_s: float = 600.0, max_entries: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, context_id: str, message: str) -> None:
        with self._lock:
            self._entries[context_id] = (self._clock(), message)
            self._entries.move_to_end(context_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, context_id: str) -> str | None:
        """The message a retry of this context is refused with, or None."""
        now = self._clock()
        with self._lock:
            while self._entries and now - next(iter(self._entries.values()))[0] > self.ttl_s:
                self._entries.popitem(last=False)
            entry = self._entries.get(context_id)
        return None if entry is None else entry[1]

    def __len__(self) -> int:
        return len(self._entries)
