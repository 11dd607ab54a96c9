"""What the engine loop calls around each batch, whatever manages memory: the resource-manager seam.

The loop (serve/engine/engine.py) never asks *whether* the engine morphs. It calls one ``ResourceManager``
(the shape of TensorRT-LLM's pyexecutor resource managers) at fixed points of every iteration:

* ``before_schedule(scheduler)``: the iteration boundary (MorphRuntime: finish copies, ask the controller,
  start the next swap, restore, yield or reclaim);
* ``cover_shortfall(scheduler, blocks)``: the scheduler is that many KV blocks short and about to preempt
  (quantize before preempt); returns how many layers it moved;
* ``after_schedule(num_tokens)``: the batch's size (the cost rule reads it);
* ``on_first_token`` / ``on_token_gap``: latency signals;
* ``resource_stats()``, ``is_settled()`` (an idle loop may sleep), ``request_yield(nbytes)``, ``shutdown()``.

``MorphRuntime`` implements it; ``StaticResources`` serves engines whose pool never changes size (mode off).
"""

from __future__ import annotations

from typing import Any, Protocol

from serve.morph.scheduler_view import SchedulerView


class ResourceManager(Protocol):
    grows_pool: bool
    """True when ``cover_shortfall`` can add KV blocks (the scheduler then offers it the shortfalls it meets)."""

    def before_schedule(self, scheduler: SchedulerView) -> None: ...
    def cover_shortfall(self, scheduler: SchedulerView, blocks: int) -> int: ...
    def after_schedule(self, num_tokens: int) -> None: ...
    def on_first_token(self, now: float, ttft_s: float) -> None: ...
    def on_token_gap(self, now: float, gap_s: float) -> None: ...
    def reachable_blocks(self, base_blocks: int, num_blocks: int) -> tuple[int, str]: ...
    def resource_stats(self) -> dict[str, Any]: ...
    def request_yield(self, nbytes: int | None) -> dict[str, Any]: ...
    def is_settled(self) -> bool: ...
    def shutdown(self) -> None: ...


class StaticResources:
    """The null resource manager: a KV pool of fixed size, no layers that change, nothing to give back."""

    grows_pool = False

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def before_schedule(self, scheduler: SchedulerView) -> None:
        return None

    def cover_shortfall(self, scheduler: SchedulerView, blocks: int) -> int:
        return 0

    def after_schedule(self, num_tokens: int) -> None:
        return None

    def on_first_token(self, now: float, ttft_s: float) -> None:
        return None

    def on_token_gap(self, now: float, gap_s: float) -> None:
        return None

    def reachable_blocks(self, base_blocks: int, num_blocks: int) -> tuple[int, str]:
        return num_blocks, f"{num_blocks} blocks, no morphing"

    def resource_stats(self) -> dict[str, Any]:
        return {"layers_quantized": {}, "swaps_total": 0, "restores_total": 0, "memory_yield": {}}

    def request_yield(self, nbytes: int | None) -> dict[str, Any]:
        raise ValueError(f"morph mode {self.mode!r} holds no quantized layers and cannot yield memory; serve a "
                         "dynamic mode (default, performance, accuracy)")

    def is_settled(self) -> bool:
        return True

    def shutdown(self) -> None:
        return None
