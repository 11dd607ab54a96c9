"""What else ran on this host while we measured: the CPU time other processes took, the time the hypervisor took
(steal), read from ``/proc/stat`` around a measurement, minus this process's own CPU time.

A timing taken while another process computes (a training job, a second replica warming up, a test suite) is
slow for a reason that leaves with that process; a table of such timings is wrong for every quiet run after it.
``HostLoad`` is a context manager: ``with HostLoad() as load: measure()``, then ``load.other_share`` (other
processes' CPU time / (elapsed x CPUs): 0 = nothing else ran, 1 = every CPU busy with others) and
``load.steal_share``. Linux only; elsewhere both read 0 and ``load.known`` is False.

stdlib only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import TracebackType

_STAT = Path("/proc/stat")


def _cpu_jiffies() -> tuple[int, int, int] | None:
    """(busy, total, steal) jiffies of all CPUs since boot; None where /proc/stat is not readable."""
    try:
        fields = _STAT.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq
    return busy, busy + idle + iowait + steal, steal


class HostLoad:
    """The CPU time others took while the ``with`` block ran (see the module docstring)."""

    def __init__(self) -> None:
        self.other_share = 0.0
        self.steal_share = 0.0
        self.elapsed_s = 0.0
        self.known = False
        self._start: tuple[tuple[int, int, int] | None, float, float] | None = None

    def __enter__(self) -> HostLoad:
        self._start = (_cpu_jiffies(), time.monotonic(), time.process_time())
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._start is not None
        start, t0, cpu0 = self._start
        end, t1, cpu1 = _cpu_jiffies(), time.monotonic(), time.process_time()
        self.elapsed_s = t1 - t0
        if start is None or end is None or end[1] <= start[1] or self.elapsed_s <= 0:
            return
        hz = os.sysconf("SC_CLK_TCK")
        cpus = os.cpu_count() or 1
        busy_s = (end[0] - start[0]) / hz
        others_s = max(0.0, busy_s - (cpu1 - cpu0))
        self.other_share = min(1.0, others_s / (self.elapsed_s * cpus))
        self.steal_share = (end[2] - start[2]) / (end[1] - start[1])
        self.known = True
