"""Error kinds (serve/error_kinds.py) on the Triton transport: the tag a model's error message carries, the HTTP
status and Retry-After each kind gets at the HTTP front end, and the Triton error code the model answers with.

A decoupled model's error reaches a gRPC stream client as a message and nothing else (Triton's
``ModelStreamInferResponse.error_message``: no status code, no parameters), so the morphserve model (and the BLS
models over it) start the message with a tag that only this module writes and reads::

    [overloaded retry_after=10] overloaded: no token within queue_timeout_s=30 s of arrival; retry later ...

The HTTP front end answers by the tag's kind (``http_answer``), never by the words after it, and sends the words
without the tag; gRPC clients read the same tag (``GenerationError.kind`` in serve/triton/client.py). A message
without a tag did not come from our models (tritonserver's own refusals: a stub that died, a model not ready)
and is answered as internal. The tag is anchored at the start of the message, so text a client gets echoed back
(an unknown parameter's name) can never pose as one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from serve.error_kinds import ErrorKind, parse_kind, retry_after

_TAG = re.compile(r"\[(?P<kind>[a-z_]+)(?: retry_after=(?P<retry>[0-9]{1,6}))?\] ")

HTTP_STATUS: dict[ErrorKind, int] = {
    ErrorKind.INVALID_INPUT: 400,
    ErrorKind.OVERLOADED: 503,
    ErrorKind.DEADLINE_EXCEEDED: 504,
    ErrorKind.DRAINING: 503,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.CANCELLED: 499,  # the client left; nobody reads this status
    ErrorKind.INTERNAL: 500,
}
"""The HTTP front end's status per kind (docs/hardening.md, "Status codes"); retryable kinds add Retry-After."""

TRITON_CODE: dict[ErrorKind, str] = {
    ErrorKind.INVALID_INPUT: "INVALID_ARG",
    ErrorKind.OVERLOADED: "UNAVAILABLE",
    ErrorKind.DEADLINE_EXCEEDED: "CANCELLED",  # the Python backend of Triton 2.51 has no DEADLINE_EXCEEDED
    ErrorKind.DRAINING: "UNAVAILABLE",
    ErrorKind.UNAVAILABLE: "UNAVAILABLE",
    ErrorKind.CANCELLED: "CANCELLED",
    ErrorKind.INTERNAL: "INTERNAL",
}
"""The ``pb_utils.TritonError`` code name per kind (what Triton's HTTP server and the C API report)."""


@dataclass(frozen=True)
class TaggedError:
    """An error message read back: its kind (None: untagged), Retry-After seconds and the words without the tag."""

    kind: ErrorKind | None
    retry_after_s: int | None
    text: str


def tagged(kind: ErrorKind, message: str, retry_after_s: int | None = None) -> str:
    """``message`` with the tag of ``kind`` in front (a retryable kind always names its Retry-After)."""
    retry = retry_after(kind, retry_after_s)
    return f"[{kind.value}{'' if retry is None else f' retry_after={retry}'}] {message}"


def read_tag(message: str) -> TaggedError:
    """Split a model's error message into its tag and its words."""
    m = _TAG.match(message)
    kind = parse_kind(m.group("kind")) if m else None
    if m is None or kind is None:
        return TaggedError(None, None, message)
    return TaggedError(kind, int(m.group("retry")) if m.group("retry") else None, message[m.end():])


def http_answer(message: str) -> tuple[int, str, int | None]:
    """A model's (or tritonserver's) error message -> (HTTP status, message without the tag, Retry-After)."""
    err = read_tag(message)
    kind = err.kind or ErrorKind.INTERNAL
    return HTTP_STATUS[kind], err.text, retry_after(kind, err.retry_after_s)
