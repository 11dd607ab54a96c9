"""Where the engine reads how much memory is free *outside* its own budget: the pressure signal for yield.

* ``nvml``: the CUDA device's total minus used, every process counted (``nvmlDeviceGetMemoryInfo``); a
  second model or a training job on the same GPU shows up here.
* ``host``: on CPU, the tighter of the cgroup's room (v2 ``memory.max - memory.current``, v1
  ``limit_in_bytes - usage_in_bytes``) and the kernel's ``MemAvailable``: a container's limit is what an
  out-of-memory kill obeys, the host's free memory is what the other tenants share.
* ``none``: no reading; yield acts only on an operator's request.

Readings are taken at most every ``interval_s`` (time passed in by the caller), so the engine can ask at
every iteration boundary without a file read or a driver call per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from serve.memory.budget import query_device_memory

PRESSURE_SOURCES = ("auto", "nvml", "host", "none")


@dataclass(frozen=True)
class FreeMemory:
    free_bytes: int
    source: str


def meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Limit minus usage of this process's memory cgroup; None without a limit (or without cgroups)."""
    pairs = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))
    for limit_name, usage_name in pairs:
        try:
            limit = (root / limit_name).read_text().strip()
            usage = int((root / usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 2**60:  # v1 writes a huge number for "none"
            return None
        return max(0, int(limit) - usage)
    return None


def host_free() -> FreeMemory | None:
    readings = [(v, name) for v, name in ((cgroup_room(), "cgroup"), (meminfo_available(), "meminfo")) if v is not None]
    if not readings:
        return None
    value, name = min(readings)
    return FreeMemory(value, name)


def nvml_free(device: torch.device) -> FreeMemory | None:
    info = query_device_memory(device)
    if info is None:
        return None
    return FreeMemory(info.total_bytes - info.used_bytes, info.source)


class PressureSource:
    """A reading function, sampled at most every ``interval_s``."""

    def __init__(self, read: Callable[[], FreeMemory | None], interval_s: float = 0.25) -> None:
        self._read = read
        self.interval_s = interval_s
        self._last: FreeMemory | None = None
        self._last_at: float | None = None

    def invalidate(self) -> None:
        """The next ``free`` reads afresh (the engine just gave memory back or took it: a cached reading
        would ask for the same bytes twice)."""
        self._last_at = None

    def free(self, now: float) -> FreeMemory | None:
        if self._last_at is None or now - self._last_at >= self.interval_s:
            self._last = self._read()
            self._last_at = now
        return self._last


def pressure_source(kind: str, device: torch.device, interval_s: float = 0.25) -> PressureSource | None:
    """The source ``kind`` names (``auto``: NVML on CUDA, the host on CPU); None for ``none``."""
    if kind not in PRESSURE_SOURCES:
        raise ValueError(f"memory_pressure_source must be one of {PRESSURE_SOURCES}, got {kind!r}")
    if kind == "none":
        return None
    if kind == "nvml" or (kind == "auto" and device.type == "cuda"):
        if device.type != "cuda":
            raise ValueError("memory_pressure_source=nvml needs a CUDA device; on CPU use host")
        return PressureSource(lambda: nvml_free(device), interval_s)
    return PressureSource(host_free, interval_s)
