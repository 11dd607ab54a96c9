"""The HTTP front end's bounds on connections (Reliability III finding 7: 200 slow-header and 100 slow-body connections
were all still open after 60 s; nothing bounded them but the file-descriptor limit).

- **Connections**: at most ``max_connections`` open at once; one more is answered at once with 503 + Retry-After
  and closed (:class:`BoundedSite`, the listening socket of the front end), so a flood of idle connections cannot take
  every file descriptor while requests already admitted go on.
- **Headers**: a connection must deliver a complete request head within ``header_timeout_s`` of opening (and of
  its previous response, on a kept-alive connection), or it is closed: aiohttp's keep-alive timer, which runs from
  the connection's start and closes a connection whose handler still waits for a complete message.
- **Bodies**: a handler must receive the whole body within ``body_timeout_s`` of its head (the front end's
  ``read_body``), or it is answered 408 and the connection closed.

So a slow client holds a connection for at most ``header_timeout_s + body_timeout_s``, whatever it sends. The
defaults (1024 connections, 10 s, 30 s) are in serve/triton/http_body.py with the front end's other bounds.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web


def _refusal(retry_after_s: int) -> bytes:
    body = json.dumps({"error": "too many open connections; retry later"}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: {retry_after_s}\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class _Refuse(asyncio.Protocol):
    """A connection over the limit: 503, then closed, without reading what it sends."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(_refusal(1))  # type: ignore[attr-defined]
        transport.close()


class BoundedSite(web.BaseSite):
    """aiohttp's TCPSite with a bound on open connections (the runner's server counts them)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, max_connections: int, backlog: int = 1024) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self.max_connections = host, port, max_connections
        self.refused = 0

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    def _protocol(self) -> Any:
        server = self._runner.server
        assert server is not None
        if len(server.connections) >= self.max_connections:
            self.refused += 1
            return _Refuse()
        return server()

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, self._host, self._port, backlog=self._backlog,
                                                reuse_address=True)
