"""Structured logging: one JSON line per event (structlog), shared by the launcher, the client and the
Triton model.

Events carry their context as keys (``request_id=...``, ``model=...``) rather than formatted into the
message, so a log of a serving run can be filtered with ``jq 'select(.request_id == "...")'``.

Inside tritonserver the Python-backend stub inherits the server's stdout/stderr, so the model's JSON
lines land in the server log next to Triton's own lines.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import IO, Any

import structlog

_lock = threading.Lock()
_configured: tuple[int, int] | None = None  # (level, id(stream)) of the last configure_logging call

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def parse_level(level: int | str) -> int:
    """Accept ``logging.INFO``, ``"info"`` or ``"INFO"``; raise ValueError on anything else."""
    if isinstance(level, int):
        return level
    try:
        return _LEVELS[level.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; use one of {sorted(set(_LEVELS))}") from None


class _CurrentStderr:
    """``sys.stderr`` as it is when a line is written, not when logging was configured: a test runner (or a CLI)
    that swaps stderr and later closes its stand-in must not leave every later log line failing on a closed file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR = _CurrentStderr()


def configure_logging(level: int | str = logging.INFO, stream: IO[str] | None = None, *, force: bool = False) -> None:
    """Configure structlog process-wide to print one sorted-key JSON object per event.

    ``stream`` defaults to ``sys.stderr`` so that a CLI's stdout stays free for its product (the
    launcher's single "ready" line, the client's completion). Calling it again with the same arguments
    is a no-op; ``force=True`` reconfigures anyway.
    """
    global _configured
    lvl = parse_level(level)
    out = stream if stream is not None else _STDERR
    key = (lvl, id(out))
    with _lock:
        if _configured == key and not force:
            return
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.StackInfoRenderer(),
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(sort_keys=True, default=str),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(lvl),
            logger_factory=structlog.PrintLoggerFactory(file=out),
            cache_logger_on_first_use=False,
        )
        _configured = key


def get_logger(component: str, **bound: Any) -> structlog.typing.FilteringBoundLogger:
    """A logger whose every event carries ``component=...`` plus any extra bound keys.

    The logger stays lazy (keys passed as initial values, not via ``.bind()``), so a module-level
    logger picks up a configure_logging() call made later, e.g. in main().
    """
    return structlog.get_logger(component=component, **bound)


def ensure_logging() -> None:
    """Configure JSON logging to stderr unless the process already did (library entry points call this)."""
    if _configured is None:
        configure_logging()
