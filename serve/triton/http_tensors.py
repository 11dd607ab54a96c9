"""JSON values -> typed gRPC tensors and back, for the HTTP front end (serve/triton/http_front.py): a model's declared
inputs (``ModelSpec`` from its config), its own request bounds checked before a round trip, the
``ModelInferRequest`` built from a generate body, and Triton's generate JSON from a response."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from serve.request_values import BadValue, check_text, check_tree
from serve.triton.http_body import FrontError
from serve.triton.trtllm import PARAMETER_ALIASES

_INT_RANGES = {
    "INT8": (-(1 << 7), (1 << 7) - 1), "INT16": (-(1 << 15), (1 << 15) - 1),
    "INT32": (-(1 << 31), (1 << 31) - 1), "INT64": (-(1 << 63), (1 << 63) - 1),
    "UINT8": (0, (1 << 8) - 1), "UINT16": (0, (1 << 16) - 1), "UINT32": (0, (1 << 32) - 1),
    "UINT64": (0, (1 << 64) - 1),
}
_FLOAT_MAX = {"FP16": 65504.0, "FP32": float(np.finfo(np.float32).max), "FP64": float(np.finfo(np.float64).max)}
_NP_DTYPES = {
    "INT8": "<i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "UINT8": "<u1", "UINT16": "<u2",
    "UINT32": "<u4", "UINT64": "<u8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8", "BOOL": "?",
}


@dataclasses.dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str          # Triton's wire name: BYTES, INT32, FP32, BOOL, ...
    dims: tuple[int, ...]  # without the batch dimension; -1 = any


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """A morphserve model's own request bounds (its config.pbtxt parameters), checked here first so that a
    refused request never costs a round trip to the model; the messages are the model's."""

    max_prompt_bytes: int
    max_list_items: int
    max_item_bytes: int
    max_tokens_limit: int


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    version: str
    max_batch_size: int
    inputs: Mapping[str, InputSpec]
    limits: RequestLimits | None = None
    required: frozenset[str] = frozenset()  # inputs the config does not mark optional


def _limits_from_parameters(params: Mapping[str, Any]) -> RequestLimits | None:
    from serve.triton.model_params import ServerParams  # noqa: PLC0415
    from serve.triton.request_inputs import InputLimits  # noqa: PLC0415

    raw = {k: (v.get("string_value", "") if isinstance(v, Mapping) else str(v)) for k, v in params.items()}
    if "engine_dir" not in raw:
        return None  # not a morphserve engine model (a BLS model): it checks nothing of its own
    try:
        server = ServerParams.from_params(raw, default_max_tokens=1)
    except ValueError:
        return None  # the model refused to load with these; nothing to mirror
    return RequestLimits(server.max_prompt_bytes, server.max_list_items, InputLimits.max_item_bytes,
                         server.max_tokens_limit)


def spec_from_config(config: Mapping[str, Any]) -> ModelSpec:
    """A ModelSpec from a model configuration as JSON (Triton's ``/config`` or the gRPC config as dict)."""
    inputs, required = {}, set()
    for inp in config.get("input", []):
        dt = str(inp.get("data_type", "TYPE_STRING")).removeprefix("TYPE_")
        dt = "BYTES" if dt == "STRING" else dt
        inputs[inp["name"]] = InputSpec(inp["name"], dt, tuple(int(d) for d in inp.get("dims", [])))
        if not inp.get("optional", False):
            required.add(inp["name"])
    return ModelSpec(str(config.get("name", "")), "", int(config.get("max_batch_size", 0) or 0), inputs,
                     _limits_from_parameters(config.get("parameters", {})), frozenset(required))


def _utf8_len_over(value: str, limit: int) -> int | None:
    """The UTF-8 size of ``value`` when it is over ``limit`` bytes, else None; a string of more than ``limit``
    characters is over without being encoded (Reliability III finding 11: refusals must be cheap)."""
    if len(value) > limit:
        return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    if value.isascii() or 4 * len(value) <= limit:
        return None
    n = len(value.encode("utf-8", "surrogatepass"))
    return n if n > limit else None


def check_limits(limits: RequestLimits, spec: InputSpec, value: Any) -> None:
    """The model's size limits on one JSON value, with the model's messages: checked before its type and text (values
    of another type pass here and are refused by encode_tensor), so a body over them is refused at least cost."""
    if spec.name == "text_input" and isinstance(value, str):
        n = _utf8_len_over(value, limits.max_prompt_bytes)
        if n is not None:
            raise FrontError(400, f"text_input has {n} bytes; this server accepts at most {limits.max_prompt_bytes} "
                                  "(max_prompt_bytes)")
    elif spec.name == "max_tokens" and isinstance(value, int) and value > limits.max_tokens_limit:
        raise FrontError(400, f"max_tokens={value} exceeds this server's limit "
                              f"(max_tokens_limit={limits.max_tokens_limit})")
    elif spec.datatype == "BYTES" and isinstance(value, list):
        if len(value) > limits.max_list_items:
            raise FrontError(400, f"{spec.name} may hold at most {limits.max_list_items} items, got {len(value)}")
        for v in value:
            n = _utf8_len_over(v, limits.max_item_bytes) if isinstance(v, str) else None
            if n is not None:
                raise FrontError(400, f"each {spec.name} item may have at most {limits.max_item_bytes} bytes, got {n}")


def _shorten(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_value(spec: InputSpec, v: Any) -> Any:
    dt = spec.datatype
    if dt == "BYTES":
        if not isinstance(v, str):
            raise FrontError(400, f"{spec.name} must be a string, got {_shorten(v)}")
        try:
            return check_text(v, spec.name).encode("utf-8")
        except BadValue as e:
            raise FrontError(400, str(e)) from None
    if dt == "BOOL":
        if not isinstance(v, bool):
            raise FrontError(400, f"{spec.name} must be true or false, got {_shorten(v)}")
        return v
    if dt in _INT_RANGES:
        lo, hi = _INT_RANGES[dt]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise FrontError(400, f"{spec.name} must be an integer in [{lo}, {hi}] ({dt}), got {_shorten(v)}")
        return v
    if dt in _FLOAT_MAX:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)) \
                or abs(float(v)) > _FLOAT_MAX[dt]:
            raise FrontError(400, f"{spec.name} must be a finite number ({dt}), got {_shorten(v)}")
        return float(v)
    raise FrontError(400, f"{spec.name} ({dt}) cannot be sent through generate; use gRPC")


def _shape(spec: InputSpec, n: int, batched: bool) -> list[int]:
    dims = list(spec.dims) or [1]
    free = [i for i, d in enumerate(dims) if d < 0]
    fixed = math.prod(d for d in dims if d >= 0)
    if len(free) > 1:
        raise FrontError(400, f"{spec.name} has {len(free)} variable dimensions and cannot be sent through "
                              "generate; use gRPC")
    if free:
        if fixed == 0 or n % fixed:
            raise FrontError(400, f"{spec.name} holds {n} values, not a multiple of {fixed}")
        dims[free[0]] = n // fixed
    elif n != fixed:
        raise FrontError(400, f"{spec.name} must hold {fixed} value{'s' if fixed != 1 else ''}, got {n}")
    return [1, *dims] if batched else dims


def encode_tensor(spec: InputSpec, value: Any, batched: bool) -> tuple[list[int], bytes]:
    """A JSON value (a scalar or a flat list) -> (shape, raw little-endian bytes) for ``spec``."""
    items = value if isinstance(value, list) else [value]
    if any(isinstance(v, (list, dict)) for v in items):
        raise FrontError(400, f"{spec.name} must be a value or a flat list of values, got a nested structure")
    checked = [_check_value(spec, v) for v in items]
    shape = _shape(spec, len(checked), batched)
    if spec.datatype == "BYTES":
        raw = b"".join(struct.pack("<I", len(b)) + b for b in checked)
    else:
        raw = np.asarray(checked, dtype=_NP_DTYPES[spec.datatype]).tobytes()
    return shape, raw


_INT64 = _INT_RANGES["INT64"]


TRITON_REQUEST_PARAMETERS = ("triton_enable_empty_final_response",)
"""The reserved ``triton_*`` request parameters tritonserver (2.51) accepts from a request; it refuses any other."""


def parameter_value(name: str, v: Any) -> tuple[str, Any]:
    """A JSON key that is not an input -> (InferParameter field, value), as Triton's generate passes it; its name
    and a string value must be text (serve/request_values.py)."""
    try:
        check_tree({name: v})
    except BadValue as e:
        raise FrontError(400, str(e)) from None
    if isinstance(v, bool):
        return "bool_param", v
    if isinstance(v, int):
        if not _INT64[0] <= v <= _INT64[1]:
            raise FrontError(400, f"request parameter {name!r} is out of the 64-bit integer range")
        return "int64_param", v
    if isinstance(v, float):
        return "double_param", v
    if isinstance(v, str):
        return "string_param", v
    raise FrontError(400, f"request parameter {name!r} must be a string, number or boolean, got {_shorten(v)}")


def build_request(spec: ModelSpec, version: str, body: Any, request_id: str = "") -> Any:
    """A generate JSON object -> a gRPC ModelInferRequest (inputs by the model's config, the rest parameters)."""
    from tritonclient.grpc import service_pb2  # noqa: PLC0415 - keeps this module importable without grpc

    if not isinstance(body, dict):
        raise FrontError(400, "the generate body must be a JSON object of input names and values")
    req = service_pb2.ModelInferRequest(model_name=spec.name, model_version=version, id=request_id)
    batched = spec.max_batch_size > 0
    for key, value in body.items():
        inp = spec.inputs.get(key)
        if inp is None:
            target = spec.inputs.get(PARAMETER_ALIASES.get(key, ""))
            if target is not None:  # an alias (max_new_tokens, min_tokens): the input's limits, type and range
                if spec.limits is not None:
                    check_limits(spec.limits, target, value)
                encode_tensor(dataclasses.replace(target, name=key), value, batched)
            if key.startswith("triton_") and key not in TRITON_REQUEST_PARAMETERS:  # tritonserver answers these 500
                raise FrontError(400, f"request parameter {key[:64]!r}: keys starting with 'triton_' are reserved for "
                                      f"Triton; a request may send only {', '.join(TRITON_REQUEST_PARAMETERS)}")
            field, v = parameter_value(key, value)
            setattr(req.parameters[key], field, v)
            continue
        if spec.limits is not None:  # sizes first: the cheapest refusal of a large body
            check_limits(spec.limits, inp, value)
        shape, raw = encode_tensor(inp, value, batched)
        req.inputs.add(name=key, datatype=inp.datatype, shape=shape)
        req.raw_input_contents.append(raw)
    # checked here, not left to tritonserver: a body of parameters only (no input at all) was answered 500 by it
    for name in sorted(spec.required - set(body)):
        inp = spec.inputs[name]
        raise FrontError(400, f"missing required input {name!r} ({inp.datatype}, shape {list(inp.dims)}) of model "
                              f"{spec.name!r}")
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    return req


def _decode_bytes(raw: bytes) -> list[str]:
    out, i = [], 0
    while i + 4 <= len(raw):
        (n,) = struct.unpack_from("<I", raw, i)
        out.append(raw[i + 4:i + 4 + n].decode("utf-8", errors="replace"))
        i += 4 + n
    return out


def response_json(resp: Any) -> dict[str, Any]:
    """A gRPC ModelInferResponse -> Triton's generate JSON (one element: a scalar; more: a list)."""
    out: dict[str, Any] = {"model_name": resp.model_name, "model_version": resp.model_version}
    if resp.id:
        out["id"] = resp.id
    for i, o in enumerate(resp.outputs):
        raw = resp.raw_output_contents[i] if i < len(resp.raw_output_contents) else b""
        if o.datatype == "BYTES":
            values: list[Any] = _decode_bytes(raw)
        elif o.datatype in _NP_DTYPES:
            values = np.frombuffer(raw, dtype=_NP_DTYPES[o.datatype]).tolist()
        else:
            continue
        out[o.name] = values[0] if len(values) == 1 else values
    return out


def is_final(resp: Any) -> bool:
    p = resp.parameters.get("triton_final_response")
    return True if p is None else bool(p.bool_param)
