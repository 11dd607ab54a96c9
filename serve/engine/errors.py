"""The engine's errors as types: each carries its :class:`~serve.error_kinds.ErrorKind` (and, when the client
should come back, a Retry-After), so that every front end answers by kind, never by the words of the message.

``add_request`` raises these (and ValueError / TypeError for input its validation refuses, which
:func:`error_kind` reads as invalid input); a request the engine ends early carries the same kind on its
final ``RequestOutput`` (``error_kind``, ``retry_after_s``). Each class also derives from the builtin its
callers caught before kinds existed (``EngineOverloaded`` is still a RuntimeError).
"""

from __future__ import annotations

from typing import ClassVar

from serve.error_kinds import ErrorKind


class EngineError(Exception):
    """An error with a kind; ``retry_after_s`` is set when the client may retry the same request later."""

    kind: ClassVar[ErrorKind] = ErrorKind.INTERNAL

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidRequest(EngineError, ValueError):
    """The request cannot be served as it is (a bad id, a bad deadline, ...)."""

    kind = ErrorKind.INVALID_INPUT


class EngineOverloaded(EngineError, RuntimeError):
    """Refused or shed under load: the waiting queue is full, the measured start rate says the request could not
    start within its queue deadline, or it had no first token within that deadline."""

    kind = ErrorKind.OVERLOADED


class DeadlineExceeded(EngineError, TimeoutError):
    """The request's own deadline (``timeout_s``, or the engine's ``request_timeout_s``) passed."""

    kind = ErrorKind.DEADLINE_EXCEEDED


class EngineDraining(EngineError, RuntimeError):
    """The engine is draining (shutting down or taken out of rotation): it finishes what it has, admits nothing."""

    kind = ErrorKind.DRAINING


class EngineUnavailable(EngineError, RuntimeError):
    """The engine failed too many iterations in a row; it refuses new requests until restarted."""

    kind = ErrorKind.UNAVAILABLE


class RequestCancelled(EngineError):
    """The request was cancelled."""

    kind = ErrorKind.CANCELLED


def error_kind(exc: BaseException) -> ErrorKind:
    """The kind of an exception from the engine's API: its own kind, invalid input for the ValueError / TypeError
    its validation raises, internal for anything else."""
    if isinstance(exc, EngineError):
        return exc.kind
    if isinstance(exc, (ValueError, TypeError)):
        return ErrorKind.INVALID_INPUT
    return ErrorKind.INTERNAL


def retry_after_of(exc: BaseException) -> int | None:
    """The exception's Retry-After seconds, when it names some."""
    return exc.retry_after_s if isinstance(exc, EngineError) else None
