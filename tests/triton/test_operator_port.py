"""The operator port (serve/triton/operator_port.py) without a tritonserver: bound to 127.0.0.1 only, controls by
path and JSON body, refusals 400 with the reason, a body bound, other paths and methods refused."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest

from serve.triton.operator_port import MAX_BODY_BYTES, OperatorPort, post_control


def test_controls_are_served_on_loopback_only() -> None:
    seen: list[tuple[str, Any]] = []

    def handle(name: str, body: Any) -> dict[str, Any]:
        seen.append((name, body))
        if name == "memory_yield" and "size" not in body:
            raise ValueError("memory_yield takes exactly one of size or bytes")
        if name == "boom":
            raise RuntimeError("a bug")
        return {"status": "ok", "control": name}

    port = OperatorPort(0, handle).start()
    try:
        assert port._server.server_address[0] == "127.0.0.1"  # never a public address
        assert post_control(port.port, "drain") == {"status": "ok", "control": "drain"}
        assert post_control(port.port, "memory_yield", {"size": "1MiB"})["status"] == "ok"
        assert post_control(port.port, "memory_yield", {}) == {
            "status": "error", "message": "memory_yield takes exactly one of size or bytes"}
        assert post_control(port.port, "boom")["message"] == "RuntimeError: a bug"
        assert seen == [("drain", {}), ("memory_yield", {"size": "1MiB"}), ("memory_yield", {}), ("boom", {})]
        for path, data, status in [("/other", b"{}", 404), ("/engine/control/drain", b"{not json", 400),
                                   ("/engine/control/drain", b"x" * (MAX_BODY_BYTES + 1), 400)]:
            req = urllib.request.Request(f"http://127.0.0.1:{port.port}{path}", data=data, method="POST")
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(req, timeout=10)  # noqa: S310 - loopback
            assert info.value.code == status and json.loads(info.value.read())["status"] == "error"
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{port.port}/engine/control/state", timeout=10)  # noqa: S310
        assert info.value.code == 405
        assert len(seen) == 4  # none of those reached the engine
    finally:
        port.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port.port), timeout=2).close()  # closed with the model
