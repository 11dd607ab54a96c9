"""The engine's memory knobs resolved once, at the edge, into a ``MemoryBudget`` (serve/memory/budget.py) that the
arena's arithmetic reads: ``device_memory`` (a size, a fraction of the device, or "auto"), ``num_kv_blocks``,
``kv_cache_memory``, ``memory_reserve`` and whether ``memory_floor`` armed memory yield (the floor and the reclaim
mark themselves are the controller's: ``EngineConfig.policy_config``). Nothing below the engine reads the config.

``device_memory="auto"`` (the Triton model's default): a KV pool the user sized (``num_kv_blocks``, or a
``kv_cache_memory`` that is set) is kept as without a budget. Otherwise on CUDA the budget is ``AUTO_CUDA_FRACTION``
(0.9) of the device; on CPU it is the resident full-precision weights (+ the staging slot when the mode morphs) +
``memory_reserve`` + a KV pool for ONE request of the full context length (``ceil(context / block_size)`` blocks;
the context: ``EngineConfig.context_length``). Every request the model accepts then fits at full precision, and two
or more long ones at once put the pool under pressure, which is where the dynamic modes quantize layers to grow
it: SmolLM2-135M (8192 tokens, fp32, 45 KiB of KV a token) gets 512 blocks = 360 MiB of KV, about 940 MiB in all
(weights 564 MiB in arena slots, reserve 16 MiB).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from serve.config import AUTO_CUDA_FRACTION, DEVICE_MEMORY_AUTO, KV_CACHE_MEMORY_DEFAULT, EngineConfig, parse_size
from serve.memory.budget import MemoryBudget, query_device_memory


def memory_budget(config: EngineConfig, device_kind: str, max_position_embeddings: int,
                  device_bytes: Callable[[str], int]) -> MemoryBudget:
    """The config's memory knobs on a ``device_kind`` ("cuda" or "cpu") device serving a model of
    ``max_position_embeddings``; ``device_bytes`` turns a ``device_memory`` (a size or a fraction) into bytes."""
    device_memory, kv_blocks = config.device_memory, config.num_kv_blocks
    if device_memory == DEVICE_MEMORY_AUTO:
        if kv_blocks is not None or config.kv_cache_memory is not None:  # a pool the user sized is kept
            device_memory = None
        elif device_kind == "cuda":
            device_memory = str(AUTO_CUDA_FRACTION)
        else:
            device_memory = None
            kv_blocks = math.ceil(config.context_length(max_position_embeddings) / config.block_size)
    return MemoryBudget(budget_bytes=device_bytes(device_memory) if device_memory is not None else None,
                        kv_blocks=kv_blocks, kv_bytes=parse_size(config.kv_cache_memory or KV_CACHE_MEMORY_DEFAULT),
                        reserve_bytes=parse_size(config.memory_reserve), releasable=config.memory_floor is not None,
                        device_memory=device_memory)


def device_memory_bytes(device: torch.device, device_memory: str) -> int:
    """A size ('600MiB') or a fraction of ``device``'s memory ('0.9', CUDA only) in bytes."""

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
