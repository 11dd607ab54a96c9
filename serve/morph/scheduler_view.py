"""What the morph runtime may read of the scheduler: queue depths and the blocks waiting prompts need.

A Protocol rather than the Scheduler itself keeps the import arrow one way (serve.engine -> serve.morph)
and the runtime from reading scheduler internals.
"""

from __future__ import annotations

from typing import Protocol


class SchedulerView(Protocol):
    def num_running(self) -> int: ...

    def num_waiting(self) -> int: ...

    def oldest_waiting_arrival(self) -> float | None:
        """Arrival time (engine clock) of the longest-waiting request, None when nothing waits."""
        ...

    def blocks_needed_by_waiting(self) -> int: ...

    def slo_signals(self, now: float) -> tuple[int, float | None]:
        """(critical decodes left out of the last batch, least TTFT slack of a waiting request or None)."""
        ...


class IdleSchedulerView:
    """Telemetry before serving starts: nothing running or waiting."""

    def num_running(self) -> int:
        return 0

    def num_waiting(self) -> int:
        return 0

    def oldest_waiting_arrival(self) -> float | None:
        return None

    def blocks_needed_by_waiting(self) -> int:
        return 0

    def slo_signals(self, now: float) -> tuple[int, float | None]:
        return 0, None
