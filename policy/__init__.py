"""MorphServe controller: pure decisions from engine telemetry (no torch, no threads, no clock)."""

from .controller import MorphController
from .costs import StepCosts
from .decision import MorphDecision
from .memory_yield import YieldRule
from .modes import MODES, PolicyConfig, resolve_kv_rung
from .precisions import ALL_PRECISIONS, FULL, PRECISION_CODE, QUANTIZED_PRECISIONS, signature
from .telemetry import Telemetry

__all__ = ["ALL_PRECISIONS", "FULL", "MODES", "PRECISION_CODE", "QUANTIZED_PRECISIONS", "MorphController",
           "MorphDecision", "PolicyConfig", "StepCosts", "Telemetry", "YieldRule", "resolve_kv_rung", "signature"]
