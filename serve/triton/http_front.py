"""The project's own HTTP front end on the client port: bounded, typed, and cancelling.

Triton 2.51's HTTP server crashes on a deeply nested JSON body (a stack overflow in its parser), answers
JSON type errors with 500, wraps out-of-range integers and never notices a non-streaming client that
leaves. This front (aiohttp, asyncio, in a thread of the launcher) takes the client port instead:

- every body is bounded in bytes (``max_body_bytes``, 413 from Content-Length before reading) and its
  JSON in nesting depth (``max_json_depth``, 400) before anything reaches tritonserver; compressed bodies
  are refused (415), so nothing unbounded is ever inflated;
- generate and generate_stream are served over gRPC on loopback: JSON values are checked against the
  model's declared inputs (type and range, 400 naming the field) and sent as typed tensors; a client that
  disconnects cancels its gRPC stream, which the model sees as ``request.is_cancelled()``;
- errors map to the status codes of docs/hardening.md by their kind (serve/triton/errors.py: the tag the model
  puts in front of its message, never its words): 400 bad input, 504 deadline, 503 + Retry-After overloaded /
  draining / restarting, 500 internal;
- the request carries the front end's arrival time (``morphserve_arrival_s``, serve/triton/controls.py): the engine's
  queue deadline counts from here;
- the other KServe v2 paths clients may use (health, metadata, config, infer, statistics) are forwarded to
  tritonserver's own HTTP server, which listens on an internal loopback port, with the same bounds; the APIs closed
  to clients (shared memory, logging, trace, the model repository: serve/triton/client_apis.py) are refused 403
  and unknown paths 404 before tritonserver sees them;
- connections are bounded in number, and in the time a request's head and body may take
  (serve/triton/http_guard.py).

Triton's JSON formats: generate answers ``{"model_name", "model_version", <outputs>}``, generate_stream one
``data: {...}`` event per response, errors ``{"error": "..."}``. The bounds and the status mapping live in
serve/triton/http_body.py, the JSON <-> tensor conversion in http_tensors.py; this module is the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from serve.error_kinds import DEFAULT_RETRY_AFTER_S, ErrorKind
from serve.logging_setup import get_logger
from serve.triton.client_apis import OPEN_BY_DEFAULT, closed_message, http_api
from serve.triton.controls import ARRIVAL_PARAMETER
from serve.triton.errors import http_answer
from serve.triton.http_body import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_JSON_DEPTH,
    SPEC_CACHE_SIZE,
    FrontError,
    check_json_part,
    grpc_error,
    load_json,
    path_text,
    resolve_version,
)
from serve.triton.http_tensors import ModelSpec, build_request, is_final, response_json, spec_from_config

log = get_logger("http_front")


# ---- backend (gRPC to tritonserver) --------------------------------------------------------------------------

class GrpcBackend:
    """gRPC channels to tritonserver on loopback (a small pool, round robin) and the models' input specs."""

    def __init__(self, grpc_url: str, channels: int = 4) -> None:
        self.grpc_url = grpc_url
        self.n_channels = channels
        self._stubs: list[Any] = []
        self._channels: list[Any] = []
        self._next = itertools.count()
        # by model name and resolved version; bounded, since both come from the client's URL (Reliability III finding 8)
        self._specs: OrderedDict[tuple[str, str], ModelSpec] = OrderedDict()

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
        """The model's input spec (its config, fetched once); ``version`` already resolved (:func:`resolve_version`)."""
        key = (model, version)
        spec = self._specs.get(key)
        if spec is not None:
            self._specs.move_to_end(key)
        else:
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
            while len(self._specs) > SPEC_CACHE_SIZE:
                self._specs.popitem(last=False)
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
    max_connections: int = DEFAULT_MAX_CONNECTIONS   # serve/triton/http_guard.py
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    open_apis: frozenset[str] = OPEN_BY_DEFAULT      # serve/triton/client_apis.py: the rest is refused 403

    def __post_init__(self) -> None:
        if min(self.max_body_bytes, self.max_json_depth, self.max_connections) <= 0 \
                or not 0 < self.header_timeout_s < math.inf or not 0 < self.body_timeout_s < math.inf:
            raise ValueError(f"the HTTP front's limits must be positive (and the timeouts finite), got {self}")




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
        if err.status in (408, 413, 415):
            resp.force_close()  # the body was not read: close rather than read (or inflate) the rest of it
        return resp

    async def read_body(self, request: Any) -> bytes:
        """The body, bounded before it is read (Content-Length) and while reading (chunked)."""
        try:
            async with asyncio.timeout(self.options.body_timeout_s):
                return await self._read_body(request)
        except TimeoutError:  # the rest of a body this slow is not worth waiting for: 408, then closed
            raise FrontError(408, f"request body not received within {self.options.body_timeout_s:g} s "
                                  "(http body timeout)") from None

    async def _read_body(self, request: Any) -> bytes:
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
            raise FrontError.of(ErrorKind.DRAINING, "the server is draining (shutting down); retry after "
                                                    f"{DEFAULT_RETRY_AFTER_S} s on another replica")

    # -- generate -------------------------------------------------------------------------------------
    async def generate(self, request: Any) -> Any:
        return await self._generate(request, stream=False)

    async def generate_stream(self, request: Any) -> Any:
        return await self._generate(request, stream=True)

    async def _generate(self, request: Any, stream: bool) -> Any:
        from aiohttp import web  # noqa: PLC0415

        arrived = time.monotonic()  # CLOCK_MONOTONIC: the model reads it in its own process
        call = None
        resp: Any = None
        self.inflight += 1
        try:
            self.refuse_if_draining()
            model = path_text(request.match_info["model"], "model name")
            version = resolve_version(path_text(request.match_info.get("version", ""), "model version"))
            # text is checked per field, after the sizes (http_tensors.build_request): a refusal costs least
            body = load_json(await self.read_body(request), self.options.max_json_depth, check_text=False)
            spec = await self.backend.model_spec(model, version)
            req = build_request(spec, version, body)
            if spec.limits is not None:  # a morphserve engine model: its queue deadline counts from here
                req.parameters[ARRIVAL_PARAMETER].double_param = arrived
            call = self.backend.open_stream()
            await call.write(req)
            result: dict[str, Any] | None = None
            while True:
                msg = await call.read()
                if msg is None or not hasattr(msg, "infer_response"):  # grpc.aio.EOF
                    raise FrontError(500, "internal error: tritonserver closed the stream before the final response")
                if msg.error_message:  # answered by the kind in its tag (serve/triton/errors.py), not its words
                    err = FrontError(*http_answer(msg.error_message))
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
            api = http_api(path)
            if api is None:
                raise FrontError(404, f"no such endpoint: {request.method} {path[:200]}")
            if api not in self.options.open_apis:
                raise FrontError(403, closed_message(api))
            if self.draining and (path.endswith("/ready") or path == "/v2/health/ready"):
                raise FrontError.of(ErrorKind.DRAINING, "the server is draining (shutting down)")
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
        self.site: Any = None

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
            # keepalive_timeout: aiohttp closes a connection without a complete request head that long after it
            # opened or answered, which is the header-read bound (serve/triton/http_guard.py).
            from serve.triton.http_guard import BoundedSite  # noqa: PLC0415 - aiohttp at module level

            options = self.app.options
            self._runner = web.AppRunner(self.app.make_app(), handle_signals=False, access_log=None,
                                         handler_cancellation=True, lingering_time=2.0, shutdown_timeout=2.0,
                                         keepalive_timeout=options.header_timeout_s)
            await self._runner.setup()
            self.site = BoundedSite(self._runner, self.host, self.port, options.max_connections)
            await self.site.start()

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
