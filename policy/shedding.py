"""Load shedding on arrival: refuse at once a request that cannot start within its queue deadline.

Without this, a request that arrives behind a long queue waits the whole ``queue_timeout_s`` before it is
shed (503 after 30 s at the defaults). The engine already knows how fast waiting requests start running, so
when the queue ahead of a new request is longer than that rate can serve within the deadline, the request is
refused on arrival with the same 503 "overloaded ... retry later" and a Retry-After that says when the excess
will have drained.

The start rate is measured only over busy time (intervals in which some request was waiting), so an idle spell
before a burst does not read as a slow server; nothing is shed until ``min_starts`` starts were seen, when nobody
waits, or when the last busy interval is older than the window (a rate measured on yesterday's long requests
says nothing about today's short ones). A single burst that arrives all at once is admitted (no rate yet) and
shed by the deadline; sustained overload is refused on arrival.
The prediction assumes first-come first-served order: under SLAI a higher-priority request may overtake the
queue, so for it the estimate errs on the side of refusing (documented in docs/hardening.md).

Pure: stdlib only, time passed in; the engine feeds ``observe`` from its loop and admission reads ``rate``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ShedDecision:
    """Whether to refuse a new request now, and why."""

    shed: bool
    predicted_wait_s: float | None  # None: no rate measured yet
    retry_after_s: int
    reason: str


class StartRateMeter:
    """Requests started per second of busy time, over the last ``window_s`` seconds of busy time.

    ``observe(now_s, started, waiting_after)`` is called once per engine iteration: ``started`` requests got
    their first schedule in this iteration, ``waiting_after`` still wait after it. The interval since the
    previous call counts as busy when requests were left waiting then. ``rate_at`` reads two plain float
    attributes, safe from another thread without a lock.
    """

    def __init__(self, window_s: float = 60.0, min_starts: int = 8) -> None:
        if window_s <= 0 or min_starts < 1:
            raise ValueError(f"window_s must be > 0 and min_starts >= 1, got {window_s}, {min_starts}")
        self.window_s = window_s
        self.min_starts = min_starts
        self._samples: deque[tuple[float, int]] = deque()  # (busy seconds, starts) per busy interval
        self._busy_s = 0.0
        self._starts = 0
        self._prev_s: float | None = None
        self._prev_waiting = 0
        self.rate: float | None = None       # over the window, once min_starts were seen
        self.last_busy_s: float | None = None  # end of the last busy interval

    def observe(self, now_s: float, started: int, waiting_after: int) -> None:
        if self._prev_s is not None and self._prev_waiting > 0:
            dt = max(0.0, now_s - self._prev_s)
            self._samples.append((dt, started))
            self._busy_s += dt
            self._starts += started
            while self._samples and self._busy_s - self._samples[0][0] >= self.window_s:
                old_dt, old_started = self._samples.popleft()
                self._busy_s -= old_dt
                self._starts -= old_started
            if self._starts >= self.min_starts and self._busy_s > 0:
                self.rate = self._starts / self._busy_s
            self.last_busy_s = now_s
        self._prev_s, self._prev_waiting = now_s, waiting_after

    def rate_at(self, now_s: float) -> float | None:
        """The rate, or None when none was measured or the last busy interval ended over ``window_s`` ago."""
        rate, last = self.rate, self.last_busy_s
        if rate is None or last is None or now_s - last > self.window_s:
            return None
        return rate


def queue_deadline_retry_after(queue_timeout_s: float) -> int:
    """Retry-After of a request shed at its queue deadline: a third of the deadline, at least 1 s (the queue ahead
    of it has had a whole deadline to drain and did not; a client that comes back a third later finds it shorter)."""
    return max(1, round(queue_timeout_s / 3))


def shed_on_arrival(waiting: int, rate: float | None, queue_timeout_s: float) -> ShedDecision:
    """Refuse a request arriving behind ``waiting`` others when ``rate`` starts/s cannot reach it in time.

    ``queue_timeout_s`` 0 (no deadline) never sheds. The Retry-After is the time the queue needs to shrink
    to what the deadline can serve, at least 1 s and at most the deadline."""
    if queue_timeout_s <= 0:
        return ShedDecision(False, None, 0, "no queue deadline")
    if waiting <= 0:
        return ShedDecision(False, None, 0, "nobody waiting")
    if rate is None or rate <= 0:
        return ShedDecision(False, None, 0, "no recent start rate")
    wait = (waiting + 1) / rate
    if wait <= queue_timeout_s:
        return ShedDecision(False, wait, 0, f"predicted wait {wait:.1f} s <= queue_timeout_s={queue_timeout_s:g} s")
    retry = min(max(1, math.ceil(wait - queue_timeout_s)), max(1, math.ceil(queue_timeout_s)))
    return ShedDecision(True, wait, retry,
                        f"overloaded: {waiting} requests waiting, starting {rate:.2f}/s: a new one would wait "
                        f"~{wait:.0f} s > queue_timeout_s={queue_timeout_s:g} s; retry later, after {retry} s")
