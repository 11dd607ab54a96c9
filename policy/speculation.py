"""Self-speculative decoding's controller: per iteration, whether to draft, how many tokens (k) and at which rung.

Pure and deterministic (no clock, no threads, no I/O): telemetry in, one ``SpeculationDecision`` out, every
decision with its reason. The state it keeps is its estimates (acceptance rate per rung, how far the measured
step times sit from the cost model) and its hysteresis (KV pressure seen, iterations since the last draft).

The cost model reads the measured step costs (``StepCosts``: one decoder layer per precision at 1/8/32/128/512
tokens, and the rest of the step, the LM head, at the same counts; interpolated between them):

* a plain decode step of B sequences: ``sum_i layer(p_i, B) + rest(B)`` (``p_i``: layer i's precision now);
* one draft step: ``sum_i layer(d_i, B) + rest(B) * layer(r, B) / layer(full, B)``, where ``d_i`` is the rung
  below ``p_i`` (the chosen rung ``r`` for a full-precision layer) and the draft's LM head is quantized to ``r``:
  its cost is the measured head's scaled by the rung's measured ratio on a decoder layer (the head is one more
  linear; no separate head measurement exists);
* verification: one plain step of ``B * (k + 1)`` tokens;
* tokens per speculative step: ``B * E`` with ``E = (1 - a^(k+1)) / (1 - a)``, ``a`` the acceptance rate of a
  draft token at that rung.

The predictions are multiplied by corrections the engine feeds back (``observe``: predicted and measured seconds of
each kind of step, averaged): a machine factor from plain steps that scales every prediction, and a factor per kind
(draft, verify) relative to it, so the model follows the machine it runs on (and a kernel the measurement did not
see, such as verification on the plain step's kernels) without a load change tilting the gain. The predicted gain is plain seconds per token over speculative seconds per token.

Rules:

* ``off`` never drafts; requests that opt out, guided and log-prob requests and prefill chunks never draft
  (the engine leaves them out of ``batch_size`` and passes the other tokens in ``other_tokens``): a batch with
  other work runs plain (the draft would hold that work back).
* KV pressure: at ``kv_usage >= kv_high`` or with requests waiting for blocks, no draft (a draft's slots cost
  blocks); on again once ``kv_usage < kv_calm`` and nothing waits. ``k`` is also capped so the draft's extra
  blocks fit in the free ones.
* ``always``: draft ``always_k`` tokens at the first rung whenever the two rules above allow.
* ``auto``: the (rung, k) with the best predicted gain; on when that gain reaches ``on_gain``, and while on, off
  only below ``off_gain`` (hysteresis). Off for acceptance alone (the gain would pass at acceptance 1), a probe
  drafts once every ``probe_every`` iterations so the estimate can recover. A rung whose acceptance, or a step kind
  (draft, verify) whose cost, was never measured is probed at once: the first measurement replaces the prior
  (``prior_acceptance``, a correction of 1.0), later ones move the running estimate, so the decision rests on this
  machine and this text within a few iterations instead of on the priors for ``probe_every`` of them. No draft
  before one plain decode step was measured: the draft and verify factors are measured relative to the machine
  factor, which a plain step sets.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .costs import StepCosts
from .precisions import FULL

SPECULATION_MODES: tuple[str, ...] = ("off", "auto", "always")
RUNG_ORDER: tuple[str, ...] = (FULL, "int8", "int4")
"""The draft ladder, mildest first: a layer drafts one rung below the one it serves at (int4 stays int4)."""


def rung_below(precision: str, rung: str) -> str:
    """The precision layer drafts at: ``rung`` when that is below ``precision``, else the rung below
    ``precision`` (the last rung stays)."""
    if precision not in RUNG_ORDER:
        return precision  # a precision outside the ladder (fp8) drafts as it serves
    here, chosen = RUNG_ORDER.index(precision), RUNG_ORDER.index(rung)
    return RUNG_ORDER[max(chosen, min(here + 1, len(RUNG_ORDER) - 1))]


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verification yields on average: accepted drafts plus the target's own token."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class SpeculationConfig:
    mode: str = "auto"
    rungs: tuple[str, ...] = ("int8", "int4")  # the draft rungs the engine holds, tried in this order
    max_k: int = 4
    always_k: int = 3
    on_gain: float = 1.05     # auto: predicted speed-up needed to start drafting
    off_gain: float = 1.0     # auto: while drafting, stop below this
    kv_high: float = 0.90     # no draft at or above this KV usage
    kv_calm: float = 0.80     # ... until usage is below this again
    prior_acceptance: float = 0.8  # a rung's acceptance before any draft was verified (replaced as drafts are)
    acceptance_weight: float = 0.05  # weight of one verification in the running acceptance (per draft token)
    correction_window: int = 9       # a cost correction is the median of this many latest measured ratios
    probe_every: int = 64

    def __post_init__(self) -> None:
        if self.mode not in SPECULATION_MODES:
            raise ValueError(f"unknown speculation mode {self.mode!r}; valid: {list(SPECULATION_MODES)}")
        if not self.rungs or any(r not in RUNG_ORDER[1:] for r in self.rungs):
            raise ValueError(f"draft rungs must be among {RUNG_ORDER[1:]}, got {self.rungs}")
        if not 1 <= self.always_k <= self.max_k:
            raise ValueError(f"need 1 <= always_k <= max_k, got {self.always_k}, {self.max_k}")
        if not 0.0 < self.kv_calm <= self.kv_high <= 1.0:
            raise ValueError(f"need 0 < kv_calm <= kv_high <= 1, got {self.kv_calm}, {self.kv_high}")
        if self.correction_window < 1:
            raise ValueError(f"correction_window must be >= 1, got {self.correction_window}")
        if self.off_gain > self.on_gain:
            raise ValueError(f"off_gain {self.off_gain} above on_gain {self.on_gain} leaves no hysteresis")


@dataclass(frozen=True)
class SpeculationTelemetry:
    """One iteration's signals, as the engine sees them after scheduling."""

    now_s: float
    batch_size: int                  # decoding sequences that may draft this iteration
    other_tokens: int                # tokens of the batch's other chunks (prefill, opted-out rows)
    kv_usage: float
    kv_blocks_free: int
    num_waiting: int
    draft_blocks: tuple[int, ...]    # extra KV blocks drafting k = 1, 2, ... tokens would take (all sequences)
    layer_precisions: tuple[str, ...]  # each decoder layer's precision now
    token_budget: int                # the scheduler's tokens per batch


@dataclass(frozen=True)
class SpeculationDecision:
    speculate: bool
    k: int
    rung: str | None
    reason: str
    predicted_gain: float | None = None

    @classmethod
    def plain(cls, reason: str, gain: float | None = None) -> SpeculationDecision:
        return cls(False, 0, None, reason, gain)


@dataclass
class _Estimates:
    acceptance: dict[str, float] = field(default_factory=dict)
    correction: dict[str, float] = field(default_factory=lambda: {"plain": 1.0, "draft": 1.0, "verify": 1.0})
    measured: set[str] = field(default_factory=set)  # rungs and step kinds seen at least once (priors replaced)
    ratios: dict[str, deque] = field(default_factory=dict)  # latest measured / predicted ratios per step kind


class SpeculationController:
    def __init__(self, config: SpeculationConfig, costs: StepCosts | None) -> None:
        self.config = config
        self.costs = costs
        self.est = _Estimates({r: config.prior_acceptance for r in config.rungs})
        self.kv_blocked = False
        self.on = False
        self.since_draft = 0

    # ---- feedback ------------------------------------------------------------------------------------
    def observe_acceptance(self, rung: str, drafted: int, accepted: int) -> None:
        """A verification: ``accepted`` of ``drafted`` draft tokens agreed (each token one weighted sample)."""
        if drafted <= 0:
            return
        if rung not in self.est.measured:  # the first verification replaces the prior
            self.est.measured.add(rung)
            self.est.acceptance[rung] = accepted / drafted
            return
        w = 1.0 - (1.0 - self.config.acceptance_weight) ** drafted
        old = self.est.acceptance.get(rung, self.config.prior_acceptance)
        self.est.acceptance[rung] = old + w * (accepted / drafted - old)

    def observe(self, kind: str, predicted_s: float, measured_s: float) -> None:
        """A step of ``kind`` (plain, draft, verify) took ``measured_s`` where the uncorrected cost model said
        ``predicted_s``. A plain step moves the machine's factor (``plain``: load, a slower CPU than the measured
        one); a draft or verify step moves its kind's factor relative to it, so a load change between observations
        moves every prediction alike instead of tilting the gain. Each factor is the median of the latest
        ``correction_window`` ratios: a first call's warm-up or a step slowed by other work is one outlier among
        them, not a tenth of every later estimate."""
        if predicted_s > 0 and measured_s > 0 and kind in self.est.correction:
            base = 1.0 if kind == "plain" else self.est.correction["plain"]
            window = self.est.ratios.setdefault(kind, deque(maxlen=self.config.correction_window))
            window.append(measured_s / (predicted_s * base))
            self.est.measured.add(kind)  # the first measurement replaces the model's 1.0
            self.est.correction[kind] = statistics.median(window)

    def acceptance(self, rung: str) -> float:
        return self.est.acceptance.get(rung, self.config.prior_acceptance)

    # ---- the cost model --------------------------------------------------------------------------------
    def plain_s(self, precisions: Sequence[str], tokens: int, corrected: bool = True) -> float:
        c = self.costs
        assert c is not None
        t = sum(c.layer_cost_s(p, tokens) for p in precisions) + c.rest_cost_s(tokens)
        return t * (self.est.correction["plain"] if corrected else 1.0)

    def draft_s(self, precisions: Sequence[str], rung: str, tokens: int, corrected: bool = True) -> float:
        c = self.costs
        assert c is not None
        layers = sum(c.layer_cost_s(rung_below(p, rung), tokens) for p in precisions)
        head = c.rest_cost_s(tokens) * c.ratio(rung, tokens)
        return (layers + head) * (self._factor("draft") if corrected else 1.0)

    def verify_s(self, precisions: Sequence[str], tokens: int, corrected: bool = True) -> float:
        return self.plain_s(precisions, tokens, corrected=False) * (self._factor("verify") if corrected else 1.0)

    def _factor(self, kind: str) -> float:
        return self.est.correction["plain"] * self.est.correction[kind]

    def gain(self, t: SpeculationTelemetry, rung: str, k: int, acceptance: float | None = None) -> float:
        """Predicted plain seconds per token over speculative seconds per token."""
        b, ps = t.batch_size, t.layer_precisions
        a = self.acceptance(rung) if acceptance is None else acceptance
        plain = self.plain_s(ps, b) / b
        spec = (k * self.draft_s(ps, rung, b) + self.verify_s(ps, b * (k + 1))) / (b * expected_tokens(a, k))
        return plain / spec

    # ---- the decision ----------------------------------------------------------------------------------
    def decide(self, t: SpeculationTelemetry) -> SpeculationDecision:
        d = self._decide(t)
        self.on = d.speculate
        self.since_draft = 0 if d.speculate else self.since_draft + 1
        return d

    def _decide(self, t: SpeculationTelemetry) -> SpeculationDecision:
        cfg = self.config
        sig = (f"[batch {t.batch_size}, other tokens {t.other_tokens}, kv {t.kv_usage:.1%} "
               f"({t.kv_blocks_free} free), waiting {t.num_waiting}]")
        if cfg.mode == "off":
            return SpeculationDecision.plain(f"speculation off {sig}")
        if t.batch_size <= 0:
            return SpeculationDecision.plain(f"no decoding sequence may draft {sig}")
        if t.other_tokens > 0:
            return SpeculationDecision.plain(f"other chunks in the batch run plain {sig}")
        if t.kv_usage >= cfg.kv_high or t.num_waiting > 0:
            self.kv_blocked = True
            return SpeculationDecision.plain(f"KV pressure: drafts would take blocks {sig}")
        if self.kv_blocked and t.kv_usage >= cfg.kv_calm:
            return SpeculationDecision.plain(f"KV not calm yet (below {cfg.kv_calm:.0%} needed) {sig}")
        self.kv_blocked = False
        fits = [k for k in range(1, cfg.max_k + 1) if t.batch_size * (k + 1) <= t.token_budget
                and k <= len(t.draft_blocks) and t.draft_blocks[k - 1] <= t.kv_blocks_free]
        if not fits:
            return SpeculationDecision.plain(f"no draft length fits the free blocks and token budget {sig}")
        if cfg.mode == "always":
            k = max(k for k in fits if k <= cfg.always_k)
            return SpeculationDecision(True, k, cfg.rungs[0], f"speculation always: k {k} at {cfg.rungs[0]} {sig}")
        if self.costs is None or not self.costs.rest_s:
            return SpeculationDecision.plain(f"no measured step costs (with the LM head's) to decide on {sig}")
        usable = [r for r in cfg.rungs if r in self.costs.layer_s]
        if not usable:
            return SpeculationDecision.plain(f"no measured cost for the draft rungs {list(cfg.rungs)} {sig}")
        if "plain" not in self.est.measured:  # draft and verify factors are relative to it: measure it first
            return SpeculationDecision.plain(f"no plain decode step measured yet (the machine factor) {sig}")
        best = max(((self.gain(t, r, k), r, k) for r in usable for k in fits), key=lambda x: x[0])
        gain, rung, k = best
        need = cfg.off_gain if self.on else cfg.on_gain
        what = (f"k {k} at {rung}: predicted x{gain:.2f} (acceptance {self.acceptance(rung):.2f}, corrections "
                + ", ".join(f"{n} {v:.2f}" for n, v in self.est.correction.items()) + ")")
        if gain >= need:
            return SpeculationDecision(True, k, rung, f"{what} >= x{need:.2f} {sig}", gain)
        ideal = self.gain(t, rung, k, acceptance=1.0)
        unmeasured = [n for n in (rung, "draft", "verify") if n not in self.est.measured]
        if ideal >= cfg.on_gain and (unmeasured or self.since_draft + 1 >= cfg.probe_every):
            why = f"never measured: {', '.join(unmeasured)}" if unmeasured else f"x{ideal:.2f} at full acceptance"
            return SpeculationDecision(True, k, rung, f"probe: {what}, {why} {sig}", gain)
        return SpeculationDecision.plain(f"{what} < x{need:.2f} {sig}", gain)


def acceptance_rates(controller: SpeculationController) -> Mapping[str, float]:
    """The running acceptance estimate per rung (for stats)."""
    return dict(controller.est.acceptance)
