"""A Triton request's input tensors -> typed request fields, with errors meant for the client.

Only shapes, types, text encoding and this server's own limits are checked here; the sampling values
themselves are validated once, by ``SamplingParams`` (the engine's), when the model builds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

# name -> the input's array, or None when the request does not carry it.
InputGetter = Callable[[str], "np.ndarray | None"]


class InputError(ValueError):
    """A request the model refuses; the message goes back to the client verbatim."""


@dataclasses.dataclass
class ParsedRequest:
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    ignore_eos: bool = False


def _scalar(get_input: InputGetter, name: str, kind: str) -> Any:
    """The single element of an optional input, or None when absent. ``kind`` names the expected type
    for error messages; Triton has already checked the data type against config.pbtxt."""
    arr = get_input(name)
    if arr is None:
        return None
    if arr.size != 1:
        raise InputError(f"{name} must hold exactly one {kind}, got a tensor of shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _utf8(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(
                f"{name} is not valid UTF-8: byte 0x{bytes(value)[e.start]:02x} at position {e.start} "
                f"({e.reason}); send the text UTF-8 encoded"
            ) from None
    raise InputError(f"{name} must be a string, got {type(value).__name__}")


def parse_request(get_input: InputGetter, max_tokens_limit: int, default_max_tokens: int) -> ParsedRequest:
    """Validate a Triton request's inputs; raise InputError with a message meant for the client."""
    arr = get_input("text_input")
    if arr is None:
        raise InputError("missing required input 'text_input' (TYPE_STRING, shape [1]): the prompt text")
    if arr.size != 1:
        raise InputError(f"text_input must hold exactly one string, got a tensor of shape {list(arr.shape)}")
    prompt = _utf8(arr.reshape(-1)[0], "text_input")
    if not prompt:
        raise InputError("text_input is empty")

    mt = _scalar(get_input, "max_tokens", "INT32")
    max_tokens = default_max_tokens if mt is None else int(mt)
    if max_tokens > max_tokens_limit:
        raise InputError(f"max_tokens={max_tokens} exceeds this server's limit (max_tokens_limit={max_tokens_limit})")

    temp = _scalar(get_input, "temperature", "FP32")
    temperature = 0.0 if temp is None else float(temp)

    tp = _scalar(get_input, "top_p", "FP32")
    top_p = 1.0 if tp is None else float(tp)

    tk = _scalar(get_input, "top_k", "INT32")
    top_k = 0 if tk is None else int(tk)

    sd = _scalar(get_input, "seed", "UINT64")
    seed = None if sd is None else int(sd)

    stop: tuple[str, ...] = ()
    st = get_input("stop")
    if st is not None:
        stop = tuple(_utf8(v, "stop") for v in st.reshape(-1))

    sm = _scalar(get_input, "stream", "BOOL")
    stream = bool(sm) if sm is not None else False
    ie = _scalar(get_input, "ignore_eos", "BOOL")
    ignore_eos = bool(ie) if ie is not None else False
    return ParsedRequest(prompt, max_tokens, temperature, top_p, top_k, seed, stop, stream, ignore_eos)


@dataclasses.dataclass(frozen=True)
class SloInputs:
    """Per-request service targets; None = the server's default. Values are validated by the engine
    (``RequestSLO``), like the sampling values; only shapes and types are checked here."""

    ttft_s: float | None = None
    tbt_s: float | None = None
    priority: int | None = None


def parse_slo_inputs(get_input: InputGetter) -> SloInputs:
    """The optional inputs ttft_slo_s, tbt_slo_s (FP32 seconds) and priority (INT32 tier, 0 = strict)."""
    ttft = _scalar(get_input, "ttft_slo_s", "FP32")
    tbt = _scalar(get_input, "tbt_slo_s", "FP32")
    prio = _scalar(get_input, "priority", "INT32")
    return SloInputs(None if ttft is None else float(ttft), None if tbt is None else float(tbt),
                     None if prio is None else int(prio))
