"""Defaults every benchmark tool shares. Engine knobs come from ``EngineConfig`` itself (one source);
only what is a benchmark's own choice lives here."""

from __future__ import annotations

from serve.config import EngineConfig

# A budget at which full precision runs out of KV on the bursty traces (weights ~513 MiB + KV + reserve).
DEVICE_MEMORY = "600MiB"
ENGINE_DEFAULTS = EngineConfig()
MODEL = ENGINE_DEFAULTS.model

