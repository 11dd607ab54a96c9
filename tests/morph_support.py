"""Reaching an engine's morph runtime in tests, through the engine's public accessor (never an attribute)."""

from __future__ import annotations

from serve.engine.engine import LLMEngine
from serve.morph.runtime import MorphRuntime


def morph(engine: LLMEngine) -> MorphRuntime:
    """The engine's morph runtime; fails the test when the engine hosts none (mode off)."""
    runtime = engine.resource_manager(MorphRuntime)
    assert runtime is not None, f"morph mode {engine.config.morph_mode!r} hosts no morph runtime"
    return runtime
