"""Client values checked once, the same way for every name and alias and every front end (the HTTP front end, the
morphserve model's gRPC inputs and parameters, the BLS models, the Dynamo worker; docs/hardening.md, Reliability III,
findings 5 and 6).

- **Text** must be text a UTF-8 encoder can write: a JSON string may carry a lone surrogate (``"\\ud800"``), which
  Python keeps in a ``str`` and which failed later, as a 500, wherever the text was encoded (a prompt, a stop
  string, a parameter's key or value, a guide); bytes must decode as UTF-8. Both are refused naming the field.
- **Integers** are range-checked against the type they are narrowed to, before any narrowing: numpy's int32 wrapped
  ``max_new_tokens`` 4294967298 to 2 and ``min_tokens`` 2**32 + 1 to 1; a bool is not an integer.
- **Reals** must be finite and within the type they are narrowed to (float32 turned 1e39 into inf).
- **JSON numbers** with more digits than any type holds (Python refuses to convert over 4300 digits, with a
  ValueError that is not a JSON error and answered 500) are refused as such.

Stdlib only: every room may use it. Errors are :class:`BadValue` (a ValueError), with a message for the client.
"""

from __future__ import annotations

import math
import re
from typing import Any

INT32 = (-(2**31), 2**31 - 1)
UINT32 = (0, 2**32 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT64 = (0, 2**64 - 1)
FLOAT32_MAX = 3.4028234663852886e38

_SURROGATE = re.compile("[\ud800-\udfff]")


class BadValue(ValueError):
    """A client's value that no field can take: the message names the field and says why."""


def _where(name: str) -> str:
    return name if len(name) <= 80 and not _SURROGATE.search(name) else repr(name[:80])


def check_text(value: str, name: str) -> str:
    """``value`` unchanged, or BadValue when it holds a lone surrogate (text no UTF-8 encoder can write)."""
    if not value.isascii():
        m = _SURROGATE.search(value)
        if m is not None:
            raise BadValue(f"{_where(name)} holds a lone UTF-16 surrogate (U+{ord(m.group()):04X}) at character "
                           f"{m.start()}: not Unicode text; send valid UTF-8")
    return value


def text(value: Any, name: str) -> str:
    """A string from ``str`` or UTF-8 ``bytes`` (numpy's bytes_ included), checked as :func:`check_text`."""
    if isinstance(value, str):
        return check_text(value, name)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadValue(f"{_where(name)} is not valid UTF-8: byte 0x{raw[e.start]:02x} at position {e.start} "
                           f"({e.reason}); send the text UTF-8 encoded") from None
    raise BadValue(f"{_where(name)} must be a string, got {type(value).__name__}")


def integer(value: Any, name: str, bounds: tuple[int, int] = INT64) -> int:
    """A Python int from an int (numpy's included) within ``bounds``, checked before any narrowing."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise BadValue(f"{_where(name)} must be an integer, got {_short(value)}")
    v = int(value.__index__())
    lo, hi = bounds
    if not lo <= v <= hi:
        raise BadValue(f"{_where(name)} must be an integer in [{lo}, {hi}], got {_short(v)}")
    return v


def real(value: Any, name: str, max_abs: float = FLOAT32_MAX) -> float:
    """A finite float (from an int or a float) of magnitude at most ``max_abs``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise BadValue(f"{_where(name)} must be a number, got {_short(value)}")
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not math.isfinite(v) or abs(v) > max_abs:
        raise BadValue(f"{_where(name)} must be a finite number of magnitude at most {max_abs:g}, got {_short(value)}")
    return v


def check_tree(value: Any, where: str = "the request") -> Any:
    """``value`` (parsed JSON) unchanged, or BadValue for the first key or string in it, at any depth, that holds a
    lone surrogate, naming its path. Iterative, so depth costs no stack."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            check_text(v, path)
        elif isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str):
                    check_text(k, f"a key of {path}")
                stack.append((item, f"{path}.{k}" if path != "the request" else str(k)))
        elif isinstance(v, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(v))
    return value


def number_text_problem(exc: ValueError) -> str | None:
    """The client's message when parsing JSON failed on an integer with too many digits (Python's int limit),
    else None (another error)."""
    if "digits" in str(exc) and "integer" in str(exc):
        return "a JSON number has more digits than any field holds (uint64 has 20)"
    return None


def _short(v: Any) -> str:
    try:
        text_ = repr(v)
    except ValueError:  # an int too long to print (Python's digit limit)
        return f"an integer of {v.bit_length()} bits"
    return text_ if len(text_) <= 40 else text_[:37] + "..."
