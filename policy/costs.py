"""Measured step costs per precision, as data: what a quantized layer costs on the machine the engine runs on.

The numbers come from ``serve/model/step_costs.py`` (measured at build time or at engine start, cached per
machine); the controller only reads them. Nothing here assumes that a quantized kernel is slower or faster
than full precision: on a GPU a W4A16 GEMM is often faster at large batches, on an AVX2 CPU it may be
slower at every batch, and a better kernel tomorrow changes the sign. Only the measurement says.

``layer_s[p][i]`` is the time one decoder layer's linear projections take at precision ``p`` for a step of
``token_counts[i]`` tokens (decode batch sizes and prefill chunk sizes alike: a linear op sees rows);
``rest_s[i]`` is the time of the rest of the step that no morph changes (the LM head), when measured.
Between measured token counts the cost is interpolated linearly; beyond the last one it is extrapolated
along the last segment (GEMM time grows about linearly with rows there).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .precisions import FULL


@dataclass(frozen=True)
class StepCosts:
    device: str
    token_counts: tuple[int, ...]
    layer_s: Mapping[str, tuple[float, ...]]
    rest_s: tuple[float, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)
    """Where and how it was measured (machine key, repeats, date); labels only."""

    def __post_init__(self) -> None:
        counts = self.token_counts
        if not counts or list(counts) != sorted(set(counts)) or counts[0] < 1:
            raise ValueError(f"token_counts must be increasing positive integers, got {counts}")
        if FULL not in self.layer_s:
            raise ValueError(f"step costs need the full-precision row, got {sorted(self.layer_s)}")
        for p, row in {**self.layer_s, **({"rest": self.rest_s} if self.rest_s else {})}.items():
            if len(row) != len(counts) or any(not v > 0 for v in row):
                raise ValueError(f"{p}: need {len(counts)} positive times, got {row}")

    @property
    def precisions(self) -> tuple[str, ...]:
        return tuple(self.layer_s)

    def _interp(self, row: tuple[float, ...], tokens: float) -> float:
        counts = self.token_counts
        if len(counts) == 1:
            return row[0] * max(tokens, 1) / counts[0]
        x = max(float(tokens), float(counts[0]))
        i = min(max(bisect.bisect_right(counts, x) - 1, 0), len(counts) - 2)
        x0, x1, y0, y1 = counts[i], counts[i + 1], row[i], row[i + 1]
        return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-12)

    def layer_cost_s(self, precision: str, tokens: float) -> float:
        """One layer's linears at ``precision`` for a step of ``tokens`` tokens."""
        if precision not in self.layer_s:
            raise KeyError(f"no measured cost for {precision!r} (have {sorted(self.layer_s)})")
        return self._interp(self.layer_s[precision], tokens)

    def rest_cost_s(self, tokens: float) -> float:
        """The rest of a step (embedding, final norm, LM head) for ``tokens`` tokens; 0 when not measured."""
        return self._interp(self.rest_s, tokens) if self.rest_s else 0.0

    def slowdown_s(self, precision: str, tokens: float, from_precision: str = FULL) -> float:
        """Seconds one layer moving ``from_precision`` -> ``precision`` adds to a step (negative: it saves)."""
        return self.layer_cost_s(precision, tokens) - self.layer_cost_s(from_precision, tokens)

    def ratio(self, precision: str, tokens: float) -> float:
        """Step time of one layer at ``precision`` over full precision's (< 1: the quantized kernel is faster)."""
        return self.layer_cost_s(precision, tokens) / self.layer_cost_s(FULL, tokens)

    def step_s(self, tokens: float, num_layers: int, quantized: Mapping[int, str]) -> float:
        """Estimated step time: every layer at full precision, plus what the quantized ones add, plus the rest."""
        full = self.layer_cost_s(FULL, tokens)
        step = num_layers * full + sum(self.layer_cost_s(p, tokens) - full for p in quantized.values())
        return step + (self._interp(self.rest_s, tokens) if self.rest_s else 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "token_counts": list(self.token_counts),
                "layer_s": {p: list(v) for p, v in self.layer_s.items()}, "rest_s": list(self.rest_s),
                "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepCosts:
        return cls(device=str(d["device"]), token_counts=tuple(int(x) for x in d["token_counts"]),
                   layer_s={p: tuple(float(x) for x in v) for p, v in d["layer_s"].items()},
                   rest_s=tuple(float(x) for x in d.get("rest_s", ())), meta=dict(d.get("meta", {})))

    def table(self) -> str:
        """Markdown: per precision, ms per layer at each token count and the ratio to full precision."""
        head = " | ".join(f"{n} tok" for n in self.token_counts)
        lines = [f"step cost per decoder layer on {self.device} (ms; x = ratio to full precision)",
                 f"| precision | {head} |", "|---|" + "---:|" * len(self.token_counts)]
        for p, row in self.layer_s.items():
            cells = " | ".join(f"{v * 1e3:.3f} ({self.ratio(p, n):.2f}x)" for v, n in zip(row, self.token_counts))
            lines.append(f"| {p} | {cells} |")
        if self.rest_s:
            lines.append("| rest (LM head) | " + " | ".join(f"{v * 1e3:.3f}" for v in self.rest_s) + " |")
        return "\n".join(lines)
