"""The HTTP front end's bounds and answers: body size and JSON depth limits, the error it answers with
(:class:`FrontError`), and the status of a transport failure between the front end and tritonserver
(docs/hardening.md). A model's errors are answered by their kind (serve/triton/errors.py).

Kept apart from the server (serve/triton/http_front.py) so that the checks every body meets first read in one place.
"""

from __future__ import annotations

import json
import re
from typing import Any

from serve.error_kinds import DEFAULT_RETRY_AFTER_S, ErrorKind, retry_after
from serve.request_values import BadValue, check_text, check_tree, number_text_problem
from serve.triton.errors import HTTP_STATUS

DEFAULT_MAX_BODY_BYTES = 1 << 20   # 1 MiB: a 256 KiB prompt + 64 x 4 KiB list items fit with room to spare
DEFAULT_MAX_JSON_DEPTH = 32        # generate needs 2 ({} and []); infer a rank-8 tensor about 11
DEFAULT_MAX_CONNECTIONS = 1024     # open at once (serve/triton/http_guard.py); one more: 503 and closed
DEFAULT_HEADER_TIMEOUT_S = 10.0    # a request head must arrive within this of the connection (or last response)
DEFAULT_BODY_TIMEOUT_S = 30.0      # its body within this of the head: 1 MiB at >= 35 KB/s


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


def load_json(body: bytes, max_depth: int, check_text: bool = True) -> Any:
    """Parse a body bounded in size by the caller; refuse (400) nesting beyond ``max_depth``, an integer with more
    digits than any field holds, and (``check_text``) a lone surrogate in any key or string
    (serve/request_values.py; generate checks its fields' text itself, after their sizes).

    Python's C parser stops at the interpreter's recursion limit (~1000 levels) with RecursionError,
    so a megabyte of ``[`` costs microseconds and never the stack; the walk then applies the real bound."""
    value = _parse(body, max_depth)
    if isinstance(value, _Malformed):
        raise value.error
    return _checked(value, max_depth, check_text)


class _Malformed:
    def __init__(self, error: FrontError) -> None:
        self.error = error


def _parse(body: bytes, max_depth: int) -> Any:
    """The parsed value, or a _Malformed (a syntax or encoding error: the document is not JSON); FrontError for
    what no parser should be given (nesting, digits)."""
    try:
        return json.loads(body, parse_constant=_no_constants)
    except RecursionError:
        raise FrontError(400, f"JSON body nests deeper than {max_depth} levels (max_json_depth)") from None
    except UnicodeDecodeError as e:
        return _Malformed(FrontError(400, f"request body is not UTF-8 JSON ({e.reason} at byte {e.start})"))
    except json.JSONDecodeError as e:
        return _Malformed(FrontError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column "
                                          f"{e.colno}"))
    except ValueError as e:  # Python's limit on integer digits: not a JSON error, and no field holds such a number
        problem = number_text_problem(e)
        if problem is None:
            raise
        raise FrontError(400, problem) from None


def _checked(value: Any, max_depth: int, check_text: bool = True) -> Any:
    if json_depth(value) > max_depth:
        raise FrontError(400, f"JSON body nests deeper than {max_depth} levels (max_json_depth)")
    try:
        return check_tree(value) if check_text else value
    except BadValue as e:
        raise FrontError(400, str(e)) from None


# ---- model inputs --------------------------------------------------------------------------------------

def check_json_part(json_part: bytes, max_depth: int) -> None:
    """A body forwarded to Triton's own parser: refuse deep nesting, long integers and lone surrogates (400); a
    malformed but shallow document is left for Triton to answer."""
    value = _parse(json_part, max_depth)
    if isinstance(value, _Malformed):
        _check_depth_only(json_part, max_depth)
        return
    _checked(value, max_depth)


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


# ---- the URL ------------------------------------------------------------------------------------------------

SPEC_CACHE_SIZE = 64
"""Model specs the front end keeps (by model name and resolved version): more than any repository serves."""
_VERSION = re.compile(r"[0-9]{1,18}")


def resolve_version(version: str) -> str:
    """A URL's model version as Triton resolves it: "" (the model's policy) or an integer, in canonical form. Triton
    2.51 reads "1.<anything>" as version 1, and the front end kept a spec per spelling (Reliability III finding 8: ~12
    KB per distinct string); any other spelling is 400."""
    if version == "":
        return ""
    if not _VERSION.fullmatch(version):
        raise FrontError(400, f"model version must be a positive integer, got {version[:40]!r}")
    return str(int(version))


def path_text(value: str, what: str) -> str:
    """A name from the URL path: text (a percent-encoded lone surrogate or invalid UTF-8 is 400, not 500)."""
    try:
        return check_text(value, what)
    except BadValue as e:
        raise FrontError(400, str(e)) from None


# ---- transport failures -------------------------------------------------------------------------------

def grpc_error(exc: Exception) -> FrontError:
    """A transport failure between the front end and tritonserver -> 503 (down or restarting), 504 or 500."""
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
    return FrontError(500, f"internal error between the HTTP front end and tritonserver: {name or type(exc).__name__}: "
                           f"{text}")
