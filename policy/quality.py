"""The quality meter's rules: when to sample and how many positions, what a sample says, and the quality floor.

Pure (stdlib only, no clock: times come in as arguments). The meter (serve/engine/quality_meter.py) executes them;
the controller (policy/controller.py) reads a :class:`QualityReading` in its telemetry and applies :class:`FloorRule`.

A sample is one position of one running sequence: the next-token distribution the served configuration produced
there (``p``: quantized layers and/or 8-bit KV) against the full-precision model's on the same context (``q``). It
yields two numbers:

* top-1 agreement: ``argmax p == argmax q`` (1 or 0);
* total variation distance ``TV(p, q) = 1/2 * sum_v |p(v) - q(v)|``, in [0, 1]: the largest difference in the
  probability the two give any set of tokens (a sampled, not greedy, request's exposure).

The agreement over the last ``window`` samples is a binomial proportion; its bound is Wilson's score interval at
the stated two-sided ``confidence`` (:func:`wilson_interval`), which stays inside [0, 1] and is honest with few
samples or an agreement near 1, where the normal approximation is not.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol

DEFAULT_WINDOW = 256
"""Samples the reading is computed over (the newest ones): long enough for a bound a few points wide, short enough
to follow the configuration as the engine morphs."""


def wilson_interval(agreed: int, samples: int, confidence: float) -> tuple[float, float]:
    """Wilson's score interval for a proportion ``agreed / samples`` at two-sided ``confidence`` (e.g. 0.95);
    (0, 1) without samples."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if samples < 0 or not 0 <= agreed <= samples:
        raise ValueError(f"need 0 <= agreed <= samples, got {agreed}/{samples}")
    if samples == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0)
    p, n, z2 = agreed / samples, samples, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class QualityReading:
    """The meter's estimate over its window: ``agreed`` of ``samples`` positions had the full-precision top-1
    token, [``lower``, ``upper``] the Wilson interval at ``confidence``, ``divergence`` the mean total variation."""

    samples: int
    agreed: int
    lower: float
    upper: float
    divergence: float
    confidence: float

    @property
    def agreement(self) -> float:
        return self.agreed / self.samples if self.samples else 1.0

    def describe(self) -> str:
        return (f"agreement {self.agreement:.3f} (lower {self.lower:.3f} at {self.confidence:.0%}, "
                f"{self.samples} samples), tv {self.divergence:.4f}")


class QualitySource(Protocol):
    """What the controller's floor reads the meter through (the morph runtime gets it in its constructor)."""

    def reading(self) -> QualityReading | None: ...


class QualityWindow:
    """The newest ``window`` samples and the running totals of all of them."""

    def __init__(self, window: int = DEFAULT_WINDOW, confidence: float = 0.95) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        wilson_interval(0, 0, confidence)  # validates the confidence
        self.confidence = confidence
        self._recent: deque[tuple[bool, float]] = deque(maxlen=window)
        self.samples_total = self.agreed_total = 0
        self.divergence_total = 0.0

    def add(self, agreed: bool, divergence: float) -> None:
        if not 0.0 <= divergence <= 1.0 + 1e-6:
            raise ValueError(f"total variation must be in [0, 1], got {divergence}")
        self._recent.append((agreed, divergence))
        self.samples_total += 1
        self.agreed_total += int(agreed)
        self.divergence_total += divergence

    def reading(self) -> QualityReading | None:
        """The window's estimate; None before any sample."""
        n = len(self._recent)
        if n == 0:
            return None
        agreed = sum(1 for a, _ in self._recent if a)
        lower, upper = wilson_interval(agreed, n, self.confidence)
        return QualityReading(n, agreed, lower, upper, sum(d for _, d in self._recent) / n, self.confidence)


class SamplingRule:
    """When to sample and how many positions, within ``fraction`` of the measured step time.

    A credit in seconds: each step served while something is quantized earns ``fraction * step_s``; a sample is
    taken when the credit is not negative and costs what it measured (the debt is repaid by later steps). Over a
    run the meter spends at most ``fraction`` of the step time plus one sample. Further positions in the same step
    are taken only while their estimated cost (measured seconds per context token, times the context) fits the
    credit left, at most ``max_per_step``. A step with nothing quantized earns nothing and samples nothing, and a
    positive credit is not banked across it (no burst when quantization returns).

    With ``defer_while_waiting`` a step that leaves requests waiting takes no sample (its credit keeps, up to the
    bank): a sample's forward runs inside the step, so in a queue it would delay every waiting request by its whole
    length, while in a step with nobody waiting it only lengthens that one step for the running ones. A quality
    floor needs readings while the controller quantizes under pressure, so the engine turns deferral off when one
    is set."""

    def __init__(self, fraction: float, max_per_step: int = 2, seed: int = 0,
                 defer_while_waiting: bool = False) -> None:
        if not 0.0 <= fraction < float("inf"):
            raise ValueError(f"the meter's cost fraction must be a finite number >= 0, got {fraction}")
        if max_per_step < 1:
            raise ValueError(f"max_per_step must be >= 1, got {max_per_step}")
        self.fraction, self.max_per_step, self.defer_while_waiting = fraction, max_per_step, defer_while_waiting
        self.credit_s = 0.0
        self.seconds_per_token: float | None = None  # measured reference cost per context token (EWMA)
        self.spent_s = self.earned_s = 0.0
        self.largest_s = 0.0  # the costliest sample so far: the credit banks at most max_per_step of them
        self._rng = random.Random(seed)

    def step(self, step_s: float, active: bool) -> None:
        """One served step of ``step_s`` seconds; ``active``: something was quantized while it ran."""
        if not active or self.fraction == 0.0:
            self.credit_s = min(self.credit_s, 0.0)
            return
        earned = self.fraction * max(step_s, 0.0)
        self.earned_s += earned
        self.credit_s += earned
        if self.largest_s > 0.0:  # no burst after a long run of steps without candidates
            self.credit_s = min(self.credit_s, self.max_per_step * self.largest_s)

    def choose(self, contexts: Sequence[int], active: bool, waiting: int = 0,
               room_s: float = float("inf")) -> list[int]:
        """Indices into ``contexts`` (the candidates' context lengths in tokens) to sample now, in random order;
        ``waiting``: requests left waiting by this step's schedule; ``room_s``: how much longer this step may last
        before a running request's next token misses its TBT target (a sample whose estimated cost exceeds it is
        not taken: the meter never spends a request's TBT)."""
        if not active or self.fraction == 0.0 or not contexts or self.credit_s < 0.0:
            return []
        if waiting > 0 and self.defer_while_waiting:
            return []
        order = [i for i in range(len(contexts)) if self.estimate(contexts[i]) <= room_s]
        if not order:
            return []
        self._rng.shuffle(order)
        chosen, planned = [order[0]], self.estimate(contexts[order[0]])
        for i in order[1:self.max_per_step]:
            more = self.estimate(contexts[i])
            if self.seconds_per_token is None or planned + more > min(self.credit_s, room_s):
                break
            chosen.append(i)
            planned += more
        return chosen

    def estimate(self, context: int) -> float:
        return (self.seconds_per_token or 0.0) * context

    def spent(self, cost_s: float, tokens: int) -> None:
        """A sample over ``tokens`` context tokens took ``cost_s`` seconds."""
        cost_s = max(cost_s, 0.0)
        self.credit_s -= cost_s
        self.spent_s += cost_s
        self.largest_s = max(self.largest_s, cost_s)
        if tokens > 0:
            per = cost_s / tokens
            self.seconds_per_token = per if self.seconds_per_token is None else 0.8 * self.seconds_per_token + 0.2 * per


@dataclass(frozen=True)
class FloorVerdict:
    """What the quality floor allows now: ``hold`` blocks quantizing steps, ``restore`` asks to undo the newest
    transition first; ``reason`` says why in words (empty when the floor is off)."""

    hold: bool
    restore: bool
    reason: str


MAX_TIER = 9
"""Tiers 0..9 (0 = strict), as requests name them (serve/engine/slo.py ``MAX_PRIORITY``)."""


def tier_floors(value: object) -> tuple[tuple[int, float], ...]:
    """A ``quality_floor_by_tier`` setting (a JSON object such as ``{"0": 0.97, "1": 0.9}``, or (tier, floor) pairs)
    -> (tier, floor) pairs sorted by tier; ValueError names what is wrong."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, (list, tuple)):
        raise ValueError(f"quality_floor_by_tier must be an object of tier -> floor, got {value!r}")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"quality_floor_by_tier: {pair!r} is not a tier and its floor")
        tier, floor = pair
        try:
            t = int(tier) if isinstance(tier, (int, str)) and not isinstance(tier, bool) else None
        except ValueError:
            t = None
        if t is None or not 0 <= t <= MAX_TIER or str(t) != str(tier).strip():
            raise ValueError(f"quality_floor_by_tier: tier {tier!r} is not an integer in [0, {MAX_TIER}]")
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 < floor <= 1.0:
            raise ValueError(f"quality_floor_by_tier: tier {t}'s floor must be in (0, 1], got {floor!r}")
        if t in out:
            raise ValueError(f"quality_floor_by_tier names tier {t} twice")
        out[t] = float(floor)
    return tuple(sorted(out.items()))


def floor_in_force(floor: float | None, by_tier: Sequence[tuple[int, float]],
                   running_tiers: Sequence[int]) -> tuple[float, str] | None:
    """The floor the served configuration must meet now, and whose it is: the strictest of the server's
    ``quality_floor`` and the floors of the tiers with a request running. Every running request is served by the
    same layers and KV blocks, so the most demanding one present decides; a tier with nothing running asks for
    nothing. None when no floor applies."""
    running = set(running_tiers)
    floors = [(f, f" of tier {t}") for t, f in by_tier if t in running]
    if floor is not None:
        floors.append((floor, ""))
    return max(floors, key=lambda fs: fs[0], default=None)


class FloorRule:
    """The quality floor (``PolicyConfig.quality_floor`` and ``quality_floor_by_tier``): while the meter's lower bound
    on top-1 agreement is under the floor in force (:func:`floor_in_force`), no further quantizing step; when it has
    stayed under for ``restore_s`` and the measured agreement itself is under the floor too (not only the bound's
    width with few samples), restore the newest transition first. No reading (nothing sampled yet) holds nothing:
    full precision meets any floor, and the first step's quality can only be measured once it is taken. The time
    under counts while the bound stays under whichever floor is in force (a stricter tier arriving starts it), and
    stops once the bound meets it or no floor applies."""

    def __init__(self, floor: float | None, restore_s: float, by_tier: Sequence[tuple[int, float]] = ()) -> None:
        if floor is not None and not 0.0 < floor <= 1.0:
            raise ValueError(f"quality_floor must be in (0, 1] or None, got {floor}")
        self.floor, self.restore_s, self.by_tier = floor, restore_s, tier_floors(by_tier)
        self._under_since: float | None = None

    def restored(self, now_s: float) -> None:
        """A restore the floor asked for was taken: the next one waits ``restore_s`` again, for samples of the
        milder state."""
        if self._under_since is not None:
            self._under_since = now_s

    def holds(self, reading: QualityReading | None, quantized: bool, tiers: Sequence[int] = ()) -> FloorVerdict:
        """Whether the floor holds quantizing now, without advancing its restore timer (a second look within one
        decision: covering a deficit before preempting); ``tiers``: those with a request running."""
        force = floor_in_force(self.floor, self.by_tier, tiers)
        if force is None or not quantized or reading is None or reading.lower >= force[0]:
            return FloorVerdict(False, False, "")
        return FloorVerdict(True, False, f"quality lower bound {reading.lower:.3f} < floor {force[0]:.3f}{force[1]}; "
                                         f"{reading.describe()}")

    def check(self, now_s: float, reading: QualityReading | None, quantized: bool,
              tiers: Sequence[int] = ()) -> FloorVerdict:
        force = floor_in_force(self.floor, self.by_tier, tiers)
        if force is None:
            self._under_since = None
            return FloorVerdict(False, False, "")
        floor, whose = force
        if not quantized or reading is None:
            self._under_since = None
            why = "nothing quantized" if not quantized else "no samples yet"
            return FloorVerdict(False, False, f"quality floor {floor:.3f}{whose}: {why}")
        if reading.lower >= floor:
            self._under_since = None
            return FloorVerdict(False, False, f"quality floor {floor:.3f}{whose} met: {reading.describe()}")
        if self._under_since is None:
            self._under_since = now_s
        under_s = now_s - self._under_since
        restore = under_s >= self.restore_s and reading.agreement < floor
        verdict = (f"restore first (under for {under_s:.2f} s >= {self.restore_s} s, agreement itself under)"
                   if restore else f"no further quantizing (under for {under_s:.2f} s)")
        return FloorVerdict(True, restore, f"quality lower bound {reading.lower:.3f} < floor {floor:.3f}{whose}: "
                                           f"{verdict}; {reading.describe()}")
