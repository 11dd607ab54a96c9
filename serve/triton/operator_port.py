"""The operator port: the engine's controls (serve/engine/controls.py) off the data plane, for the Triton model.

Memory yield / reclaim changes the model's precision for every client and draining takes the server out of
rotation, so they are not requests a client of the inference ports can send (those ports refuse them). The
morphserve model serves them here instead: a small HTTP server in its own process, bound to 127.0.0.1 only, on
the port of its ``operator_port`` parameter (the launcher's ``--operator-port``; 0 or empty: none). It speaks
what the Dynamo worker's system port speaks: ``POST /engine/control/<name>`` with a JSON object, answered
``{"status": "ok", ...}`` (200) or ``{"status": "error", "message": ...}`` (400 for a control refused, 404 for
another path, 500 for a failure). It also serves ``trtllm-serve --enable_sleep_mode``'s memory endpoints with
upstream's shapes: ``POST /release_memory`` and ``POST /resume_memory`` (body ``{"tags": [...]}`` or none) answer
``{"status": "success"}``, ``GET /memory_status`` answers ``{"state", "parked_tags"}``; their errors are
``{"error": {"message": ...}}`` with 400 (a bad tag), 409 (a conflict with the parked state) or 500.

With an operator key (``TRTLLM_RUNTIME_CONTROL_API_KEY``, serve/operator_auth.py) every request must be signed
with it, in upstream's HMAC-SHA256 scheme; anything else is answered 401 ``{"detail": ...}`` and nothing runs.
Without a key the port listens on 127.0.0.1 only.

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
from serve.operator_auth import AuthError, OperatorAuth, check_bind, sign

LOOPBACK = "127.0.0.1"
CONTROL_PATH = "/engine/control/"
MAX_BODY_BYTES = 64 * 1024
MEMORY_ROUTES = {("POST", "/release_memory"): "release_memory", ("POST", "/resume_memory"): "resume_memory",
                 ("GET", "/memory_status"): "memory_status"}
"""trtllm-serve's memory endpoints -> the engine's controls (serve/engine/controls.py)."""

log = get_logger("operator_port")

Handle = Callable[[str, Any], dict[str, Any]]
"""(control name, JSON body) -> answer; raises ValueError for a control it refuses."""


def _handler_class(handle: Handle, auth: OperatorAuth | None) -> type[BaseHTTPRequestHandler]:
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

        def _body(self) -> bytes | None:
            """The request's body (None: refused, answered)."""
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                self._answer(400, {"status": "error", "message": f"a control body is a JSON object of at most "
                                                                 f"{MAX_BODY_BYTES} bytes"})
                return None
            return self.rfile.read(length) if length else b""

        def _authorized(self, method: str, path: str, raw: bytes) -> bool:
            if auth is None:
                return True
            try:
                auth.check(method, path, dict(self.headers.items()), raw)
            except AuthError as exc:
                log.warning("operator_request_refused", path=path, reason=str(exc))
                self._answer(401, {"detail": str(exc)})
                return False
            return True

        def _serve(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            memory = MEMORY_ROUTES.get((method, path))
            if memory is None and not (method == "POST" and path.startswith(CONTROL_PATH)):
                known = [f"{m} {p}" for m, p in MEMORY_ROUTES]
                status = 405 if path.startswith(CONTROL_PATH) or path in {p for _, p in MEMORY_ROUTES} else 404
                self._answer(status, {"status": "error", "message": f"no such route {method} {path!r}; POST "
                                                                   f"{CONTROL_PATH}<control>, {', '.join(known)}"})
                return
            raw = self._body()
            if raw is None or not self._authorized(method, path, raw):
                return
            if memory is not None:
                self._memory(memory, raw)
                return
            try:
                body = json.loads(raw) if raw.strip() else {}
                answer = handle(path[len(CONTROL_PATH):], body)
            except (ValueError, UnicodeDecodeError) as exc:  # JSON errors, refused controls
                self._answer(getattr(exc, "http_status", 400), {"status": "error", "message": str(exc)})
                return
            except Exception as exc:  # noqa: BLE001 - answer, keep serving
                log.exception("operator_control_failed", path=path, error=str(exc))
                self._answer(500, {"status": "error", "message": f"{type(exc).__name__}: {exc}"})
                return
            self._answer(200, answer)

        def _memory(self, control: str, raw: bytes) -> None:
            """trtllm-serve's answer shapes: the control's answer, or {"error": {"message"}} with 400 / 409 / 500."""
            try:
                body = json.loads(raw) if raw.strip() else None
                if body is not None and not isinstance(body, dict):
                    raise ValueError(f"the body is a JSON object such as {{\"tags\": [\"kv_cache\"]}}, got {body!r}")
                answer = handle(control, body)
            except (ValueError, UnicodeDecodeError) as exc:
                self._answer(getattr(exc, "http_status", 400), {"error": {"message": str(exc)}})
                return
            except Exception as exc:  # noqa: BLE001 - answer, keep serving
                log.exception("operator_control_failed", path=self.path, error=str(exc))
                self._answer(500, {"error": {"message": f"{type(exc).__name__}: {exc}"}})
                return
            self._answer(200, answer)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self._serve("POST")

    return Handler


class OperatorPort:
    """The control server on ``host:port`` (127.0.0.1 unless an operator key is set) in a daemon thread:
    ``start()`` binds (OSError when it cannot)."""

    def __init__(self, port: int, handle: Handle, auth: OperatorAuth | None = None, host: str = LOOPBACK) -> None:
        check_bind(host, auth, "the operator port")
        self.port = port
        self.host = host
        self._server = ThreadingHTTPServer((host, port), _handler_class(handle, auth), bind_and_activate=False)
        self._server.daemon_threads = True
        self._signed = auth is not None
        self._thread: threading.Thread | None = None

    def start(self) -> OperatorPort:
        self._server.allow_reuse_address = True
        self._server.server_bind()
        self._server.server_activate()
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="morphserve-operator", daemon=True)
        self._thread.start()
        log.info("operator_port_started", host=self.host, port=self.port, signed=self._signed)
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()


def operator_request(port: int, method: str, path: str, body: dict[str, Any] | None = None, key: str | None = None,
                     timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    """One request to the operator port on this machine, signed with ``key`` when given: (status, JSON answer).
    OSError when nothing listens there."""
    data = json.dumps(body).encode() if body is not None else b""
    headers = {"Content-Type": "application/json", **(sign(key, method, path, data) if key else {})}
    req = urllib.request.Request(f"http://{LOOPBACK}:{port}{path}", data=data if method == "POST" else None,
                                 method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback
            return r.status, json.loads(r.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode("utf-8") or "{}")


def post_control(port: int, name: str, body: dict[str, Any] | None = None, timeout: float = 30.0,
                 key: str | None = None) -> dict[str, Any]:
    """POST a control to the operator port on this machine; the answer, also for a refused control (its
    ``status`` is "error"). OSError when nothing listens there."""
    return operator_request(port, "POST", f"{CONTROL_PATH}{name}", body or {}, key, timeout)[1]
