"""Tiny loopback HTTP helpers (stdlib only) for readiness checks, metrics scrapes and engine controls."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def get_text(url: str, timeout: float = 5.0) -> str | None:
    """The body of a 200 response, or None when the server is not (yet) answering."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback URLs we build
            return r.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def get_json(url: str, timeout: float = 5.0) -> Any:
    body = get_text(url, timeout)
    if body is None:
        return None
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return None


def post_json(url: str, body: dict[str, Any], timeout: float = 10.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310
        return json.loads(r.read().decode("utf-8"))


def metric_values(text: str, name: str) -> list[float]:
    """Every sample of metric ``name`` in Prometheus text (any labels)."""
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            try:
                out.append(float(line.rsplit(" ", 1)[1]))
            except ValueError:
                continue
    return out
