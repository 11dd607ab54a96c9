"""The client ports of a TritonServer: the project's HTTP front end (serve/triton/http_front.py) and gRPC front end
(serve/triton/grpc_front.py) in front of tritonserver's own servers, which listen on internal loopback ports.

The front ends keep their ports while the supervisor restarts tritonserver (clients get 503 / UNAVAILABLE
"restarting", not a refused connection). Each may be turned off (``http=False`` / ``grpc=False``): tritonserver's
own server then takes the client port, unbounded (tests of Triton's own behaviour only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve.triton.client_apis import OPEN_BY_DEFAULT
from serve.triton.grpc_front import DEFAULT_MAX_MESSAGE_BYTES, GrpcFront
from serve.triton.http_front import FrontOptions, HttpFront

LOOPBACK = "127.0.0.1"


@dataclass
class FrontEnds:
    http_port: int
    grpc_port: int
    triton_http_port: int      # = http_port without the HTTP front end
    triton_grpc_port: int      # = grpc_port without the gRPC front end
    http: bool = True
    grpc: bool = True
    front_options: FrontOptions | None = None
    opened: frozenset[str] = OPEN_BY_DEFAULT
    grpc_max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    http_front: HttpFront | None = field(default=None, init=False)
    grpc_front: GrpcFront | None = field(default=None, init=False)

    def internal_ports(self) -> list[int]:
        """tritonserver's own ports behind the front ends."""
        return [p for p, front_end in ((self.triton_http_port, self.http), (self.triton_grpc_port, self.grpc))
                if front_end]

    def running_ports(self) -> list[int]:
        """Client ports a running front end holds (not busy for a restarted tritonserver)."""
        return [p for p, d in ((self.http_port, self.http_front), (self.grpc_port, self.grpc_front)) if d is not None]

    def start(self) -> None:
        """Start the front ends not yet running; OSError naming the port that cannot be bound."""
        if self.grpc and self.grpc_front is None:
            try:
                self.grpc_front = GrpcFront(LOOPBACK, self.grpc_port, f"{LOOPBACK}:{self.triton_grpc_port}",
                                            self.opened, self.grpc_max_message_bytes).start()
            except OSError as e:
                raise OSError(f"the gRPC front end cannot listen on {LOOPBACK}:{self.grpc_port}: {e}") from None
        if self.http and self.http_front is None:
            options = self.front_options or FrontOptions()
            options.open_apis = self.opened
            try:
                self.http_front = HttpFront(LOOPBACK, self.http_port, f"{LOOPBACK}:{self.triton_grpc_port}",
                                            f"http://{LOOPBACK}:{self.triton_http_port}", options).start()
            except OSError as e:
                raise OSError(f"the HTTP front end cannot listen on {LOOPBACK}:{self.http_port}: {e}") from None

    def drain(self) -> bool:
        """New HTTP requests and readiness answer 503; False without an HTTP front end."""
        if self.http_front is None:
            return False
        self.http_front.drain()
        return True

    def stop(self) -> None:
        for front_end in (self.http_front, self.grpc_front):
            if front_end is not None:
                front_end.stop()
        self.http_front = self.grpc_front = None
