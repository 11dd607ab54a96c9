"""A virtual clock: the engine reads it as it reads time.perf_counter, the simulated executor moves it."""

from __future__ import annotations


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back ({seconds} s)")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        self._now = max(self._now, t)

    def sleep(self, seconds: float) -> None:
        """What the replay calls while it waits for the next arrival: time passes, nothing runs."""
        self.advance(max(0.0, seconds) or 1e-4)
