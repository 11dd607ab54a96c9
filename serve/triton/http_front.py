"""The project's own HTTP door on the client port: bounded, typed, and cancelling.

Triton 2.51's HTTP server crashes on a deeply nested JSON body (a stack overflow in its parser), answers
JSON type errors with 500, wraps out-of-range integers and never notices a non-streaming client that
leaves. This front (aiohttp, asyncio, in a thread of the launcher) takes the client port instead:

- every body is bounded in bytes (``max_body_bytes``, 413 from Content-Length before reading) and its
  JSON in nesting depth (``max_json_depth``, 400) before anything reaches tritonserver; compressed bodies
  are refused (415), so nothing unbounded is ever inflated;
- generate and generate_stream are served over gRPC on loopback: JSON values are checked against the
  model's declared inputs (type and range, 400 naming the field) and sent as typed tensors; a client that
  disconnects cancels its gRPC stream, which the model sees as ``request.is_cancelled()``;
- errors map to the status codes of docs/hardening.md (400 bad input, 504 deadline, 503 + Retry-After
  overloaded / draining / restarting, 500 internal);
- every other KServe v2 path (health, metadata, config, infer, statistics, repository, ...) is forwarded
  to tritonserver's own HTTP server, which listens on an internal loopback port, with the same bounds.

The JSON formats are Triton's: generate answers ``{"model_name", "model_version", <outputs>}``,
generate_stream one ``data: {...}`` Server-Sent Event per response, errors ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import re
import struct
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from serve.logging_setup import get_logger

log = get_logger("http_front")

DEFAULT_MAX_BODY_BYTES = 1 << 20   # 1 MiB: a 256 KiB prompt + 64 x 4 KiB list items fit with room to spare
DEFAULT_MAX_JSON_DEPTH = 32        # generate needs 2 ({} and []); infer a rank-8 tensor about 11
DEFAULT_RETRY_AFTER_S = 1


class FrontError(Exception):
    """An answer to the client: HTTP status, message, optional Retry-After seconds."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


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
    queue_timeout_s: float = 0.0  # the model's queue deadline; the door enforces it from the HTTP arrival too


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    version: str
    max_batch_size: int
    inputs: Mapping[str, InputSpec]
    limits: RequestLimits | None = None


def _limits_from_parameters(params: Mapping[str, Any]) -> RequestLimits | None:
    from serve.triton.model_params import ServerParams  # noqa: PLC0415
    from serve.triton.request_inputs import InputLimits  # noqa: PLC0415

    raw = {k: (v.get("string_value", "") if isinstance(v, Mapping) else str(v)) for k, v in params.items()}
    if "engine_dir" not in raw:
        return None  # not a morphserve engine model (a BLS front): it checks nothing of its own
    try:
        server = ServerParams.from_params(raw, default_max_tokens=1)
    except ValueError:
        return None  # the model refused to load with these; nothing to mirror
    return RequestLimits(server.max_prompt_bytes, server.max_list_items, InputLimits.max_item_bytes,
                         server.max_tokens_limit, server.queue_timeout_s)


def spec_from_config(config: Mapping[str, Any]) -> ModelSpec:
    """A ModelSpec from a model configuration as JSON (Triton's ``/config`` or the gRPC config as dict)."""
    inputs = {}
    for inp in config.get("input", []):
        dt = str(inp.get("data_type", "TYPE_STRING")).removeprefix("TYPE_")
        dt = "BYTES" if dt == "STRING" else dt
        inputs[inp["name"]] = InputSpec(inp["name"], dt, tuple(int(d) for d in inp.get("dims", [])))
    return ModelSpec(str(config.get("name", "")), "", int(config.get("max_batch_size", 0) or 0), inputs,
                     _limits_from_parameters(config.get("parameters", {})))


def check_limits(limits: RequestLimits, spec: InputSpec, value: Any) -> None:
    """The model's size limits on one JSON value (already type-checked), with the model's messages."""
    if spec.name == "text_input" and isinstance(value, str):
        n = len(value.encode("utf-8"))
        if n > limits.max_prompt_bytes:
            raise FrontError(400, f"text_input has {n} bytes; this server accepts at most {limits.max_prompt_bytes} "
                                  "(max_prompt_bytes)")
    elif spec.name == "max_tokens" and isinstance(value, int) and value > limits.max_tokens_limit:
        raise FrontError(400, f"max_tokens={value} exceeds this server's limit "
                              f"(max_tokens_limit={limits.max_tokens_limit})")
    elif spec.datatype == "BYTES" and isinstance(value, list):
        if len(value) > limits.max_list_items:
            raise FrontError(400, f"{spec.name} may hold at most {limits.max_list_items} items, got {len(value)}")
        for v in value:
            n = len(v.encode("utf-8"))
            if n > limits.max_item_bytes:
                raise FrontError(400, f"each {spec.name} item may have at most {limits.max_item_bytes} bytes, got {n}")


def _shorten(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_value(spec: InputSpec, v: Any) -> Any:
    dt = spec.datatype
    if dt == "BYTES":
        if not isinstance(v, str):
            raise FrontError(400, f"{spec.name} must be a string, got {_shorten(v)}")
        return v.encode("utf-8")
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


def parameter_value(name: str, v: Any) -> tuple[str, Any]:
    """A JSON key that is not an input -> (InferParameter field, value), as Triton's generate passes it."""
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
            field, v = parameter_value(key, value)
            setattr(req.parameters[key], field, v)
            continue
        shape, raw = encode_tensor(inp, value, batched)  # types and ranges first: the limits assume them
        if spec.limits is not None:
            check_limits(spec.limits, inp, value)
        req.inputs.add(name=key, datatype=inp.datatype, shape=shape)
        req.raw_input_contents.append(raw)
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


# ---- status codes ---------------------------------------------------------------------------------------

_RETRY_RE = re.compile(r"retry (?:later, )?after (\d+)")


def classify(message: str) -> tuple[int, int | None]:
    """An error message from the model or Triton -> (HTTP status, Retry-After seconds or None).

    The gRPC stream carries only the message (no code), so the model's own phrases are matched: the table
    in docs/hardening.md lists them."""
    m = message.lower()
    retry = _RETRY_RE.search(m)
    if "overloaded" in m or "retry later" in m or retry:
        return 503, int(retry.group(1)) if retry else DEFAULT_RETRY_AFTER_S
    if "timed out" in m:
        return 504, None
    if "shutting down" in m or "refuses new requests" in m or "draining" in m:
        return 503, DEFAULT_RETRY_AFTER_S
    if m.startswith("internal error") or m.startswith("generation failed"):
        return 500, None
    if "cancelled" in m:
        return 499, None  # the client left; nobody reads this status
    if "unknown model" in m or "is not found" in m:
        return 404, None
    return 400, None


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


# ---- backend (gRPC to tritonserver) --------------------------------------------------------------------------

class GrpcBackend:
    """gRPC channels to tritonserver on loopback (a small pool, round robin) and the models' input specs."""

    def __init__(self, grpc_url: str, channels: int = 4) -> None:
        self.grpc_url = grpc_url
        self.n_channels = channels
        self._stubs: list[Any] = []
        self._channels: list[Any] = []
        self._next = itertools.count()
        self._specs: dict[tuple[str, str], ModelSpec] = {}

    def _stub(self) -> Any:
        if not self._stubs:
            import grpc  # noqa: PLC0415
            from tritonclient.grpc import service_pb2_grpc  # noqa: PLC0415

            opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
            for _ in range(self.n_channels):
                ch = grpc.aio.insecure_channel(self.grpc_url, options=opts)
                self._channels.append(ch)
                self._stubs.append(service_pb2_grpc.GRPCInferenceServiceStub(ch))
        return self._stubs[next(self._next) % len(self._stubs)]

    async def model_spec(self, model: str, version: str) -> ModelSpec:
        key = (model, version)
        spec = self._specs.get(key)
        if spec is None:
            from google.protobuf.json_format import MessageToDict  # noqa: PLC0415
            from tritonclient.grpc import service_pb2  # noqa: PLC0415

            try:
                resp = await self._stub().ModelConfig(service_pb2.ModelConfigRequest(name=model, version=version),
                                                      timeout=10)
            except Exception as e:  # noqa: BLE001 - grpc.aio.AioRpcError and transport failures
                raise grpc_error(e) from None
            config = MessageToDict(resp.config, preserving_proto_field_name=True)
            spec = dataclasses.replace(spec_from_config(config), name=model)
            self._specs[key] = spec
        return spec

    def open_stream(self) -> Any:
        """A new bidirectional ModelStreamInfer call (write / read / done_writing / cancel)."""
        return self._stub().ModelStreamInfer()

    async def close(self) -> None:
        for ch in self._channels:
            with contextlib.suppress(Exception):
                await ch.close()
        self._channels.clear()
        self._stubs.clear()


# ---- the aiohttp application ------------------------------------------------------------------------------------

@dataclasses.dataclass
class FrontOptions:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0 or self.max_json_depth <= 0:
            raise ValueError(f"max_body_bytes and max_json_depth must be positive, got {self}")


# Hop-by-hop and length headers are not forwarded either way (aiohttp sets them).
_SKIP_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer",
                 "upgrade", "proxy-connection", "proxy-authorization", "accept-encoding"}


class FrontApp:
    """Routes and handlers; ``backend`` speaks gRPC, ``triton_http`` is tritonserver's internal HTTP base URL."""

    def __init__(self, backend: Any, triton_http: str, options: FrontOptions | None = None) -> None:
        self.backend = backend
        self.triton_http = triton_http.rstrip("/")
        self.options = options or FrontOptions()
        self.draining = False
        self.inflight = 0
        self._session: Any = None

    def make_app(self) -> Any:
        from aiohttp import web  # noqa: PLC0415

        app = web.Application(client_max_size=self.options.max_body_bytes)
        gen = "/v2/models/{model}"
        ver = "/v2/models/{model}/versions/{version}"
        for base in (gen, ver):
            app.router.add_post(base + "/generate", self.generate)
            app.router.add_post(base + "/generate_stream", self.generate_stream)
        app.router.add_route("*", "/{tail:.*}", self.proxy)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app: Any) -> None:
        if self._session is not None:
            await self._session.close()
        await self.backend.close()

    # -- helpers ------------------------------------------------------------------------------------
    @staticmethod
    def error_response(err: FrontError, sse: bool = False) -> Any:
        """Triton's error format: ``{"error": ...}``; on generate_stream as one event (``data: {...}``)."""
        from aiohttp import web  # noqa: PLC0415

        headers = {"Content-Type": "text/event-stream; charset=utf-8" if sse else "application/json"}
        if err.retry_after is not None:
            headers["Retry-After"] = str(err.retry_after)
        body = _sse({"error": err.message}) if sse else _dumps({"error": err.message}).encode("utf-8")
        resp = web.Response(status=err.status, body=body, headers=headers)
        if err.status in (413, 415):
            resp.force_close()  # the body was not read: close rather than read (or inflate) the rest of it
        return resp

    async def read_body(self, request: Any) -> bytes:
        """The body, bounded before it is read (Content-Length) and while reading (chunked)."""
        limit = self.options.max_body_bytes
        enc = request.headers.get("Content-Encoding", "identity").strip().lower()
        if enc not in ("", "identity"):
            raise FrontError(415, f"Content-Encoding {enc!r} is not accepted; send the body uncompressed")
        length = request.content_length
        if length is not None and length > limit:
            raise FrontError(413, f"request body of {length} bytes exceeds this server's limit of {limit} bytes "
                                  "(max_body_bytes)")
        chunks, size = [], 0
        async for chunk in request.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > limit:
                raise FrontError(413, f"request body exceeds this server's limit of {limit} bytes (max_body_bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise FrontError(503, "the server is draining (shutting down); retry after "
                                  f"{DEFAULT_RETRY_AFTER_S} s on another replica", DEFAULT_RETRY_AFTER_S)

    # -- generate -------------------------------------------------------------------------------------
    async def generate(self, request: Any) -> Any:
        return await self._generate(request, stream=False)

    async def generate_stream(self, request: Any) -> Any:
        return await self._generate(request, stream=True)

    async def _generate(self, request: Any, stream: bool) -> Any:
        from aiohttp import web  # noqa: PLC0415

        model = request.match_info["model"]
        version = request.match_info.get("version", "")
        arrived = asyncio.get_running_loop().time()
        call = None
        resp: Any = None
        self.inflight += 1
        try:
            self.refuse_if_draining()
            body = load_json(await self.read_body(request), self.options.max_json_depth)
            spec = await self.backend.model_spec(model, version)
            req = build_request(spec, version, body)
            call = self.backend.open_stream()
            await call.write(req)
            result: dict[str, Any] | None = None
            # The queue deadline counted from the client's arrival at the door: time spent before the model
            # sees the request (Triton's queue, admission under load) counts too.
            qt = spec.limits.queue_timeout_s if spec.limits is not None else 0.0
            first_by = arrived + qt if qt else None
            while True:
                if first_by is not None:
                    try:
                        msg = await asyncio.wait_for(call.read(), max(0.0, first_by - asyncio.get_running_loop().time()))
                    except asyncio.TimeoutError:
                        retry = max(1, round(qt / 3))
                        raise FrontError(503, f"overloaded: no token within queue_timeout_s={qt:g} s of arrival; "
                                              f"retry later, after {retry} s", retry) from None
                    first_by = None
                else:
                    msg = await call.read()
                if msg is None or not hasattr(msg, "infer_response"):  # grpc.aio.EOF
                    raise FrontError(500, "internal error: tritonserver closed the stream before the final response")
                if msg.error_message:
                    err = FrontError(*_with_message(classify(msg.error_message), msg.error_message))
                    if resp is None:
                        raise err
                    await resp.write(_sse({"error": err.message}))
                    break
                ir = msg.infer_response
                has_data = len(ir.outputs) > 0
                if has_data:
                    data = response_json(ir)
                    if stream:
                        if resp is None:
                            resp = web.StreamResponse(status=200, headers={
                                "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
                            await resp.prepare(request)
                        await resp.write(_sse(data))
                    elif result is not None:
                        raise FrontError(400, "the model sent more than one response; use generate_stream")
                    else:
                        result = data
                if is_final(ir):
                    break
            with contextlib.suppress(Exception):
                await call.done_writing()
            call = None
            if stream:
                if resp is None:  # a final response without data
                    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"})
                    await resp.prepare(request)
                await resp.write_eof()
                return resp
            if result is None:
                raise FrontError(500, "internal error: the model sent no response")
            return web.Response(body=_dumps(result).encode("utf-8"), headers={"Content-Type": "application/json"})
        except FrontError as err:
            if resp is not None:  # the event stream has begun: the error is its last event
                with contextlib.suppress(Exception):
                    await resp.write(_sse({"error": err.message}))
                    await resp.write_eof()
                return resp
            return self.error_response(err, sse=stream)
        except ConnectionResetError:  # the client left mid-stream: the finally cancels the gRPC call
            return resp if resp is not None else web.Response(status=499)
        except asyncio.CancelledError:
            raise  # the client left (aiohttp cancels the handler): the finally cancels the gRPC call
        except Exception as e:  # noqa: BLE001 - grpc.aio.AioRpcError, transport failures
            err = grpc_error(e)
            if resp is not None:
                with contextlib.suppress(Exception):
                    await resp.write(_sse({"error": err.message}))
                    await resp.write_eof()
                return resp
            return self.error_response(err, sse=stream)
        finally:
            self.inflight -= 1
            if call is not None:
                call.cancel()  # the client disconnected or the answer failed: Triton cancels the request

    # -- everything else: forwarded to tritonserver's own HTTP ------------------------------------------
    async def proxy(self, request: Any) -> Any:
        from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web  # noqa: PLC0415

        path = request.path
        try:
            if self.draining and (path.endswith("/ready") or path == "/v2/health/ready"):
                raise FrontError(503, "the server is draining (shutting down)", DEFAULT_RETRY_AFTER_S)
            body = await self.read_body(request) if request.can_read_body else b""
            if body:
                if request.method == "POST" and path.endswith(("/infer", "/generate", "/generate_stream")):
                    self.refuse_if_draining()
                header_len = request.headers.get("Inference-Header-Content-Length")
                try:
                    json_part = body[:int(header_len)] if header_len is not None else body
                except ValueError:
                    raise FrontError(400, "Inference-Header-Content-Length must be an integer") from None
                check_json_part(json_part, self.options.max_json_depth)
            if self._session is None:
                # force_close: no idle keep-alive connection, which would hold tritonserver's SIGTERM drain
                # for its whole exit timeout ("Found 1 HTTP service connections").
                self._session = ClientSession(timeout=ClientTimeout(total=None, sock_connect=5), auto_decompress=False,
                                              connector=TCPConnector(force_close=True))
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP_HEADERS}
            url = self.triton_http + request.raw_path
            async with self._session.request(request.method, url, data=body or None, headers=headers,
                                             allow_redirects=False) as r:
                payload = await r.read()
                out_headers = {k: v for k, v in r.headers.items() if k.lower() not in _SKIP_HEADERS}
                return web.Response(status=r.status, body=payload, headers=out_headers)
        except FrontError as err:
            return self.error_response(err)
        except (ClientError, OSError):
            return self.error_response(FrontError(
                503, f"tritonserver is not reachable (restarting?); retry after {DEFAULT_RETRY_AFTER_S} s",
                DEFAULT_RETRY_AFTER_S))


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


def _with_message(code: tuple[int, int | None], message: str) -> tuple[int, str, int | None]:
    return code[0], message, code[1]


def _dumps(obj: Any) -> str:
    """Triton's JSON: keys sorted, no spaces."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + _dumps(obj).encode("utf-8") + b"\n\n"


# ---- running it in a thread ------------------------------------------------------------------------------------

class HttpFront:
    """The front on ``host:port`` in a daemon thread with its own event loop.

    ``start()`` binds the port (raising OSError when it cannot) and returns; ``drain()`` makes new requests
    and readiness answer 503; ``stop()`` closes the port and waits for the thread."""

    def __init__(self, host: str, port: int, grpc_url: str, triton_http: str,
                 options: FrontOptions | None = None, backend: Any = None) -> None:
        self.host, self.port = host, port
        self.app = FrontApp(backend or GrpcBackend(grpc_url), triton_http, options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None

    @property
    def draining(self) -> bool:
        return self.app.draining

    def drain(self) -> None:
        self.app.draining = True

    def start(self) -> HttpFront:
        from aiohttp import web  # noqa: PLC0415

        started = threading.Event()
        failure: list[BaseException] = []

        async def setup() -> None:
            # handler_cancellation: a client that disconnects cancels its handler (and so its gRPC call);
            # lingering_time: how long the unread rest of a refused body is read and dropped before closing.
            self._runner = web.AppRunner(self.app.make_app(), handle_signals=False, access_log=None,
                                         handler_cancellation=True, lingering_time=2.0, shutdown_timeout=2.0)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True, backlog=1024)
            await site.start()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(setup())
            except BaseException as e:  # noqa: BLE001 - reported to start()
                failure.append(e)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                with contextlib.suppress(Exception):
                    loop.run_until_complete(self._runner.cleanup())
                loop.close()

        self._thread = threading.Thread(target=run, name="morphserve-http-front", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        log.info("http_front_started", host=self.host, port=self.port)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._thread = None
        log.info("http_front_stopped", port=self.port)
