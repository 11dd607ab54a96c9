"""The engine's resource managers in calling order (``ResourceManagers``): the loop calls every one at the fixed
points of the resource-manager seam (serve/resource_seam.py: what a manager implements), in order, frees them in
reverse and looks them up by type. A failure inside one manager is the engine's to record under the manager's
``name`` (its fault log); the others still run, and the iteration is not counted healthy
(``iteration_ok``). An engine whose pool never changes (mode ``off``) holds none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from serve.resource_seam import ResourceManager, ResourceStats, SchedulerView

M = TypeVar("M")
FaultRecorder = Callable[..., object]
"""``record(where, exc, request_ids=(), iteration_failed=True)``: the engine's fault log (serve/engine/faults.py),
told which manager failed."""


class ResourceManagers:
    """The engine's managers in calling order. Iterating gives them in order; ``reversed`` for freeing."""

    def __init__(self, managers: Sequence[ResourceManager] = (), record: FaultRecorder | None = None) -> None:
        """``record``: where a manager's failure goes (the engine's fault log); None: it propagates."""
        names = [m.name for m in managers]
        if len(set(names)) != len(names):
            raise ValueError(f"resource managers need distinct names, got {names}")
        self._managers = tuple(managers)
        self._record = record
        self.iteration_ok = True
        """No manager failed since the iteration's boundary (``before_schedule``), its shortfalls included."""

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

    def is_at_rest(self) -> bool:
        return all(m.is_at_rest() for m in self._managers)

    # ---- the loop's calls: every manager in order (frees in reverse); one manager's failure is recorded and the
    # others still run
    def before_schedule(self, scheduler: SchedulerView) -> bool:
        """Every manager's iteration boundary; starts a new iteration's ``iteration_ok``. False when one failed."""
        self.iteration_ok = True
        for m in self._managers:
            try:
                m.before_schedule(scheduler)
            except Exception as exc:  # noqa: BLE001 - the batch still runs
                self._failed(m, exc)
        return self.iteration_ok

    def cover_shortfall(self, scheduler: SchedulerView, blocks: int) -> None:
        """Offer a shortfall of ``blocks`` KV blocks to each manager that grows the pool, in order, each getting
        what the earlier ones left (the scheduler preempts what is left)."""
        for m in self._managers:
            if blocks <= 0:
                break
            if not m.grows_pool:
                continue
            try:
                blocks -= m.cover_shortfall(scheduler, blocks)
            except Exception as exc:  # noqa: BLE001
                self._failed(m, exc)

    def _failed(self, manager: ResourceManager, exc: Exception) -> None:
        if self._record is None:
            raise exc
        self._record(manager.name, exc)
        self.iteration_ok = False

    def after_schedule(self, num_tokens: int) -> None:
        for m in self._managers:
            m.after_schedule(num_tokens)

    def after_execute(self, sampled: Sequence[object], logits: object) -> None:
        """The batch ran. An observer failing here is recorded, but the iteration still counts as healthy: it
        changed nothing the batch serves, and the batch's tokens go out."""
        for m in self._managers:
            try:
                m.after_execute(sampled, logits)
            except Exception as exc:  # noqa: BLE001
                if self._record is None:
                    raise
                self._record(m.name, exc, (), False)

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
