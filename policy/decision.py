"""What the controller tells the engine to do at one iteration boundary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Action = Literal["quantize", "restore", "none"]


@dataclass(frozen=True)
class MorphDecision:
    """One decision.

    * ``quantize``: move ``layers`` (in the given order) to ``precision``; a
      layer may already be quantized at a lower rung of the ladder (int8 -> int4).
    * ``restore``: undo the most recent transition of ``layers``: back to
      ``precision`` (the milder rung of the ladder, e.g. int4 -> int8) or to full
      precision when ``precision`` is None; the transition's KV chunk leaves the pool.
    * ``none``: do nothing; ``reason`` says why.
    """

    action: Action
    layers: tuple[int, ...]
    precision: str | None
    reason: str

    def __post_init__(self) -> None:
        if self.action == "quantize":
            if not self.layers or not self.precision:
                raise ValueError("a quantize decision needs layers and a precision")
        elif self.action == "restore":
            if not self.layers:
                raise ValueError("a restore decision needs layers")
        elif self.action == "none":
            if self.layers or self.precision is not None:
                raise ValueError("a none decision carries no layers or precision")
        else:
            raise ValueError(f"unknown action {self.action!r}")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers repeated: {self.layers}")

    @classmethod
    def nothing(cls, reason: str) -> MorphDecision:
        return cls("none", (), None, reason)
