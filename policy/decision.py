"""What the controller tells the engine to do at one iteration boundary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Action = Literal["quantize", "restore", "yield", "reclaim", "none"]


@dataclass(frozen=True)
class MorphDecision:
    """One decision.

    * ``quantize``: move ``layers`` (in the given order) to ``precision``; a
      layer may already be quantized at a lower step of the ladder (int8 -> int4).
    * ``restore``: undo the most recent transition of ``layers``: back to
      ``precision`` (the milder step of the ladder, e.g. int4 -> int8) or to full
      precision when ``precision`` is None; the transition's KV extent leaves the pool.
    * ``yield``: give memory back to the device (or host). With a ``precision``: move ``layers`` to it as a
      quantize does, but release the freed bytes instead of adding them to the KV pool. Without one:
      release the newest transition's KV extent (``layers`` names its layer; the extent is entirely free).
    * ``reclaim``: take the newest yielded bytes back and undo that transition (as ``restore`` does).
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
        elif self.action in ("restore", "yield", "reclaim"):
            if not self.layers:
                raise ValueError(f"a {self.action} decision needs layers")
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
