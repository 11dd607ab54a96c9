"""The resource-manager seam: what a lever implements to be hosted by the engine loop, and what it may read of the
scheduler. Stdlib only, so a lever in any room (the morph runtime in serve/morph, the KV-precision rung and
speculative decoding in serve/engine, the planner's modelled speculation in sim/) implements it without importing
the engine, and the engine hosts them without knowing what they are.

The engine holds its managers in order (``serve.engine.resources.ResourceManagers``: the shape of TensorRT-LLM's
pyexecutor ``ResourceManager``, an ordered set of managers, each prepared and updated per batch, looked up by type)
and calls every one at fixed points of each iteration:

* ``before_schedule(scheduler)``: the iteration boundary (finish copies, ask its controller, start the next step);
* ``cover_shortfall(scheduler, blocks)``: the scheduler is ``blocks`` KV blocks short and about to preempt; each
  manager that ``grows_pool`` is offered what the earlier ones left uncovered, and returns the blocks it freed;
* ``after_schedule(num_tokens)``: the batch's size;
* ``after_execute(sampled, logits)``: the batch ran; its sampled chunks and their logits rows, before the engine
  samples from them (read only: an observer such as the quality meter);
* ``on_first_token`` / ``on_token_gap``: latency signals;
* ``on_request_finished(request_id)``: a request left the engine (per-request resources are freed here);

and, in reverse order, ``shutdown()``. Each manager reports typed ``resource_stats()``; the flat fields those stats
contribute to ``EngineStats`` (and so to the metric catalogue) come from ``ResourceStats.engine_fields()``.

Managers do not reach into each other: what one needs of another (the KV-precision rung: the blocks the morph
runtime's next layer swap would add) arrives in its constructor as a read-only protocol, wired by the engine's one
assembly (serve/engine/assembly.py). Operator controls a manager offers (yielding memory) are capabilities looked up
by type (``YieldsMemory``), never a branch on the mode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable


class SchedulerView(Protocol):
    """What a manager may read of the scheduler: queue depths, the blocks waiting prompts need, SLO signals. A
    protocol rather than the Scheduler keeps the managers off its internals."""

    def num_running(self) -> int: ...

    def num_waiting(self) -> int: ...

    def oldest_waiting_arrival(self) -> float | None:
        """Arrival time (engine clock) of the longest-waiting request, None when nothing waits."""
        ...

    def blocks_needed_by_waiting(self) -> int: ...

    def running_tiers(self) -> tuple[int, ...]:
        """The SLO tiers (0 = strict) with a request running, each once (the quality floor's per-tier floors)."""
        ...

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

    def running_tiers(self) -> tuple[int, ...]:
        return ()

    def slo_signals(self, now: float) -> tuple[int, float | None]:
        return 0, None


@runtime_checkable
class ResourceStats(Protocol):
    """A manager's typed snapshot; ``engine_fields()`` names the flat ``EngineStats`` fields it fills."""

    def engine_fields(self) -> Mapping[str, Any]: ...


@runtime_checkable
class ResourceManager(Protocol):
    name: str
    """Short name: the key of its stats in ``EngineStats.resources`` and of its failures in the fault log."""
    grows_pool: bool
    """True when ``cover_shortfall`` can add KV blocks (the scheduler then offers it the shortfalls it meets)."""

    def before_schedule(self, scheduler: SchedulerView) -> object: ...
    def cover_shortfall(self, scheduler: SchedulerView, blocks: int) -> int: ...
    def after_schedule(self, num_tokens: int) -> None: ...
    def after_execute(self, sampled: Sequence[Any], logits: Any) -> None: ...
    def on_first_token(self, now: float, ttft_s: float) -> None: ...
    def on_token_gap(self, now: float, gap_s: float) -> None: ...
    def on_request_finished(self, request_id: str) -> None: ...
    def extra_reachable_blocks(self, base_blocks: int, num_blocks: int) -> tuple[int, str]: ...
    def resource_stats(self) -> ResourceStats: ...
    def is_at_rest(self) -> bool: ...
    def shutdown(self) -> None: ...


@runtime_checkable
class YieldsMemory(Protocol):
    """A manager that can give memory back to the device or host on an operator's request."""

    def request_yield(self, nbytes: int | None) -> dict[str, Any]: ...


class ResourceManagerBase:
    """No-op defaults, so a manager writes only the hooks it uses."""

    name = "resource"
    grows_pool = False

    def before_schedule(self, scheduler: SchedulerView) -> object:
        return None

    def cover_shortfall(self, scheduler: SchedulerView, blocks: int) -> int:
        return 0

    def after_schedule(self, num_tokens: int) -> None:
        return None

    def after_execute(self, sampled: Sequence[Any], logits: Any) -> None:
        """``sampled``: the executed batch's chunks that yield tokens, in logits-row order; ``logits``: their rows.
        Read only: a manager that wrote either would change served tokens."""
        return None

    def on_first_token(self, now: float, ttft_s: float) -> None:
        return None

    def on_token_gap(self, now: float, gap_s: float) -> None:
        return None

    def on_request_finished(self, request_id: str) -> None:
        return None

    def extra_reachable_blocks(self, base_blocks: int, num_blocks: int) -> tuple[int, str]:
        """KV blocks this manager can add beyond ``num_blocks`` at most, and how (for admission errors)."""
        return 0, ""

    def is_at_rest(self) -> bool:
        return True

    def shutdown(self) -> None:
        return None
