"""Whether a timing table can be trusted: the conditions it was measured under, judged against stated limits.

A table of step costs or kernel crossovers decides, for the lifetime of an engine directory, which precision a
layer runs at, when speculation drafts and which kernel a matmul takes. Measured while another process computed it
is wrong for every quiet run after it (2-5x seen: a build beside a busy neighbour). The measuring code records the
conditions (serve/model/step_costs.py); this rule says whether the table may be stored and used as this machine's:

- ``other_share``: other processes' CPU time over the measurement, as a share of all CPUs (serve/process/host_load.py);
- ``steal_share``: the hypervisor's share (steal time);
- ``spread``: across repeats, the median cell's (median / fastest - 1): how much the repeats disagree;
- ``reference_drift``: a fixed reference kernel timed before and after, |after / before - 1|: the machine changed
  speed while it measured.

Within the limits a table is trusted; its stated band (``BAND``) is how far it may be from a quiet measurement.
Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass

BAND = 0.25
"""A trusted table is within this fraction of a quiet measurement of the same machine (each cell)."""


@dataclass(frozen=True)
class MeasurementLimits:
    max_other_share: float = 0.10
    max_steal_share: float = 0.05
    max_spread: float = 0.25
    max_reference_drift: float = 0.15


@dataclass(frozen=True)
class Conditions:
    other_share: float
    steal_share: float
    spread: float
    reference_drift: float
    load_known: bool = True

    def as_dict(self) -> dict[str, float | bool]:
        return {"other_share": round(self.other_share, 4), "steal_share": round(self.steal_share, 4),
                "spread": round(self.spread, 4), "reference_drift": round(self.reference_drift, 4),
                "load_known": self.load_known}


@dataclass(frozen=True)
class Verdict:
    trusted: bool
    reasons: tuple[str, ...]

    def why(self) -> str:
        return "; ".join(self.reasons) if self.reasons else "quiet: every condition within its limit"


def judge(c: Conditions, limits: MeasurementLimits = MeasurementLimits()) -> Verdict:
    """Trusted when every condition is within its limit; otherwise the reasons, one per condition over it."""
    reasons = []
    if c.other_share > limits.max_other_share:
        reasons.append(f"other processes used {c.other_share:.0%} of the CPUs while it measured (limit "
                       f"{limits.max_other_share:.0%})")
    if c.steal_share > limits.max_steal_share:
        reasons.append(f"the hypervisor took {c.steal_share:.0%} of the CPU time (steal; limit "
                       f"{limits.max_steal_share:.0%})")
    if c.spread > limits.max_spread:
        reasons.append(f"repeats disagree by {c.spread:.0%} (median cell, median vs fastest; limit "
                       f"{limits.max_spread:.0%})")
    if c.reference_drift > limits.max_reference_drift:
        reasons.append(f"a reference kernel ran {c.reference_drift:.0%} faster or slower after than before (limit "
                       f"{limits.max_reference_drift:.0%})")
    return Verdict(not reasons, tuple(reasons))
