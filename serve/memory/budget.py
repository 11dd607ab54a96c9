"""The device memory budget: resident weights + KV pool + reserve must always fit in it.

On CPU the budget is a configured number enforced by accounting. On CUDA it is a fraction of the device
as reported by NVML (nvidia-ml-py) or torch; NVML is optional and its absence is not an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.config import parse_size


@dataclass(frozen=True)
class DeviceMemoryInfo:
    total_bytes: int
    used_bytes: int
    source: str  # "nvml" or "torch"


def query_device_memory(device: torch.device) -> DeviceMemoryInfo | None:
    """Live device memory, or None on CPU / without a driver."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return DeviceMemoryInfo(int(mem.total), int(mem.used), "nvml")
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - pynvml.NVMLError (no driver/library) or import error: fall back
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemoryInfo(int(total), int(total - free), "torch")


def resolve_budget(device: torch.device, device_memory: str | None, default_bytes: int) -> int:
    """Budget in bytes: an explicit size ('600MiB'), a fraction of the device ('0.9'), or default_bytes."""
    if device_memory is None:
        return default_bytes
    text = str(device_memory).strip()
    try:
        fraction = float(text)
    except ValueError:
        return parse_size(text)
    if not 0 < fraction <= 1:
        raise ValueError(f"device memory fraction must be in (0, 1], got {text}")
    info = query_device_memory(device)
    if info is None:
        raise ValueError("a fractional --device-memory needs a CUDA device; on CPU give a size such as 600MiB")
    return int(info.total_bytes * fraction)


@dataclass
class MemoryLedger:
    """Exact accounting of the budget. Every mutation goes through the morph runtime."""

    budget: int
    reserve: int
    non_layer_bytes: int
    layer_bytes: list[int]
    kv_blocks: int
    bytes_per_block: int
    staging_bytes: int = 0

    @property
    def used(self) -> int:
        return self.non_layer_bytes + sum(self.layer_bytes) + self.staging_bytes + self.kv_blocks * self.bytes_per_block

    @property
    def available(self) -> int:
        return self.budget - self.reserve - self.used

    def check(self) -> None:
        if self.used + self.reserve > self.budget:
            raise AssertionError(f"memory budget exceeded: used {self.used} + reserve {self.reserve} > budget {self.budget}")

    def as_dict(self) -> dict:
        return {"budget": self.budget, "reserve": self.reserve, "weights": self.non_layer_bytes + sum(self.layer_bytes),
                "staging": self.staging_bytes, "kv": self.kv_blocks * self.bytes_per_block, "used": self.used}
