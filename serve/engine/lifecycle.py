"""A request's life in the engine, for every front end: admission bound, shedding on arrival, the queue deadline,
the request's own deadline and draining, decided here and answered as typed errors (serve/engine/errors.py).

vLLM v1 and TensorRT-LLM's executor decide admission, aborts and deadlines in the engine core; so does this engine,
so that the Triton model and the Dynamo worker get the same behaviour from the same EngineConfig fields and only
map kinds to their transport's codes:

- **Draining** (``drain()``): new requests are refused (``EngineDraining``), requests in flight finish.
- **Shedding on arrival** (``shed_on_arrival``, with a queue deadline): a request the measured start rate says
  cannot start within ``queue_timeout_s`` is refused at once (``EngineOverloaded`` with a Retry-After;
  policy/shedding.py decides). The admission bound (``max_num_waiting``) is the handoff queue's
  (serve/engine/admission.py), with the same error.
- **Queue deadline** (``queue_timeout_s``): a request with no first token that long after its arrival is ended
  as overloaded, with a Retry-After of a third of the deadline.
- **Request deadline** (``timeout_s`` per request, else ``request_timeout_s``): past it the request ends as
  deadline exceeded, whatever it has generated.

Deadlines are checked at every iteration boundary (``expired``), so they hold to within one engine step; an ended
request's KV blocks are freed at once. Times are on the engine's clock; the arrival a front end passes may be
earlier than the engine's own (the HTTP front end's), so queueing before the engine counts too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from policy.shedding import StartRateMeter, queue_deadline_retry_after, shed_on_arrival
from serve.engine.errors import (
    DeadlineExceeded,
    EngineDraining,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    InvalidRequest,
)
from serve.error_kinds import DEFAULT_RETRY_AFTER_S

if TYPE_CHECKING:
    from serve.engine.faults import FaultTracker
    from serve.engine.sequence import Sequence


class Lifecycle:
    """The engine's admission and deadline decisions; the engine calls it and carries out what it says."""

    def __init__(self, queue_timeout_s: float = 0.0, shed_on_arrival: bool = True,
                 request_timeout_s: float | None = None) -> None:
        self.queue_timeout_s = queue_timeout_s
        self.shed_on_arrival = shed_on_arrival
        self.request_timeout_s = request_timeout_s
        self.start_rate = StartRateMeter()  # waiting requests started per busy second (shedding on arrival)
        self.draining = False
        self.parked_tags: frozenset[str] = frozenset()  # memory released by the operator (controls.release_memory)

    # ---- admission ------------------------------------------------------------------------------------
    def admit(self, now: float, waiting: int, faults: FaultTracker | None = None) -> None:
        """Raise the error a new request is refused with now, if any: unhealthy (``faults``, the engine's
        FaultTracker), draining, or shed on arrival."""
        if faults is not None and not faults.healthy:
            raise EngineUnavailable(f"the engine failed {faults.consecutive} iterations in a row (last: "
                                    f"{faults.last_error}); it refuses new requests until restarted",
                                    DEFAULT_RETRY_AFTER_S)
        if self.parked_tags:
            raise EngineDraining(f"the server's memory is released ({', '.join(sorted(self.parked_tags))}) and it "
                                 "admits no requests until an operator resumes it (POST /resume_memory); retry after "
                                 f"{DEFAULT_RETRY_AFTER_S} s", DEFAULT_RETRY_AFTER_S)
        if self.draining:
            raise EngineDraining("the server is draining (shutting down or out of rotation) and admits no new "
                                 f"requests; retry on another replica after {DEFAULT_RETRY_AFTER_S} s",
                                 DEFAULT_RETRY_AFTER_S)
        if self.shed_on_arrival and self.queue_timeout_s:
            shed = shed_on_arrival(waiting, self.start_rate.rate_at(now), self.queue_timeout_s)
            if shed.shed:
                raise EngineOverloaded(shed.reason, shed.retry_after_s)

    def deadline(self, arrival: float, timeout_s: float | None) -> float | None:
        """When a request arriving at ``arrival`` with ``timeout_s`` (None: the engine's request_timeout_s) must end."""
        if timeout_s is None:
            timeout_s = self.request_timeout_s
        elif isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise InvalidRequest(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        return None if timeout_s is None else arrival + timeout_s

    # ---- deadlines ------------------------------------------------------------------------------------
    def expired(self, seqs: Iterable[Sequence], now: float) -> list[tuple[Sequence, EngineError]]:
        """The requests whose deadline has passed at ``now``, each with the error it ends with."""
        qt = self.queue_timeout_s
        out: list[tuple[Sequence, EngineError]] = []
        for seq in seqs:
            if seq.deadline is not None and now > seq.deadline:
                out.append((seq, DeadlineExceeded(
                    f"request timed out after timeout_s={seq.deadline - seq.arrival_time:g} s "
                    f"({seq.num_output_tokens} tokens generated)")))
            elif qt and seq.first_token_time is None and now - seq.arrival_time > qt:
                retry = queue_deadline_retry_after(qt)
                out.append((seq, EngineOverloaded(
                    f"overloaded: no token within queue_timeout_s={qt:g} s of arrival; retry later, after {retry} s",
                    retry)))
        return out

    def observe_step(self, now: float, started: int, waiting_after: int) -> None:
        """One iteration: ``started`` requests got their first schedule, ``waiting_after`` still wait."""
        self.start_rate.observe(now, started, waiting_after)
