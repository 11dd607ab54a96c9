"""Request parameters that are not inputs of the model: what may travel with an inference request, who may set
it, and what the inference port refuses (no client can act for another or for the operator).

- ``morphserve_cancel`` (internal): the BLS models (``tensorrt_llm_bls``, ``ensemble``) pass their client's
  cancellation on to the engine model, since the Python backend of Triton 2.51 cannot cancel a BLS request. Its
  value must be an inner request id the BLS model made (:func:`new_inner_request_id`: ``bls-`` and 32 random hex
  digits, never shown to any client), and only a request with exactly that id is cancelled: an empty, malformed
  or unknown id is refused (400). Clients' own request ids (any text; "" for every request through the HTTP
  front end) are never cancel targets, so no client can cancel another's request.
- ``morphserve_memory``: yielding or reclaiming memory changes the model's precision for everyone, so it is an
  operator control, served on the operator port only (serve/triton/operator_port.py); on the inference ports
  (HTTP and gRPC) it is refused (400) with a pointer there.
- ``morphserve_arrival_s`` (internal): when the HTTP front end received the request (``time.monotonic()``, the
  machine's CLOCK_MONOTONIC, the same in every process), so that the engine's queue deadline counts from the
  client's arrival, Triton's queue and the model's admission included. The front end always sets it (a client's own
  value is overwritten); the model takes the earlier of it and its own arrival, so a gRPC client that sets it
  can only make its own deadline come sooner.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Mapping
from typing import Any

from serve.triton.input_error import InputError

CANCEL_PARAMETER = "morphserve_cancel"
MEMORY_PARAMETER = "morphserve_memory"
ARRIVAL_PARAMETER = "morphserve_arrival_s"
INTERNAL_PARAMETERS = frozenset({CANCEL_PARAMETER, ARRIVAL_PARAMETER})
"""Parameters the model reads itself; they are never taken as inputs."""

_INNER_ID = re.compile(r"bls-[0-9a-f]{32}")


def new_inner_request_id() -> str:
    """The id of a BLS model's request to the engine model: the only kind of id ``morphserve_cancel`` accepts."""
    return f"bls-{secrets.token_hex(16)}"


def _params(parameters: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if not parameters:
        return {}
    return json.loads(parameters) if isinstance(parameters, str) else dict(parameters)


def cancel_target(parameters: str | Mapping[str, Any] | None) -> str | None:
    """The inner request id a BLS model's control request asks to cancel; None for an ordinary request.
    InputError for an id no BLS model can have made."""
    value = _params(parameters).get(CANCEL_PARAMETER)
    if value is None:
        return None
    if not isinstance(value, str) or not _INNER_ID.fullmatch(value):
        raise InputError(f"{CANCEL_PARAMETER} cancels only a request the server made for a BLS model (an id it "
                         f"never shows to clients); {value!r} is not one")
    return value


def refuse_operator_controls(parameters: str | Mapping[str, Any] | None) -> None:
    """InputError for an operator control sent on the inference port."""
    if MEMORY_PARAMETER in _params(parameters):
        raise InputError(f"{MEMORY_PARAMETER}: memory yield / reclaim is an operator control and is not accepted on "
                         "the inference ports; send it to the operator port (python -m serve.triton --operator-port, "
                         "loopback only): POST /engine/control/memory_yield {\"size\": \"512MiB\"} or "
                         "/engine/control/memory_reclaim (docs/memory-yield.md)")


def front_end_arrival(parameters: str | Mapping[str, Any] | None) -> float | None:
    """The HTTP front end's arrival time (CLOCK_MONOTONIC seconds) a request carries, if any."""
    value = _params(parameters).get(ARRIVAL_PARAMETER)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{ARRIVAL_PARAMETER} is set by the HTTP front end (a number of seconds), got {value!r}")
    return float(value)
