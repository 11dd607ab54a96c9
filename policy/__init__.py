"""MorphServe controller: pure decisions from engine telemetry (no torch, no threads, no clock)."""

from .controller import MorphController
from .decision import MorphDecision
from .modes import KNOWN_PRECISIONS, MODES, PolicyConfig
from .telemetry import Telemetry

__all__ = ["KNOWN_PRECISIONS", "MODES", "MorphController", "MorphDecision", "PolicyConfig", "Telemetry"]
