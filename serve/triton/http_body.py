"""The HTTP front's bounds and answers: body size and JSON depth limits, the error it answers with
(:class:`FrontError`), and the status of a transport failure between the front and tritonserver
(docs/hardening.md). A model's errors are answered by their kind (serve/triton/errors.py).

Kept apart from the server (serve/triton/http_front.py) so that the checks every body meets first read in one place.
"""

from __future__ import annotations

import json
from typing import Any

from serve.error_kinds import DEFAULT_RETRY_AFTER_S, ErrorKind, retry_after
from serve.triton.errors import HTTP_STATUS

DEFAULT_MAX_BODY_BYTES = 1 << 20   # 1 MiB: a 256 KiB prompt + 64 x 4 KiB list items fit with room to spare
DEFAULT_MAX_JSON_DEPTH = 32        # generate needs 2 ({} and []); infer a rank-8 tensor about 11


class FrontError(Exception):
    """An answer to the client: HTTP status, message, optional Retry-After seconds."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after

    @classmethod
    def of(cls, kind: ErrorKind, message: str, retry_after_s: int | None = None) -> FrontError:
        """The answer for an error of ``kind`` (its status; Retry-After for a retryable kind)."""
        return cls(HTTP_STATUS[kind], message, retry_after(kind, retry_after_s))


# ---- bounded JSON -----------------------------------------------------------------------------------

def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, ``[]`` and ``{}`` are 1)."""
    depth, level = 0, [(value, 1)]
    while level:
        v, d = level.pop()
        if isinstance(v, dict):
            depth = max(depth, d)
            level.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            depth = max(depth, d)
            level.extend((x, d + 1) for x in v)
    return depth


def _no_constants(name: str) -> Any:
    raise FrontError(400, f"JSON constant {name} is not a number this server accepts")


def load_json(body: bytes, max_depth: int) -> Any:
    """Parse a body bounded in size by the caller; refuse nesting beyond ``max_depth`` (400).

    Python's C parser stops at the interpreter's recursion limit (~1000 levels) with RecursionError,
    so a megabyte of ``[`` costs microseconds and never the stack; the walk then applies the real bound."""
    try:
        value = json.loads(body, parse_constant=_no_constants)
    except RecursionError:
        raise FrontError(400, f"JSON body nests deeper than {max_depth} levels (max_json_depth)") from None
    except UnicodeDecodeError as e:
        raise FrontError(400, f"request body is not UTF-8 JSON ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise FrontError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if json_depth(value) > max_depth:
        raise FrontError(400, f"JSON body nests deeper than {max_depth} levels (max_json_depth)")
    return value


# ---- model inputs --------------------------------------------------------------------------------------

def check_json_part(json_part: bytes, max_depth: int) -> None:
    """A body forwarded to Triton's own parser: refuse deep nesting (400); a malformed but shallow
    document is left for Triton to answer."""
    try:
        load_json(json_part, max_depth)
    except FrontError as err:
        if "nests deeper" in err.message:
            raise
        _check_depth_only(json_part, max_depth)


def _check_depth_only(json_part: bytes, max_depth: int) -> None:
    """Refuse (400) a JSON document nested beyond ``max_depth`` even when it is otherwise malformed: bracket
    counting outside strings, stopping at the first excess (linear, no backtracking)."""
    depth = 0
    in_string = escaped = False
    # Fast path: a document with few brackets cannot nest deeply.
    if json_part.count(b"[") + json_part.count(b"{") <= max_depth:
        return
    for c in json_part:
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:
                escaped = True
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x5B, 0x7B):
            depth += 1
            if depth > max_depth:
                raise FrontError(400, f"JSON body nests deeper than {max_depth} levels (max_json_depth)")
        elif c in (0x5D, 0x7D):
            depth -= 1


# ---- transport failures -------------------------------------------------------------------------------

def grpc_error(exc: Exception) -> FrontError:
    """A transport failure between the front and tritonserver -> 503 (down or restarting), 504 or 500."""
    code = getattr(exc, "code", None)
    name = getattr(code(), "name", "") if callable(code) else ""
    details = getattr(exc, "details", None)
    text = (details() if callable(details) else None) or str(exc)
    if name == "UNAVAILABLE":
        return FrontError(503, f"tritonserver is not reachable (restarting?); retry after "
                               f"{DEFAULT_RETRY_AFTER_S} s", DEFAULT_RETRY_AFTER_S)
    if name == "DEADLINE_EXCEEDED":
        return FrontError(504, f"tritonserver did not answer in time: {text}")
    if name in ("INVALID_ARGUMENT", "NOT_FOUND"):
        return FrontError(400 if name == "INVALID_ARGUMENT" else 404, text)
    return FrontError(500, f"internal error between the HTTP front and tritonserver: {name or type(exc).__name__}: "
                           f"{text}")
