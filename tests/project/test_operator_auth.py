"""The operator key (serve/operator_auth.py): upstream's HMAC-SHA256 request signing, every check that refuses."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from serve.operator_auth import (
    AUTH_HEADER,
    NONCE_HEADER,
    TIMESTAMP_HEADER,
    AuthError,
    OperatorAuth,
    check_bind,
    from_env,
    sign,
    sign_body,
)

KEY = "k3y"
NOW = 1_800_000_000


def _auth(max_nonces: int = 4096) -> OperatorAuth:
    return OperatorAuth(KEY, clock=lambda: NOW, max_nonces=max_nonces)


def test_the_signature_is_upstreams() -> None:
    """The payload and header format of trtllm-serve's runtime-control auth, computed independently here."""
    h = sign(KEY, "POST", "/release_memory", b'{"tags":["kv_cache"]}', timestamp=NOW, nonce="a" * 32)
    payload = b"trtllm-runtime-control-v1\nPOST\n/release_memory\n" + str(NOW).encode() + b"\n" + b"a" * 32 + b"\n" \
        + b'{"tags":["kv_cache"]}'
    assert h == {AUTH_HEADER: "sha256=" + hmac.new(KEY.encode(), payload, hashlib.sha256).hexdigest(),
                 TIMESTAMP_HEADER: str(NOW), NONCE_HEADER: "a" * 32}


def test_a_signed_request_passes_once() -> None:
    auth = _auth()
    h = sign(KEY, "POST", "/release_memory", b"{}", timestamp=NOW)
    auth.check("POST", "/release_memory", h, b"{}")
    with pytest.raises(AuthError, match="already been used"):
        auth.check("POST", "/release_memory", h, b"{}")


@pytest.mark.parametrize("change, message", [
    (lambda h, r: ({k: v for k, v in h.items() if k != AUTH_HEADER}, r), "need the key"),
    (lambda h, r: ({**h, AUTH_HEADER: h[AUTH_HEADER].upper()}, r), "invalid"),
    (lambda h, r: (h, {**r, "body": b'{"tags":[]}'}), "invalid"),           # body changed after signing
    (lambda h, r: (h, {**r, "path": "/resume_memory"}), "invalid"),          # replayed on another route
    (lambda h, r: (h, {**r, "method": "GET"}), "invalid"),
    (lambda h, r: ({**h, NONCE_HEADER: "XYZ"}, r), "invalid"),
    (lambda h, r: ({**h, TIMESTAMP_HEADER: "12a"}, r), "invalid"),
])
def test_tampering_is_refused(change, message) -> None:
    h = sign(KEY, "POST", "/release_memory", b"{}", timestamp=NOW)
    headers, req = change(h, {"method": "POST", "path": "/release_memory", "body": b"{}"})
    with pytest.raises(AuthError, match=message):
        _auth().check(req["method"], req["path"], headers, req["body"])


def test_the_window_and_a_wrong_key() -> None:
    auth = _auth()
    auth.check("GET", "/memory_status", sign(KEY, "GET", "/memory_status", timestamp=NOW - 300), b"")
    with pytest.raises(AuthError, match="validity window"):
        auth.check("GET", "/memory_status", sign(KEY, "GET", "/memory_status", timestamp=NOW + 301), b"")
    with pytest.raises(AuthError, match="invalid"):
        auth.check("GET", "/memory_status", sign("other", "GET", "/memory_status", timestamp=NOW), b"")


def test_bad_signatures_never_fill_the_nonce_cache_and_a_full_cache_refuses() -> None:
    auth = _auth(max_nonces=2)
    for _ in range(5):
        with pytest.raises(AuthError):
            auth.check("POST", "/x", sign("other", "POST", "/x", timestamp=NOW), b"")
    for _ in range(2):
        auth.check("POST", "/x", sign(KEY, "POST", "/x", timestamp=NOW), b"")
    with pytest.raises(AuthError, match="cache full"):
        auth.check("POST", "/x", sign(KEY, "POST", "/x", timestamp=NOW), b"")


def test_body_signing_for_surfaces_that_see_only_json() -> None:
    auth = _auth()
    signed = sign_body(KEY, "/engine/control/memory_yield", {"size": "512MiB"})
    signed["auth"]["timestamp"] = signed["auth"]["timestamp"]  # as sent
    auth_now = OperatorAuth(KEY)
    assert auth_now.check_body("/engine/control/memory_yield", signed) == {"size": "512MiB"}
    tampered = {**sign_body(KEY, "/engine/control/memory_yield", {"size": "1MiB"}), "size": "9GiB"}
    with pytest.raises(AuthError):
        auth_now.check_body("/engine/control/memory_yield", tampered)
    with pytest.raises(AuthError, match="sign the body"):
        auth.check_body("/engine/control/drain", {})


def test_the_key_comes_from_the_environment_and_never_shows() -> None:
    assert from_env({}) is None
    auth = from_env({"TRTLLM_RUNTIME_CONTROL_API_KEY": "s3cret-value"})
    assert auth is not None and "s3cret" not in repr(auth)
    with pytest.raises(ValueError):
        OperatorAuth("")
    check_bind("127.0.0.1", None, "x")
    check_bind("10.0.0.2", auth, "x")
    with pytest.raises(ValueError, match="TRTLLM_RUNTIME_CONTROL_API_KEY"):
        check_bind("10.0.0.2", None, "the operator port")
