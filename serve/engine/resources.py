"""The resource-manager seam: the levers the engine loop hosts, in order, without knowing what they are.

The engine holds an ordered ``ResourceManagers`` (the shape of TensorRT-LLM's pyexecutor ``ResourceManager``:
an ordered set of managers, each prepared and updated per batch, looked up by type). Morphing decoder layers
(``serve.morph.runtime.MorphRuntime``) is one manager; a lever such as KV-cache precision or speculative decoding is
one more manager plus its policy, and the loop does not change. An engine whose pool never changes (mode ``off``)
holds none.

The loop calls every manager, in order, at fixed points of each iteration:

* ``before_schedule(scheduler)``: the iteration boundary (finish copies, ask its controller, start the next step);
* ``cover_shortfall(scheduler, blocks)``: the scheduler is ``blocks`` KV blocks short and about to preempt; each
  manager that ``grows_pool`` is offered what the earlier ones left uncovered, and returns the blocks it freed;
* ``after_schedule(num_tokens)``: the batch's size;
* ``on_first_token`` / ``on_token_gap``: latency signals;
* ``on_request_finished(request_id)``: a request left the engine (per-request resources are freed here);

and, in reverse order, ``shutdown()``. Each manager reports typed ``resource_stats()``; the flat fields those
stats contribute to ``EngineStats`` (and so to the metric catalogue) come from ``ResourceStats.engine_fields()``.
A failure inside one manager is the engine's to record under the manager's ``name``; the others still run.

Operator controls a manager offers (yielding memory) are capabilities looked up by type (``YieldsMemory``),
never a branch on the mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from serve.morph.scheduler_view import SchedulerView


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

    def before_schedule(self, scheduler: SchedulerView) -> None: ...
    def cover_shortfall(self, scheduler: SchedulerView, blocks: int) -> int: ...
    def after_schedule(self, num_tokens: int) -> None: ...
    def on_first_token(self, now: float, ttft_s: float) -> None: ...
    def on_token_gap(self, now: float, gap_s: float) -> None: ...
    def on_request_finished(self, request_id: str) -> None: ...
    def extra_reachable_blocks(self, base_blocks: int, num_blocks: int) -> tuple[int, str]: ...
    def resource_stats(self) -> ResourceStats: ...
    def is_settled(self) -> bool: ...
    def shutdown(self) -> None: ...


@runtime_checkable
class YieldsMemory(Protocol):
    """A manager that can give memory back to the device or host on an operator's request."""

    def request_yield(self, nbytes: int | None) -> dict[str, Any]: ...


class ResourceManagerBase:
    """No-op defaults, so a manager writes only the hooks it uses."""

    name = "resource"
    grows_pool = False

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

    def on_request_finished(self, request_id: str) -> None:
        return None

    def extra_reachable_blocks(self, base_blocks: int, num_blocks: int) -> tuple[int, str]:
        """KV blocks this manager can add beyond ``num_blocks`` at most, and how (for admission errors)."""
        return 0, ""

    def is_settled(self) -> bool:
        return True

    def shutdown(self) -> None:
        return None


M = TypeVar("M")
FaultRecorder = Callable[[str, BaseException], object]
"""``record(where, exc)``: the engine's fault log (serve/engine/faults.py), told which manager failed."""


class ResourceManagers:
    """The engine's managers in calling order. Iterating gives them in order; ``reversed`` for freeing."""

    def __init__(self, managers: Sequence[ResourceManager] = ()) -> None:
        names = [m.name for m in managers]
        if len(set(names)) != len(names):
            raise ValueError(f"resource managers need distinct names, got {names}")
        self._managers = tuple(managers)

    def __iter__(self) -> Iterator[ResourceManager]:
        return iter(self._managers)

    def __reversed__(self) -> Iterator[ResourceManager]:
        return reversed(self._managers)

    def __len__(self) -> int:
        return len(self._managers)

    def get(self, kind: type[M]) -> M | None:
        """The first manager that is a ``kind`` (a class or a runtime-checkable protocol), None if none is."""
        for m in self._managers:
            if isinstance(m, kind):
                return m
        return None

    @property
    def grows_pool(self) -> bool:
        return any(m.grows_pool for m in self._managers)

    def reachable_blocks(self, base_blocks: int, num_blocks: int) -> tuple[int, str]:
        """The most KV blocks the engine can ever have (the admission bound) and how it comes about."""
        total, notes = num_blocks, []
        for m in self._managers:
            extra, note = m.extra_reachable_blocks(base_blocks, num_blocks)
            total += extra
            if note:
                notes.append(note)
        return total, "; ".join(notes) or f"{num_blocks} blocks, no resource manager grows the pool"

    def is_settled(self) -> bool:
        return all(m.is_settled() for m in self._managers)

    # ---- the loop's calls: every manager in order (frees in reverse); one manager's failure is recorded and the
    # others still run
    def before_schedule(self, scheduler: SchedulerView, record: FaultRecorder) -> bool:
        """Every manager's iteration boundary; False when one failed (recorded under its name)."""
        ok = True
        for m in self._managers:
            try:
                m.before_schedule(scheduler)
            except Exception as exc:  # noqa: BLE001 - the batch still runs
                record(m.name, exc)
                ok = False
        return ok

    def cover_shortfall(self, scheduler: SchedulerView, blocks: int, record: FaultRecorder) -> bool:
        """Offer a shortfall of ``blocks`` KV blocks to each manager that grows the pool, in order, each getting
        what the earlier ones left; False when one failed (the scheduler preempts what is left)."""
        ok = True
        for m in self._managers:
            if blocks <= 0:
                break
            if not m.grows_pool:
                continue
            try:
                blocks -= m.cover_shortfall(scheduler, blocks)
            except Exception as exc:  # noqa: BLE001
                record(m.name, exc)
                ok = False
        return ok

    def after_schedule(self, num_tokens: int) -> None:
        for m in self._managers:
            m.after_schedule(num_tokens)

    def on_first_token(self, now: float, ttft_s: float) -> None:
        for m in self._managers:
            m.on_first_token(now, ttft_s)

    def on_token_gap(self, now: float, gap_s: float) -> None:
        for m in self._managers:
            m.on_token_gap(now, gap_s)

    def on_request_finished(self, request_id: str) -> None:
        for m in reversed(self._managers):
            m.on_request_finished(request_id)

    def shutdown(self) -> None:
        for m in reversed(self._managers):
            m.shutdown()

    def stats(self) -> dict[str, ResourceStats]:
        return {m.name: m.resource_stats() for m in self._managers}
