"""The operator port: the engine's controls (serve/engine/controls.py) off the data plane, for the Triton model.

Memory yield / reclaim changes the model's precision for every client and draining takes the server out of
rotation, so they are not requests a client of the inference ports can send (those ports refuse them). The
morphserve model serves them here instead: a small HTTP server in its own process, bound to 127.0.0.1 only, on
the port of its ``operator_port`` parameter (the launcher's ``--operator-port``; 0 or empty: none). It speaks
what the Dynamo worker's system port speaks: ``POST /engine/control/<name>`` with a JSON object, answered
``{"status": "ok", ...}`` (200) or ``{"status": "error", "message": ...}`` (400 for a control refused, 404 for
another path, 500 for a failure).

stdlib only (``http.server``), so that nothing it needs can be missing inside the Python backend's stub; the
model passes the function that carries a control out (this room never imports the engine).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from serve.logging_setup import get_logger

LOOPBACK = "127.0.0.1"
CONTROL_PATH = "/engine/control/"
MAX_BODY_BYTES = 64 * 1024

log = get_logger("operator_port")

Handle = Callable[[str, Any], dict[str, Any]]
"""(control name, JSON body) -> answer; raises ValueError for a control it refuses."""


def _handler_class(handle: Handle) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "morphserve-operator"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            return None  # every control is logged as an event by the model instead

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._answer(405, {"status": "error", "message": f"POST {CONTROL_PATH}<control> with a JSON object"})

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if not self.path.startswith(CONTROL_PATH):
                self._answer(404, {"status": "error", "message": f"no such path {self.path!r}; POST "
                                                                 f"{CONTROL_PATH}<control>"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                self._answer(400, {"status": "error", "message": f"a control body is a JSON object of at most "
                                                                 f"{MAX_BODY_BYTES} bytes"})
                return
            try:
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw.strip() else {}
                answer = handle(self.path[len(CONTROL_PATH):], body)
            except (ValueError, UnicodeDecodeError) as exc:  # JSON errors, refused controls
                self._answer(400, {"status": "error", "message": str(exc)})
                return
            except Exception as exc:  # noqa: BLE001 - answer, keep serving
                log.exception("operator_control_failed", path=self.path, error=str(exc))
                self._answer(500, {"status": "error", "message": f"{type(exc).__name__}: {exc}"})
                return
            self._answer(200, answer)

    return Handler


class OperatorPort:
    """The control server on ``127.0.0.1:port`` in a daemon thread: ``start()`` binds (OSError when it cannot)."""

    def __init__(self, port: int, handle: Handle) -> None:
        self.port = port
        self._server = ThreadingHTTPServer((LOOPBACK, port), _handler_class(handle), bind_and_activate=False)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    def start(self) -> OperatorPort:
        self._server.allow_reuse_address = True
        self._server.server_bind()
        self._server.server_activate()
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="morphserve-operator", daemon=True)
        self._thread.start()
        log.info("operator_port_started", host=LOOPBACK, port=self.port)
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()


def post_control(port: int, name: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """POST a control to the operator port on this machine; the answer, also for a refused control (its
    ``status`` is "error"). OSError when nothing listens there."""
    req = urllib.request.Request(f"http://{LOOPBACK}:{port}{CONTROL_PATH}{name}", data=json.dumps(body or {}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback
            return json.loads(r.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        return json.loads(e.read().decode("utf-8") or "{}")
