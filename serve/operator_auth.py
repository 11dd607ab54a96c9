"""The operator key: every operator control (Triton's operator port, Dynamo's system port) signed with HMAC-SHA256,
in the scheme of ``trtllm-serve --enable_sleep_mode`` (TensorRT-LLM's runtime-control endpoints), so the same
client code and the same key serve both.

The key comes from ``TRTLLM_RUNTIME_CONTROL_API_KEY`` (upstream's variable). A signed request carries:

- ``x-trtllm-runtime-control-timestamp``: Unix seconds, decimal; accepted within ``WINDOW_S`` of the server's clock;
- ``x-trtllm-runtime-control-nonce``: 32 lowercase hex digits, never used before (within the window);
- ``x-trtllm-runtime-control-auth``: ``sha256=`` + the lowercase hex HMAC-SHA256, under the key, of
  ``trtllm-runtime-control-v1\\n METHOD \\n path \\n timestamp \\n nonce \\n body`` (newlines, no spaces; ``path``
  the route without its query, e.g. ``/release_memory`` or ``/engine/control/memory_yield``; ``body`` the exact
  bytes sent, empty for GET).

Where a surface hands over only the parsed JSON body (Dynamo's system port calls the worker with a dict, no headers),
the three values travel in the body instead, under ``"auth": {"signature", "timestamp", "nonce"}``, and the signed
body is the rest of it in canonical JSON (keys sorted, no spaces): :func:`sign_body` / :meth:`OperatorAuth.check_body`.

Checks run in that order (headers, their form, the signature, the window, the nonce), so a request with a bad
signature never uses up the nonce cache; the cache holds ``MAX_NONCES`` live nonces and refuses new requests when
full rather than forget one early (a replay could then pass). Every failure is :class:`AuthError`, answered 401 with
nothing done. The key itself is never logged, put in an answer or exported as a metric.

stdlib only: imported by the Triton model's operator port and the Dynamo worker alike.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping

ENV_KEY = "TRTLLM_RUNTIME_CONTROL_API_KEY"
AUTH_HEADER = "x-trtllm-runtime-control-auth"
TIMESTAMP_HEADER = "x-trtllm-runtime-control-timestamp"
NONCE_HEADER = "x-trtllm-runtime-control-nonce"
SCHEME = b"trtllm-runtime-control-v1"
WINDOW_S = 300
MAX_NONCES = 4096
_NONCE = re.compile(r"[0-9a-f]{32}")
_METHOD = re.compile(r"[A-Za-z]+")


class AuthError(Exception):
    """An operator request that is not signed with the key; the message says what is wrong (never the key)."""


def _payload(method: str, path: str, timestamp: str, nonce: str, body: bytes) -> bytes:
    return b"\n".join([SCHEME, method.upper().encode(), path.encode(), timestamp.encode(), nonce.encode(), body])


def signature(key: str, method: str, path: str, timestamp: str, nonce: str, body: bytes) -> str:
    return "sha256=" + hmac.new(key.encode("utf-8"), _payload(method, path, timestamp, nonce, body),
                                hashlib.sha256).hexdigest()


def sign(key: str, method: str, path: str, body: bytes = b"", *, timestamp: int | None = None,
         nonce: str | None = None) -> dict[str, str]:
    """The three headers that sign a request (a client's helper)."""
    ts = str(int(time.time()) if timestamp is None else timestamp)
    nonce = secrets.token_hex(16) if nonce is None else nonce
    return {AUTH_HEADER: signature(key, method, path, ts, nonce, body), TIMESTAMP_HEADER: ts, NONCE_HEADER: nonce}


BODY_AUTH = "auth"


def canonical(body: Mapping[str, object]) -> bytes:
    """The bytes a body-signed request signs: its JSON without ``auth``, keys sorted, no spaces."""
    return json.dumps({k: v for k, v in body.items() if k != BODY_AUTH}, sort_keys=True,
                      separators=(",", ":")).encode("utf-8")


def sign_body(key: str, path: str, body: Mapping[str, object]) -> dict[str, object]:
    """``body`` with its signature under ``auth`` (for surfaces that see only the JSON body)."""
    h = sign(key, "POST", path, canonical(body))
    return {**body, BODY_AUTH: {"signature": h[AUTH_HEADER], "timestamp": h[TIMESTAMP_HEADER],
                                "nonce": h[NONCE_HEADER]}}


class OperatorAuth:
    """Checks signed operator requests against one key; thread-safe."""

    def __init__(self, key: str, clock: Callable[[], float] = time.time, window_s: int = WINDOW_S,
                 max_nonces: int = MAX_NONCES) -> None:
        if not key:
            raise ValueError(f"an empty operator key signs nothing; set {ENV_KEY} to a secret")
        self._key = key
        self._clock = clock
        self.window_s = window_s
        self.max_nonces = max_nonces
        self._nonces: dict[str, float] = {}   # nonce -> when it leaves the window
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never the key
        return f"OperatorAuth(window_s={self.window_s}, nonces={len(self._nonces)})"

    def check(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> None:
        """Pass, or raise AuthError; a request that passes has used up its nonce."""
        lower = {k.lower(): v for k, v in headers.items()}
        given, ts, nonce = lower.get(AUTH_HEADER), lower.get(TIMESTAMP_HEADER), lower.get(NONCE_HEADER)
        if not (given and ts and nonce):
            raise AuthError(f"operator controls need the key: sign the request ({AUTH_HEADER}, {TIMESTAMP_HEADER}, "
                            f"{NONCE_HEADER}; docs/hardening.md)")
        if not (_METHOD.fullmatch(method) and ts.isascii() and ts.isdigit() and _NONCE.fullmatch(nonce)
                and path.startswith("/") and not any(c in path for c in "?#\n")):
            raise AuthError("invalid operator request authentication")
        if not hmac.compare_digest(given.encode("utf-8"),
                                   signature(self._key, method, path, ts, nonce, body).encode("utf-8")):
            raise AuthError("invalid operator request authentication")
        now = self._clock()
        if abs(now - int(ts)) > self.window_s:
            raise AuthError(f"operator request timestamp is outside the validity window ({self.window_s} s)")
        with self._lock:
            for old in [n for n, until in self._nonces.items() if until < now]:
                del self._nonces[old]
            if nonce in self._nonces:
                raise AuthError("operator request nonce has already been used")
            if len(self._nonces) >= self.max_nonces:
                raise AuthError("too many operator requests in the validity window (nonce cache full); retry later")
            self._nonces[nonce] = int(ts) + self.window_s

    def check_body(self, path: str, body: Mapping[str, object]) -> dict[str, object]:
        """A body-signed POST to ``path``: pass (returning the body without ``auth``) or raise AuthError."""
        auth = body.get(BODY_AUTH)
        if not isinstance(auth, Mapping):
            raise AuthError(f'operator controls need the key: sign the body ("{BODY_AUTH}": {{"signature", '
                            '"timestamp", "nonce"}; docs/hardening.md)')
        headers = {AUTH_HEADER: str(auth.get("signature", "")), TIMESTAMP_HEADER: str(auth.get("timestamp", "")),
                   NONCE_HEADER: str(auth.get("nonce", ""))}
        self.check("POST", path, headers, canonical(body))
        return {k: v for k, v in body.items() if k != BODY_AUTH}


def from_env(environ: Mapping[str, str] | None = None) -> OperatorAuth | None:
    """The operator key of this process's environment; None when it sets none."""
    key = (os.environ if environ is None else environ).get(ENV_KEY, "")
    return OperatorAuth(key) if key else None


LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def check_bind(host: str, auth: OperatorAuth | None, what: str) -> None:
    """ValueError for an operator surface that would listen beyond loopback without a key."""
    if host not in LOOPBACK_HOSTS and auth is None:
        raise ValueError(f"{what} on {host} is reachable from other machines: set {ENV_KEY} (the operator key) "
                         "first, or listen on 127.0.0.1")
