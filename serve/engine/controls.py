"""The operator's controls of a running engine, off the data plane (issue 43): one vocabulary for every operator
surface. The Triton model's operator port (serve/triton/operator_port.py, loopback only) and the Dynamo worker's
system port both serve ``POST /engine/control/<name>`` with these names and JSON bodies; no inference request can
reach them.

========================  ===========================================  ==================================
control                   body                                         effect
========================  ===========================================  ==================================
``memory_yield``          ``{"size": "512MiB"}`` or ``{"bytes": N}``   keep that much given back
``memory_reclaim``        ``{}``                                       clear it (reclaim rule takes over)
``drain``                 ``{}``                                       refuse new requests (503 draining)
``resume``                ``{}``                                       admit again
``state``                 ``{}``                                       draining, memory and engine stats
========================  ===========================================  ==================================

Each answers ``{"status": "ok", ...}``; a bad body or a control this engine cannot carry out raises
ControlError, which the surface answers with ``{"status": "error", "message": ...}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve.engine.engine import LLMEngine

CONTROLS = ("memory_yield", "memory_reclaim", "drain", "resume", "state")


class ControlError(ValueError):
    """A control request the engine refuses; the message says why."""


def yield_request_bytes(body: Any) -> int:
    """``{"size": "512MiB"}`` or ``{"bytes": 536870912}`` -> bytes; ValueError naming what is wrong."""
    from serve.config import parse_size  # noqa: PLC0415 - cheap

    if not isinstance(body, dict) or ("size" in body) == ("bytes" in body):
        raise ControlError('memory_yield takes exactly one of {"size": "512MiB"} or {"bytes": N}')
    if "size" in body:
        if not isinstance(body["size"], str):
            raise ControlError(f'memory_yield "size" must be a string such as "512MiB", got {body["size"]!r}')
        try:
            return parse_size(body["size"])
        except (ValueError, OverflowError):  # OverflowError: more digits than a float holds
            raise ControlError(f'memory_yield "size" must be a size such as "512MiB", got {body["size"][:64]!r}') from None
    value = body["bytes"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ControlError(f'memory_yield "bytes" must be an integer >= 0, got {value!r}')
    return value


def run_control(engine: LLMEngine, name: str, body: Any) -> dict[str, Any]:
    """Carry out control ``name`` on ``engine`` (from any thread); ControlError when it cannot."""
    if name not in CONTROLS:
        raise ControlError(f"unknown control {name!r}; controls: {', '.join(CONTROLS)}")
    if body is not None and not isinstance(body, dict):
        raise ControlError(f"the body of {name} must be a JSON object, got {body!r}")
    if name in ("memory_yield", "memory_reclaim"):
        nbytes = yield_request_bytes(body) if name == "memory_yield" else None
        try:
            return {"status": "ok", "memory_yield": engine.request_memory_yield(nbytes)}
        except ValueError as exc:  # this engine cannot yield (a static mode, an arena that cannot release)
            raise ControlError(str(exc)) from None
    if name in ("drain", "resume"):
        engine.drain(name == "drain")
    stats = engine.stats()
    return {"status": "ok", "draining": engine.lifecycle.draining, "num_running": stats.num_running,
            "num_waiting": stats.num_waiting, **({"stats": stats.as_dict()} if name == "state" else {})}
