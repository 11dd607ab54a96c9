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


KEY = "operator-test-key-0123456789"


def test_with_a_key_every_request_is_signed_or_refused_401() -> None:
    """An unsigned, wrongly signed, replayed or stale request gets 401 and never reaches the engine; a signed one
    is served. Without a key the port refuses to listen beyond loopback."""
    import time

    from serve.operator_auth import OperatorAuth, sign
    from serve.triton.operator_port import operator_request

    seen: list[tuple[str, Any]] = []

    def handle(name: str, body: Any) -> dict[str, Any]:
        seen.append((name, body))
        if name == "memory_status":
            return {"state": "running", "parked_tags": []}
        if body and body.get("tags") == ["sampler"]:
            raise ValueError("runtime memory tag 'sampler' names memory this engine does not hold apart")
        if body and body.get("tags") == ["conflict"]:
            conflict = ValueError("Runtime memory is already parked")
            conflict.http_status = 409  # type: ignore[attr-defined]  # what ControlConflict carries
            raise conflict
        return {"status": "success"} if name.endswith("_memory") else {"status": "ok", "control": name}

    port = OperatorPort(0, handle, OperatorAuth(KEY)).start()
    try:
        for path, method in [("/engine/control/drain", "POST"), ("/release_memory", "POST"), ("/memory_status", "GET")]:
            status, answer = operator_request(port.port, method, path, {} if method == "POST" else None)
            assert status == 401 and "sign" in answer["detail"], (path, answer)
            status, answer = operator_request(port.port, method, path, {} if method == "POST" else None, key="wrong")
            assert status == 401, (path, answer)
        assert seen == []
        assert operator_request(port.port, "POST", "/engine/control/drain", {}, key=KEY) == (
            200, {"status": "ok", "control": "drain"})
        assert operator_request(port.port, "POST", "/release_memory", None, key=KEY) == (200, {"status": "success"})
        assert operator_request(port.port, "GET", "/memory_status", None, key=KEY) == (
            200, {"state": "running", "parked_tags": []})
        assert operator_request(port.port, "POST", "/release_memory", {"tags": ["sampler"]}, key=KEY)[0] == 400
        status, answer = operator_request(port.port, "POST", "/release_memory", {"tags": ["conflict"]}, key=KEY)
        assert status == 409 and "already parked" in answer["error"]["message"]
        # a replay of a signed request (same nonce) and a stale one are refused
        data = b"{}"
        headers = {"Content-Type": "application/json", **sign(KEY, "POST", "/engine/control/resume", data)}
        stale = {"Content-Type": "application/json",
                 **sign(KEY, "POST", "/engine/control/resume", data, timestamp=int(time.time()) - 301)}
        codes = []
        for h in (headers, headers, stale):
            req = urllib.request.Request(f"http://127.0.0.1:{port.port}/engine/control/resume", data=data,
                                         method="POST", headers=h)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback
                    codes.append(r.status)
            except urllib.error.HTTPError as e:
                codes.append(e.code)
        assert codes == [200, 401, 401]
        assert [n for n, _ in seen].count("resume") == 1
    finally:
        port.stop()
    with pytest.raises(ValueError, match="TRTLLM_RUNTIME_CONTROL_API_KEY"):
        OperatorPort(0, handle, None, host="0.0.0.0")  # noqa: S104 - the refusal under test
    OperatorPort(0, handle, OperatorAuth(KEY), host="0.0.0.0")._server.server_close()  # noqa: S104 - keyed: allowed
