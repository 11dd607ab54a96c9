"""Why a request was refused or ended without its answer: one vocabulary for the engine and every front end.

The engine decides a request's life (admission, shedding, deadlines, cancellation, draining; see
serve/engine/lifecycle.py) and says what happened as an :class:`ErrorKind`; each transport maps the kind to its
own codes (HTTP status and Retry-After in serve/triton/errors.py, Triton's error codes in the model glue,
Dynamo's exception types in serve/dynamo/worker.py). No front end reads the words of a message to find the
kind: rewording a message changes nothing a client's code can see.

Stdlib only and engine-neutral, so serve.triton (which never imports the engine) can use it too.
"""

from __future__ import annotations

from enum import Enum


class ErrorKind(str, Enum):
    """What a client should make of an error (the value is the wire name)."""

    INVALID_INPUT = "invalid_input"          # the request itself is wrong: fix it, do not retry it as is
    OVERLOADED = "overloaded"                # refused or shed under load: retry after ``retry_after_s``
    DEADLINE_EXCEEDED = "deadline_exceeded"  # its own deadline (timeout_s) passed
    DRAINING = "draining"                    # the server is going away: retry on another replica
    UNAVAILABLE = "unavailable"              # the engine is unhealthy (failed iterations): retry elsewhere
    CANCELLED = "cancelled"                  # cancelled (by its client, or by the BLS model that owns it)
    INTERNAL = "internal"                    # a failure of the server (a failed forward, a bug)


RETRYABLE = frozenset({ErrorKind.OVERLOADED, ErrorKind.DRAINING, ErrorKind.UNAVAILABLE})
"""Kinds whose answer carries a Retry-After: the request was fine, the server could not take it now."""

DEFAULT_RETRY_AFTER_S = 1
"""Retry-After of a retryable kind whose refusal names none (draining, unhealthy)."""


def parse_kind(name: str) -> ErrorKind | None:
    """The kind with this wire name, or None."""
    try:
        return ErrorKind(name)
    except ValueError:
        return None


def retry_after(kind: ErrorKind, retry_after_s: int | None) -> int | None:
    """The Retry-After seconds to answer with: the refusal's own, the default for a retryable kind, else none."""
    if kind not in RETRYABLE:
        return None
    return max(1, int(retry_after_s)) if retry_after_s is not None else DEFAULT_RETRY_AFTER_S
