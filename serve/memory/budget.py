"""The device memory budget: resident weights + KV pool + reserve must always fit in it.

``MemoryBudget`` is the engine's memory knobs resolved once, at the engine's edge (serve/engine/memory_budget.py:
"auto", fractions of the device and sizes made bytes), into what the arena's arithmetic (serve/memory/sizing.py)
reads; ``MemoryLedger`` accounts for the budget exactly while the engine runs. On CPU the budget is a configured
number enforced by accounting; on CUDA a fraction of the device as reported by NVML (nvidia-ml-py) or torch
(``query_device_memory``); NVML is optional and its absence is not an error.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryBudget:
    """What the engine may hold. ``budget_bytes``: weights + KV + reserve fit in it (None: no budget; the KV pool is
    ``kv_blocks`` or ``kv_bytes`` and the budget is what that needs); ``kv_blocks``: a fixed KV pool, or under a
    budget a cap on it; ``kv_bytes``: the pool's bytes when neither fixes it; ``reserve_bytes``: kept free inside
    the budget; ``releasable``: the operator armed memory yield, so the arena is built to give memory back;
    ``device_memory``: the budget as it was asked for (messages)."""

    budget_bytes: int | None
    kv_blocks: int | None
    kv_bytes: int
    reserve_bytes: int
    releasable: bool = False
    device_memory: str | None = None


@dataclass(frozen=True)
class DeviceMemoryInfo:
    total_bytes: int
    used_bytes: int
    source: str  # "nvml" or "torch"


class _Nvml:
    """NVML opened once per process (nvmlInit is slow, and re-initialising every iteration is wasteful);
    device handles are looked up by the *physical* index, i.e. through CUDA_VISIBLE_DEVICES."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._module = None
        self._failed = False
        self._handles: dict[int, object] = {}

    def handle(self, cuda_index: int) -> object | None:
        with self._lock:
            if self._failed:
                return None
            try:
                if self._module is None:
                    import pynvml  # noqa: PLC0415 - nvidia-ml-py; optional at run time

                    pynvml.nvmlInit()
                    self._module = pynvml
                if cuda_index not in self._handles:
                    self._handles[cuda_index] = self._lookup(cuda_index)
                return self._handles[cuda_index]
            except Exception:  # noqa: BLE001 - no driver / library: the torch fallback takes over for good
                self._failed = True
                return None

    def _lookup(self, cuda_index: int) -> object:
        pynvml = self._module
        visible = physical_device_ids()
        if visible is not None and cuda_index < len(visible):
            ident = visible[cuda_index]
            if ident.isdigit():
                return pynvml.nvmlDeviceGetHandleByIndex(int(ident))
            return pynvml.nvmlDeviceGetHandleByUUID(ident)  # "GPU-..." / "MIG-..." UUIDs
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)

    def memory(self, cuda_index: int) -> tuple[int, int] | None:
        h = self.handle(cuda_index)
        if h is None:
            return None
        try:
            mem = self._module.nvmlDeviceGetMemoryInfo(h)
        except Exception:  # noqa: BLE001
            return None
        return int(mem.total), int(mem.used)


_NVML = _Nvml()


def physical_device_ids(env: dict[str, str] | None = None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (indices or UUIDs), None when unset: torch's cuda:N is the N-th entry."""
    raw = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [p.strip() for p in raw.split(",") if p.strip()]


def query_device_memory(device: torch.device) -> DeviceMemoryInfo | None:
    """Live device memory (all processes' use counts: another process taking memory is pressure too),
    or None on CPU."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    nvml = _NVML.memory(index)
    if nvml is not None:
        return DeviceMemoryInfo(nvml[0], nvml[1], "nvml")
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemoryInfo(int(total), int(total - free), "torch")


@dataclass
class MemoryLedger:
    """Exact accounting of the budget, in arena slots. Every mutation goes through the morph runtime.

    The arena is partitioned at every moment: each layer's weights occupy ``layer_slots[i]`` slots of its
    region, the staging range ``staging_slots``, and KV blocks ``kv_blocks`` slots (base pool + the extents
    quantized layers gave up); what lies outside the arena (embeddings, norms, lm_head, RoPE tables) is
    ``non_arena_bytes``.
    """

    budget: int
    reserve: int
    non_arena_bytes: int
    slot_bytes: int
    arena_slots: int
    layer_slots: list[int]
    staging_slots: int
    kv_blocks: int
    yielded_slots: int = 0
    """Slots whose memory was given back (yield): in no layer, not staging, not KV, not resident."""

    @property
    def bytes_per_block(self) -> int:
        return self.slot_bytes

    @property
    def used_slots(self) -> int:
        return sum(self.layer_slots) + self.staging_slots + self.kv_blocks + self.yielded_slots

    @property
    def used(self) -> int:
        return self.non_arena_bytes + (self.used_slots - self.yielded_slots) * self.slot_bytes

    def check(self) -> None:
        if self.used_slots > self.arena_slots:
            raise AssertionError(f"arena over-committed: layers {sum(self.layer_slots)} + staging {self.staging_slots} "
                                 f"+ KV {self.kv_blocks} + yielded {self.yielded_slots} slots > {self.arena_slots}")
        if self.non_arena_bytes + self.arena_slots * self.slot_bytes + self.reserve > self.budget:
            raise AssertionError(f"memory budget exceeded: arena {self.arena_slots * self.slot_bytes} + other "
                                 f"{self.non_arena_bytes} + reserve {self.reserve} > budget {self.budget}")

    def as_dict(self) -> dict:
        return {"budget": self.budget, "reserve": self.reserve,
                "weights": self.non_arena_bytes + sum(self.layer_slots) * self.slot_bytes,
                "staging": self.staging_slots * self.slot_bytes, "kv": self.kv_blocks * self.slot_bytes,
                "arena": self.arena_slots * self.slot_bytes, "used": self.used,
                "yielded": self.yielded_slots * self.slot_bytes,
                "held": self.non_arena_bytes + (self.arena_slots - self.yielded_slots) * self.slot_bytes}
