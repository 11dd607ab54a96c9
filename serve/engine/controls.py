"""The operator's controls of a running engine, off the data plane: one vocabulary for every operator
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
``release_memory``        ``{"tags": ["model_weights", "kv_cache"]}``  trtllm-serve's sleep: park
``resume_memory``         ``{"tags": [...]}`` (none: every parked one)   trtllm-serve's wake-up
``memory_status``         ``{}``                                       ``{"state", "parked_tags"}``
``remeasure_costs``       ``{}``                                       step costs + crossovers measured now
========================  ===========================================  ==================================

Each answers ``{"status": "ok", ...}``; a bad body or a control this engine cannot carry out raises
ControlError, which the surface answers with ``{"status": "error", "message": ...}``.

The last three are ``trtllm-serve --enable_sleep_mode``'s memory endpoints (``POST /release_memory``,
``POST /resume_memory``, ``GET /memory_status``) with its tags, answers and rules; the operator port serves them
under those paths with upstream's answer shapes. Releasing closes admission (requests are answered 503 until
resumed), waits for what is in flight to finish, then gives memory back and answers when it is back; resuming
takes it back and answers once every layer is at full precision again, then admits. Tags that map:

- ``model_weights``: every layer the mode may quantize moves down its ladder and the bytes it frees go back to the
  device or host (the yield of docs/memory-yield.md, at its largest); resuming restores full precision;
- ``kv_cache``: the prefix cache is dropped (upstream discards KV on release too) and the KV extents morphing
  added go back with the yield; the base KV pool stays (an engine that may serve again keeps it).

Upstream's other tags (``model``, ``sampler``, ``drafter``, ...) name memory this engine does not hold apart and
are refused by name. Releasing the tags already parked again succeeds; releasing more while parked is a conflict
(:class:`ControlConflict`, 409): resume first. A resume with nothing parked succeeds.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve.engine.engine import LLMEngine

MEMORY_CONTROLS = ("release_memory", "resume_memory", "memory_status")
CONTROLS = ("memory_yield", "memory_reclaim", "drain", "resume", "state", "remeasure_costs", *MEMORY_CONTROLS)
SLEEP_TAGS = ("model_weights", "kv_cache")
UPSTREAM_TAGS = ("model_weights", "model", "draft_model_weights", "draft_model", "kv_cache", "sampler", "drafter",
                 "guided_decoder", "spec_resource_manager", "model_extra", "executor_extra")
"""TensorRT-LLM's runtime-memory tags (``ExecutorMemoryType``); this engine releases ``SLEEP_TAGS`` of them."""
RELEASE_ALL_BYTES = 1 << 62   # a yield request no engine can meet: everything that can go back goes
STILL_S = 1.0                # a yield or reclaim is done when the yielded bytes held still this long
OPERATION_TIMEOUT_S = 300.0   # in-flight requests to finish, memory to move


class ControlError(ValueError):
    """A control request the engine refuses; the message says why."""


class ControlConflict(ControlError):
    """A control that contradicts the engine's state (release more while parked): 409 on the operator port."""

    http_status = 409


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
            raise ControlError('memory_yield "size" must be a size such as "512MiB", got '
                               f'{body["size"][:64]!r}') from None
    value = body["bytes"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ControlError(f'memory_yield "bytes" must be an integer >= 0, got {value!r}')
    return value


def _tags(body: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    """``{"tags": [...]}`` -> the tags in first-seen order; ``default`` when the body names none."""
    raw = (body or {}).get("tags")
    if set(body or {}) - {"tags"}:
        raise ControlError(f"unknown key(s) {sorted(set(body) - {'tags'})}; the body is {{\"tags\": [...]}}")
    if raw is None:
        return default
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise ControlError(f'"tags" must be a list of strings, got {raw!r}')
    if not raw:
        raise ControlError("Runtime memory tags must not be empty.")
    for tag in raw:
        if tag not in UPSTREAM_TAGS:
            raise ControlError(f"Invalid runtime memory tag {tag!r}. Expected one of: {', '.join(UPSTREAM_TAGS)}")
        if tag not in SLEEP_TAGS:
            raise ControlError(f"runtime memory tag {tag!r} names memory this engine does not hold apart; it releases "
                               f"{' and '.join(SLEEP_TAGS)}")
    return tuple(dict.fromkeys(raw))


def _yielded(engine: LLMEngine) -> tuple[int, int]:
    """(bytes yielded now, layers quantized now)."""
    stats = engine.stats()
    return int(stats.memory_yielded_bytes or 0), sum((stats.layers_quantized or {}).values())


def _wait(condition: Any, what: str) -> None:
    deadline = time.monotonic() + OPERATION_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {OPERATION_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _wait_until_yield_still(engine: LLMEngine) -> None:
    """Wait until the yield stops moving: the yielded bytes held still for STILL_S."""
    last, since = _yielded(engine), time.monotonic()

    def still() -> bool:
        nonlocal last, since
        now = _yielded(engine)
        if now != last:
            last, since = now, time.monotonic()
        return time.monotonic() - since >= STILL_S
    _wait(still, "the memory release")


def release_memory(engine: LLMEngine, body: Any) -> dict[str, Any]:
    """Park: close admission, let in-flight requests finish, give the tags' memory back (module docstring)."""
    tags = _tags(body, SLEEP_TAGS)
    life = engine.lifecycle
    if life.parked_tags:
        if set(tags) <= life.parked_tags:
            return {"status": "success"}
        raise ControlConflict(f"Runtime memory is already parked ({', '.join(sorted(life.parked_tags))}); resume "
                              "it first")
    if "model_weights" in tags or "kv_cache" in tags:
        engine.request_memory_yield(0)  # ValueError (ControlError for the caller) when this engine cannot yield
    life.parked_tags = frozenset(tags)
    try:
        _wait(lambda: (s := engine.stats()).num_running == 0 and s.num_waiting == 0, "the in-flight requests' end")
        if "kv_cache" in tags:
            engine.reset_prefix_cache()
        engine.request_memory_yield(RELEASE_ALL_BYTES)
        _wait_until_yield_still(engine)
    except BaseException:
        engine.request_memory_yield(None)
        life.parked_tags = frozenset()
        raise
    return {"status": "success"}


def resume_memory(engine: LLMEngine, body: Any) -> dict[str, Any]:
    """Take the parked tags' memory back (every layer at full precision again), then admit."""
    life = engine.lifecycle
    tags = _tags(body, tuple(sorted(life.parked_tags)))
    left = life.parked_tags - set(tags)
    if tags and not left and life.parked_tags:
        engine.request_memory_yield(None)
        _wait(lambda: _yielded(engine) == (0, 0), "the memory's return to full precision")
    life.parked_tags = frozenset(left)
    return {"status": "success"}


def remeasure_costs(engine: LLMEngine) -> dict[str, Any]:
    """The step-cost table and kernel crossovers measured now, between iterations (serve/morph/cost_check.py); used
    and cached when quiet."""
    from serve.morph.cost_check import CostCheck  # noqa: PLC0415 - the manager's type, to find it

    check = engine.resource_manager(CostCheck)
    if check is None:
        raise ControlError(f"this engine weighs no step-cost table (morph mode {engine.config.morph_mode!r}; the "
                           "cost-aware modes default and performance do); python -m builder.step_costs --force "
                           "re-measures the engine directory's")
    return engine.between_steps(lambda: check.remeasure("asked by the operator"))


def memory_status(engine: LLMEngine) -> dict[str, Any]:
    parked = sorted(engine.lifecycle.parked_tags)
    return {"state": "parked" if parked else "running", "parked_tags": parked}


def run_control(engine: LLMEngine, name: str, body: Any) -> dict[str, Any]:
    """Carry out control ``name`` on ``engine`` (from any thread); ControlError when it cannot."""
    if name not in CONTROLS:
        raise ControlError(f"unknown control {name!r}; controls: {', '.join(CONTROLS)}")
    if body is not None and not isinstance(body, dict):
        raise ControlError(f"the body of {name} must be a JSON object, got {body!r}")
    if name in MEMORY_CONTROLS:
        try:
            if name == "memory_status":
                return memory_status(engine)
            return (release_memory if name == "release_memory" else resume_memory)(engine, body)
        except ControlError:
            raise
        except ValueError as exc:  # this engine cannot yield (mode off, a static mode, an arena that cannot release)
            raise ControlError(str(exc)) from None
    if name in ("memory_yield", "memory_reclaim"):
        nbytes = yield_request_bytes(body) if name == "memory_yield" else None
        try:
            return {"status": "ok", "memory_yield": engine.request_memory_yield(nbytes)}
        except ValueError as exc:  # this engine cannot yield (a static mode, an arena that cannot release)
            raise ControlError(str(exc)) from None
    if name == "remeasure_costs":
        return {"status": "ok", "remeasured": remeasure_costs(engine)}
    if name in ("drain", "resume"):
        engine.drain(name == "drain")
    stats = engine.stats()
    return {"status": "ok", "draining": engine.lifecycle.draining, "num_running": stats.num_running,
            "num_waiting": stats.num_waiting, **({"stats": stats.as_dict()} if name == "state" else {})}
