"""Guided requests waiting for their grammar, in their own state, while others are admitted and scheduled (vLLM
v1's shape: a request waiting for its grammar is left out of scheduling until the grammar is ready).

``add_request`` starts the compile (serve/guided/compiler.py: a cache hit is ready at once) and never waits for
it; the request is claimed and counted as waiting like any other (``max_num_waiting``, the gauges, its deadlines),
but the scheduler does not see it until its grammar is ready. At each iteration boundary the engine moves requests
whose grammar compiled into the scheduler (``ready``) and ends those whose guide was refused (``failed``: invalid,
unsatisfiable or too slow, kind invalid input). An aborted or expired request's compile is cancelled
(``discard``): when no other request waits for the same guide, its worker process is killed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from serve.engine.errors import EngineError, EngineOverloaded, InvalidRequest
from serve.engine.sequence import Sequence, SequenceStatus
from serve.guided.compiler import GuideCompiler, GuideError, GuidesBusy, PendingGuide
from serve.guided.state import GuideViolation

GUIDES_BUSY_RETRY_AFTER_S = 5


class GrammarWait:
    def __init__(self, compiler: GuideCompiler, wake: Callable[[], None]) -> None:
        self.compiler = compiler
        self._wake = wake
        self._lock = threading.Lock()
        self._pending: dict[Sequence, PendingGuide] = {}  # compiling (claimed by add_request)
        self._deferred: set[Sequence] = set()               # of those, the ones the loop has taken from the handoff
        self.changed = threading.Event()                  # a compile finished

    def start(self, seq: Sequence) -> bool:
        """Give ``seq`` its grammar state now (a cached grammar) or start its compile and mark it waiting for it;
        True when it waits. EngineOverloaded when too many guides are compiling. A request the engine then refuses
        (overloaded, an id in use) is :meth:`discard`-ed, which cancels its compile."""
        spec = seq.params.guided_decoding
        if spec is None:
            return False
        try:
            pending = self.compiler.submit(spec)
        except GuidesBusy as exc:
            raise EngineOverloaded(f"overloaded: {exc}", GUIDES_BUSY_RETRY_AFTER_S) from None
        if pending.done():
            try:
                seq.guide = pending.state()
                return False
            except GuideError as exc:
                raise InvalidRequest(str(exc)) from None
        seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
        with self._lock:
            self._pending[seq] = pending
        pending.add_done_callback(self._done)
        return True

    def _done(self) -> None:
        self.changed.set()
        self._wake()

    def defer(self, seq: Sequence) -> bool:
        """The loop took ``seq`` from the handoff: True when it waits for its grammar (kept here), False when it
        goes to the scheduler."""
        with self._lock:
            if seq not in self._pending:
                return False
            self._deferred.add(seq)
            return True

    def ready(self) -> list[Sequence]:
        """Deferred requests whose grammar compiled, with their grammar state, ready for the scheduler."""
        out = []
        for seq, pending in self._resolved():
            try:
                seq.guide = pending.state()
            except Exception:  # noqa: BLE001 - failed() answers it
                continue
            self._forget(seq)
            seq.status = SequenceStatus.WAITING
            out.append(seq)
        return out

    def failed(self) -> list[tuple[Sequence, EngineError]]:
        """Deferred requests whose guide was refused, each with the error it ends with."""
        out: list[tuple[Sequence, EngineError]] = []
        for seq, pending in self._resolved():
            try:
                pending.state()
                continue
            except GuideError as exc:
                err: EngineError = InvalidRequest(str(exc))
            except Exception as exc:  # noqa: BLE001 - the compiler's failure, not the guide's
                err = EngineError(f"structured output unavailable: {exc}")
            self._forget(seq)
            out.append((seq, err))
        return out

    def has_failures(self) -> bool:
        return any(True for _ in self._resolved())

    def discard(self, seq: Sequence) -> None:
        """``seq`` ended (aborted, expired, finished): stop waiting for its grammar."""
        pending = self._forget(seq)
        if pending is not None:
            pending.cancel()

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes or ``timeout`` passes (for callers that step the engine themselves)."""
        self.changed.wait(timeout)
        self.changed.clear()

    def wait_if_idle(self, scheduler: Any, timeout: float = 0.05) -> None:
        """:meth:`wait` when grammars compile and the scheduler has nothing to run (a caller's stepping loop)."""
        if self._pending and not scheduler.has_work():
            self.wait(timeout)

    def __len__(self) -> int:
        return len(self._pending)

    def _resolved(self) -> list[tuple[Sequence, PendingGuide]]:
        with self._lock:
            return [(s, p) for s, p in self._pending.items() if s in self._deferred and p.done()]

    def _forget(self, seq: Sequence) -> PendingGuide | None:
        with self._lock:
            self._deferred.discard(seq)
            return self._pending.pop(seq, None)


def guide_error(exc: BaseException) -> EngineError | None:
    """The error a request ends with when its grammar refused a token (GuideViolation: the guide and the request's
    other options left no allowed token): the client's input, not an engine fault. None for other errors."""
    return InvalidRequest(str(exc)) if isinstance(exc, GuideViolation) else None
