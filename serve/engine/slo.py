"""Per-request service targets: TTFT and TBT targets (seconds) and a tier (0 = strict/paying first).

A request may leave any of them unset; the engine fills the gaps from EngineConfig (``slo_ttft_s``,
``slo_tbt_s``, ``default_priority``) when it admits the request, so every Sequence carries concrete values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_PRIORITY = 9  # tiers 0..9; 0 is served first


def _check_seconds(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not (0.0 < value < math.inf):  # also rejects NaN
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


@dataclass(frozen=True)
class RequestSLO:
    """Targets of one request; None = the engine's default."""

    ttft_s: float | None = None
    tbt_s: float | None = None
    priority: int | None = None

    def __post_init__(self) -> None:
        _check_seconds("ttft_slo_s", self.ttft_s)
        _check_seconds("tbt_slo_s", self.tbt_s)
        p = self.priority
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= MAX_PRIORITY):
            raise ValueError(f"priority must be an integer tier in [0, {MAX_PRIORITY}] (0 = strict, served first), "
                             f"got {p!r}")

    def resolved(self, ttft_s: float, tbt_s: float, priority: int) -> RequestSLO:
        """These targets with every unset one replaced by the given default."""
        return RequestSLO(self.ttft_s if self.ttft_s is not None else ttft_s,
                          self.tbt_s if self.tbt_s is not None else tbt_s,
                          self.priority if self.priority is not None else priority)
