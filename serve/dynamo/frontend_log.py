"""What Dynamo's frontend log says about each request's routing (ai-dynamo 1.6.1's INFO lines).

Every routing attempt ends with one ``kv_router.route_request`` line (``route request completed`` /
``failed`` / ``cancelled``) that names the request (the id of the OpenAI response, ``chatcmpl-<id>`` /
``cmpl-<id>``), the worker (decimal instance id), the blocks the KV router believed that worker holds
(``overlap_blocks``), the attempt number and, on a retry, why the request moved
(``migration.reason``: ``response_timeout``, ``disconnected``, ...). Attempts are in log order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ID = re.compile(r"request_id=\"?([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")
_FIELDS = {
    "worker_id": re.compile(r"\bworker_id=(\d+)"),
    "overlap_blocks": re.compile(r"\boverlap_blocks=(\d+)"),
    "attempt": re.compile(r"\brequest\.attempt=(\d+)"),
}
_REASON = re.compile(r"\bmigration\.reason=\"?([a-z_]+)")
_ERROR = re.compile(r"\berror\.type=\"?([a-z_]+)")
_OUTCOME = re.compile(r"route request (completed|failed|cancelled)")


@dataclass(frozen=True)
class Attempt:
    outcome: str             # completed | failed | cancelled
    worker_id: int | None
    overlap_blocks: int | None
    attempt: int
    migration_reason: str | None   # why this attempt is a retry (on attempts >= 1)
    error: str | None              # why this attempt failed (response_timeout, cannot_connect, ...)


def response_id(openai_id: str) -> str:
    """``chatcmpl-<uuid>`` / ``cmpl-<uuid>`` -> ``<uuid>`` (the id the frontend logs)."""
    return openai_id.split("-", 1)[1] if openai_id.startswith(("chatcmpl-", "cmpl-")) else openai_id


def attempts(text: str) -> dict[str, list[Attempt]]:
    """Request id -> its routing attempts, from the frontend log's text."""
    out: dict[str, list[Attempt]] = {}
    for line in _ANSI.sub("", text).splitlines():
        m = _OUTCOME.search(line)
        if m is None:
            continue
        values = {k: int(x.group(1)) if (x := rx.search(line)) else None for k, rx in _FIELDS.items()}
        reason, error = _REASON.search(line), _ERROR.search(line)
        attempt = Attempt(m.group(1), values["worker_id"], values["overlap_blocks"], values["attempt"] or 0,
                          reason.group(1) if reason else None, error.group(1) if error else None)
        for rid in set(_ID.findall(line)):
            out.setdefault(rid, []).append(attempt)
    return out


def read_attempts(path: Path) -> dict[str, list[Attempt]]:
    try:
        return attempts(path.read_text(errors="replace"))
    except OSError:
        return {}
