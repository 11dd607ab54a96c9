"""When an engine's step-cost table no longer describes its machine: the rule that corrects it at run time.

The table (``StepCosts``) decides which precision a layer runs at, when speculation drafts and, through the kernel
crossovers measured with it, which kernel a matmul takes. Measured on a busy host it can be 2-5x off for the life of
the engine directory. So a serving engine times a small probe now and then (the full-precision layer's linears at
a few token counts, a few milliseconds) and compares it with the table:

- a probe measured while the host was busy says nothing (policy/measurement.py judges it) and is dropped;
- a quiet probe whose every token count is within ``band`` of the table confirms it;
- ``confirm`` quiet probes in a row that are off by more than ``band`` in the same direction mean the table is wrong:
  the engine measures the whole table again (quietly, else it keeps the old one) and uses that.

Pure: stdlib only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DriftDecision:
    correct: bool
    reason: str


@dataclass
class DriftRule:
    band: float = 0.25          # a table within this fraction of the probe is right
    confirm: int = 2            # quiet probes off the same way before the table is measured again
    _off: list[int] = field(default_factory=list)  # the sign (+1 slower, -1 faster) of recent off probes

    def observe(self, ratios: dict[int, float], quiet: bool, why_not_quiet: str = "") -> DriftDecision:
        """``ratios``: probe time / table time by token count. A decision with the reason, either way."""
        if not quiet:
            return DriftDecision(False, f"probe dropped: {why_not_quiet or 'the host was busy'}")
        limit = math.log1p(self.band)
        logs = {n: math.log(r) for n, r in ratios.items() if r > 0}
        text = ", ".join(f"{n} tok x{r:.2f}" for n, r in sorted(ratios.items()))
        if not logs or all(abs(v) <= limit for v in logs.values()):
            self._off.clear()
            return DriftDecision(False, f"table confirmed within {self.band:.0%} ({text})")
        signs = {1 if v > 0 else -1 for v in logs.values() if abs(v) > limit}
        if len(signs) != 1:
            self._off.clear()
            return DriftDecision(False, f"probe off both ways ({text}): noise, not a wrong table")
        sign = signs.pop()
        self._off = [s for s in self._off if s == sign] + [sign]
        if len(self._off) < self.confirm:
            return DriftDecision(False, f"table off by more than {self.band:.0%} ({text}); "
                                        f"{len(self._off)} of {self.confirm} quiet probes")
        self._off.clear()
        where = "slower" if sign > 0 else "faster"
        return DriftDecision(True, f"this machine runs {where} than the table by more than {self.band:.0%} in "
                                   f"{self.confirm} quiet probes in a row ({text}): measure it again")
