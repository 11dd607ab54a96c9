"""The engine: requests in, tokens out. ``LLMEngine`` is the public API (what Triton glue, Dynamo
workers and the tools use); the scheduler decides, the executor runs the forward, the sampler picks.

Exports are resolved lazily so ``from serve.engine import SamplingParams`` stays cheap (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve.engine.engine import LLMEngine
    from serve.engine.errors import EngineOverloaded
    from serve.engine.outputs import FinishReason, RequestOutput
    from serve.engine.sampling_params import SamplingParams
    from serve.engine.slo import RequestSLO

__all__ = ["EngineOverloaded", "FinishReason", "LLMEngine", "RequestOutput", "RequestSLO", "SamplingParams"]

_HOMES = {
    "EngineOverloaded": "serve.engine.errors",
    "LLMEngine": "serve.engine.engine",
    "FinishReason": "serve.engine.outputs",
    "RequestOutput": "serve.engine.outputs",
    "SamplingParams": "serve.engine.sampling_params",
    "RequestSLO": "serve.engine.slo",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib  # noqa: PLC0415

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'serve.engine' has no attribute {name!r}")
