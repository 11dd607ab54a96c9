"""The device memory budget: resident weights + KV pool + reserve must always fit in it.

On CPU the budget is a configured number enforced by accounting. On CUDA it is a fraction of the device
as reported by NVML (nvidia-ml-py) or torch; NVML is optional and its absence is not an error.
``device_memory="auto"`` (the Triton model's default) is made concrete by ``auto_budget`` below.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from serve.config import AUTO_CUDA_FRACTION, DEVICE_MEMORY_AUTO, EngineConfig, parse_size


def auto_budget(config: EngineConfig, device_type: str, max_position_embeddings: int) -> EngineConfig:
    """``config`` with ``device_memory="auto"`` replaced by what it means on ``device_type``; any other
    config is returned as is.

    The rule: a ``num_kv_blocks``, or a ``kv_cache_memory`` other than the default, fixes the KV pool as
    without a budget. Otherwise, on CUDA the budget is ``AUTO_CUDA_FRACTION`` (0.9) of the device; on CPU
    it is the resident full-precision weights (+ the staging slot when the mode morphs) + ``memory_reserve``
    + a KV pool for ONE request of the full context length (``ceil(max_model_len / block_size)`` blocks;
    max_model_len: the config's, else the model's). Every request the model accepts then fits at full
    precision, and two or more long ones at once put the pool under pressure, which is where the dynamic
    modes quantize layers to grow it: SmolLM2-135M (8192 tokens, fp32, 45 KiB of KV a token) gets
    512 blocks = 360 MiB of KV, about 940 MiB in all (weights 564 MiB in arena slots, reserve 16 MiB).
    """
    if config.device_memory != DEVICE_MEMORY_AUTO:
        return config
    fixed_pool = config.num_kv_blocks is not None or \
        config.kv_cache_memory != EngineConfig.__dataclass_fields__["kv_cache_memory"].default
    if fixed_pool:
        return dataclasses.replace(config, device_memory=None)
    if device_type == "cuda":
        return dataclasses.replace(config, device_memory=str(AUTO_CUDA_FRACTION))
    max_len = config.context_length(max_position_embeddings)
    return dataclasses.replace(config, device_memory=None, num_kv_blocks=math.ceil(max_len / config.block_size))


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


def resolve_budget(device: torch.device, device_memory: str | None, default_bytes: int) -> int:
    """Budget in bytes: an explicit size ('600MiB'), a fraction of the device ('0.9'), or default_bytes."""
    if device_memory is None:
        return default_bytes

    def total() -> int | None:
        info = query_device_memory(device)
        return info.total_bytes if info is not None else None

    return budget_bytes(device_memory, total,
                        "a fractional --device-memory needs a CUDA device; on CPU give a size such as 600MiB")


def budget_bytes(device_memory: str, device_total_bytes: Callable[[], int | None], no_device: str) -> int:
    """A size ('600MiB') or a fraction in (0, 1] of ``device_total_bytes()`` (None: ValueError ``no_device``).
    The planner (sim/) passes its GPU system's memory, so a plan reads --device-memory as the engine does."""
    text = str(device_memory).strip()
    try:
        fraction = float(text)
    except ValueError:
        return parse_size(text)
    if not 0 < fraction <= 1:
        raise ValueError(f"device memory fraction must be in (0, 1], got {text}")
    total = device_total_bytes()
    if total is None:
        raise ValueError(no_device)
    return int(total * fraction)


@dataclass
class MemoryLedger:
    """Exact accounting of the budget, in arena slots. Every mutation goes through the morph runtime.

    The arena is partitioned at every moment: each layer's weights occupy ``layer_slots[i]`` slots of its
    region, the staging range ``staging_slots``, and KV blocks ``kv_blocks`` slots (base pool + the chunks
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
