"""The project's gRPC front end on the client gRPC port: Triton's GRPCInferenceService forwarded, bounded in message
size and closed to the APIs clients may not use (docs/hardening.md, Reliability III, findings 4 and 9).

Triton 2.51 accepts gRPC messages up to 2 GB (its server sets the size itself; no flag bounds it): a 100 MB input
was received and copied (0.7-2 s) before the model refused it, and tritonserver's resident memory grew 41 -> 440 MiB
and stayed. Its shared-memory and logging APIs were open to every client. This front end (grpc.aio, in a thread of the
launcher, like the HTTP front end) takes the client port instead and forwards to tritonserver on an internal loopback
port:

- a message larger than ``max_message_bytes`` (4 MiB: a 256 KiB prompt, 3 x 64 x 4 KiB of word lists and a 64 KiB
  guide fit with room to spare) is refused by the transport, RESOURCE_EXHAUSTED, before it is read into memory;
- a method of an API that is not open (serve/triton/client_apis.py) is answered PERMISSION_DENIED; a method that is
  not Triton's, UNIMPLEMENTED;
- the rest is forwarded as raw bytes (never parsed here), with the client's metadata and deadline; a client that
  cancels cancels the forwarded call, so the model still sees ``request.is_cancelled()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

from serve.logging_setup import get_logger
from serve.triton.client_apis import closed_message, grpc_api

log = get_logger("grpc_front")

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
_HOP_METADATA = {"user-agent", "te", "content-type", "grpc-accept-encoding", "grpc-encoding", "grpc-timeout"}


class _Forward:
    """A grpc.GenericRpcHandler: each Triton method forwarded to the backend channel, or refused."""

    def __init__(self, channel: Any, opened: frozenset[str]) -> None:
        self.channel = channel
        self.opened = opened

    def service(self, details: Any) -> Any:
        import grpc  # noqa: PLC0415

        method = details.method
        found = grpc_api(method)
        if found is None:
            return None  # UNIMPLEMENTED
        api, streams = found
        if api not in self.opened:
            async def refuse(request: Any, context: Any) -> Any:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, closed_message(api))
            if streams:
                return grpc.stream_stream_rpc_method_handler(refuse)
            return grpc.unary_unary_rpc_method_handler(refuse)
        if streams:
            return grpc.stream_stream_rpc_method_handler(self._stream(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _call_options(self, context: Any) -> dict[str, Any]:
        metadata = [(k, v) for k, v in (context.invocation_metadata() or ()) if k not in _HOP_METADATA
                    and not k.startswith(":")]
        remaining = context.time_remaining()
        return {"metadata": metadata, "timeout": remaining}

    def _unary(self, method: str) -> Any:
        import grpc  # noqa: PLC0415

        call = self.channel.unary_unary(method)

        async def handler(request: bytes, context: Any) -> bytes:
            try:
                return await call(request, **self._call_options(context))
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
        return handler

    def _stream(self, method: str) -> Any:
        import grpc  # noqa: PLC0415

        stream = self.channel.stream_stream(method)

        async def handler(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            call = stream(**self._call_options(context))

            async def pump() -> None:
                async for request in requests:
                    await call.write(request)
                await call.done_writing()

            writer = asyncio.ensure_future(pump())
            try:
                async for response in call:
                    yield response
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
            finally:
                writer.cancel()
                call.cancel()  # the client left or the stream ended: Triton cancels the request
        return handler


class GrpcFront:
    """The front end on ``host:port`` in a daemon thread with its own event loop; ``start()`` binds the port (OSError
    when it cannot) and returns, ``stop()`` closes it. The backend is tritonserver's internal gRPC address."""

    def __init__(self, host: str, port: int, backend_url: str, opened: frozenset[str],
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        if max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
        self.host, self.port, self.backend_url = host, port, backend_url
        self.opened, self.max_message_bytes = opened, max_message_bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: Any = None

    async def _serve(self) -> None:
        import grpc  # noqa: PLC0415

        # the backend answers the model's outputs: no bound beyond what this front end lets in (the client side's)
        channel = grpc.aio.insecure_channel(self.backend_url, options=[("grpc.max_receive_message_length", -1),
                                                                       ("grpc.max_send_message_length", -1)])
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", self.max_message_bytes),
                                                ("grpc.max_send_message_length", -1),
                                                ("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers([_Forward(channel, self.opened)])
        if self._server.add_insecure_port(f"{self.host}:{self.port}") == 0:
            raise OSError(f"cannot listen on {self.host}:{self.port} (in use?)")
        await self._server.start()
        self._channel = channel

    def start(self) -> GrpcFront:
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve())
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
                    loop.run_until_complete(self._server.stop(grace=1.0))
                    loop.run_until_complete(self._channel.close())
                loop.close()

        self._thread = threading.Thread(target=run, name="morphserve-grpc-front", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0] if isinstance(failure[0], OSError) else OSError(str(failure[0]))
        log.info("grpc_front_started", host=self.host, port=self.port, max_message_bytes=self.max_message_bytes)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._thread = None
        log.info("grpc_front_stopped", port=self.port)
