"""Self-speculative decoding's controller: per iteration, whether to draft, how many tokens (k) and at which precision.

Pure and deterministic (no clock, no threads, no I/O): telemetry in, one ``SpeculationDecision`` out, every
decision with its reason. The state it keeps is its estimates (acceptance rate per draft precision, how far the measured
step times sit from the cost model) and its hysteresis (KV pressure seen, iterations since the last draft).

The cost model reads the measured step costs (``StepCosts``: one decoder layer per precision at 1/8/32/128/512
tokens, and the rest of the step, the LM head, at the same counts; interpolated between them):

* a plain decode step of B sequences: ``sum_i layer(p_i, B) + rest(B)`` (``p_i``: layer i's precision now);
* one draft step: ``sum_i layer(d_i, B) + rest(B) * layer(r, B) / layer(full, B)``, where ``d_i`` is the ladder step
  below ``p_i`` (the chosen draft precision ``r`` for a full-precision layer) and the draft's LM head is quantized to
  ``r``: its cost is the measured head's scaled by the draft precision's measured ratio on a decoder layer (the head is
  one more linear; no separate head measurement exists);
* verification: one plain step of ``B * (k + 1)`` tokens;
* tokens per speculative step: ``B * E`` with ``E = (1 - a^(k+1)) / (1 - a)``, ``a`` the acceptance rate of a
  draft token at that precision.

The predictions are multiplied by corrections the engine feeds back (``observe``: predicted and measured seconds of
each kind of step): a machine factor from plain steps that scales every prediction, and a factor per kind (draft,
verify) relative to it, so the model follows the machine it runs on (and a kernel the measurement did not see) without
a load change tilting the gain; each per batch bucket (1, 2-3, 4-7, 8-15, ...: ``batch_bucket``) and each the median
of its latest measured ratios. The predicted gain is plain seconds per token over speculative seconds per token.

Rules:

* ``off`` never drafts; requests that opt out, guided and log-prob requests and prefill chunks never draft
  (the engine leaves them out of ``batch_size`` and passes the other tokens in ``other_tokens``): a batch with
  other work runs plain (the draft would hold that work back).
* KV pressure: at ``kv_usage >= kv_high`` or with requests waiting for blocks, no draft (a draft's slots cost
  blocks); on again once ``kv_usage < kv_calm`` and nothing waits. ``k`` is also capped so the draft's extra
  blocks fit in the free ones.
* ``always``: draft ``always_k`` tokens at the first draft precision whenever the two rules above allow.
* ``auto``: the (precision, k) with the best predicted gain; on when that gain reaches ``on_gain``, and while on, off
  only below ``off_gain`` (hysteresis). Off for acceptance alone (the gain would pass at acceptance 1), a probe
  drafts once every ``probe_every`` iterations so the estimate can recover. A draft precision whose acceptance, or a
  step kind (draft, verify) whose cost, was never measured is probed at once: the first measurement replaces the prior
  (``prior_acceptance``, a correction of 1.0), later ones move the running estimate, so the decision rests on this
  machine and this text within a few iterations instead of on the priors for ``probe_every`` of them. No draft before
  one plain decode step was measured: the draft and verify factors are measured relative to the machine factor, which a
  plain step sets.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from .costs import StepCosts
from .precisions import FULL

SPECULATION_MODES: tuple[str, ...] = ("off", "auto", "always")
DRAFT_LADDER: tuple[str, ...] = (FULL, "int8", "int4")
"""The draft ladder, mildest first: a layer drafts one ladder step below the one it serves at (int4 stays int4)."""


def precision_below(served: str, draft: str) -> str:
    """The precision a layer serving at ``served`` drafts at: ``draft`` (the draft precision) when that is below
    ``served``, else the ladder step below ``served`` (the last step stays)."""
    if served not in DRAFT_LADDER:
        return served  # a precision outside the ladder (fp8) drafts as it serves
    here, chosen = DRAFT_LADDER.index(served), DRAFT_LADDER.index(draft)
    return DRAFT_LADDER[max(chosen, min(here + 1, len(DRAFT_LADDER) - 1))]


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verification yields on average: accepted drafts plus the target's own token."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class SpeculationConfig:
    mode: str = "auto"
    precisions: tuple[str, ...] = ("int8", "int4")  # the draft precisions the engine holds, tried in this order
    max_k: int = 4
    always_k: int = 3
    on_gain: float = 1.05     # auto: predicted speed-up needed to start drafting
    off_gain: float = 1.0     # auto: while drafting, stop below this
    kv_high: float = 0.90     # no draft at or above this KV usage
    kv_calm: float = 0.80     # ... until usage is below this again
    prior_acceptance: float = 0.8  # a draft precision's acceptance before any draft is verified (then replaced)
    acceptance_weight: float = 0.05  # weight of one verification in the running acceptance (per draft token)
    correction_window: int = 9       # a cost correction is the median of this many latest measured ratios
    probe_every: int = 64
    probe_gain: float = 1.05  # a never-measured draft precision or batch bucket is probed once when the gain at
                              # acceptance 1 predicted with its unmeasured (1.0) factors reaches this; lower explores
                              # buckets the uncorrected model writes off (0.8 on the 2026-12-05 replay cost P95 TTFT:
                              # not default)

    def __post_init__(self) -> None:
        if self.mode not in SPECULATION_MODES:
            raise ValueError(f"unknown speculation mode {self.mode!r}; valid: {list(SPECULATION_MODES)}")
        if not self.precisions or any(r not in DRAFT_LADDER[1:] for r in self.precisions):
            raise ValueError(f"draft precisions must be among {DRAFT_LADDER[1:]}, got {self.precisions}")
        if not 1 <= self.always_k <= self.max_k:
            raise ValueError(f"need 1 <= always_k <= max_k, got {self.always_k}, {self.max_k}")
        if not 0.0 < self.kv_calm <= self.kv_high <= 1.0:
            raise ValueError(f"need 0 < kv_calm <= kv_high <= 1, got {self.kv_calm}, {self.kv_high}")
        if self.correction_window < 1:
            raise ValueError(f"correction_window must be >= 1, got {self.correction_window}")
        if self.probe_gain <= 0.0:
            raise ValueError(f"probe_gain must be > 0, got {self.probe_gain}")
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
    precision: str | None
    reason: str
    predicted_gain: float | None = None

    @classmethod
    def plain(cls, reason: str, gain: float | None = None) -> SpeculationDecision:
        return cls(False, 0, None, reason, gain)


STEP_KINDS: tuple[str, ...] = ("plain", "draft", "verify")


def batch_bucket(batch: int) -> int:
    """The batch sizes one set of cost corrections covers: 1, 2-3, 4-7, 8-15, ... (named by the smallest). The
    model's error is not one factor for every batch: at batch 1 a verify's k + 1 rows are memory-bound and nearly
    free, at batch 8 its 40 rows are compute-bound, so a factor learned at one size would mislead at the other."""
    return 1 << (max(batch, 1).bit_length() - 1)


@dataclass
class _Estimates:
    acceptance: dict[str, float] = field(default_factory=dict)
    correction: dict[tuple[str, int], float] = field(default_factory=dict)  # (step kind, batch bucket) -> factor
    measured: set = field(default_factory=set)  # precisions and (step kind, bucket)s measured (priors replaced)
    ratios: dict[tuple[str, int], deque] = field(default_factory=dict)  # latest measured / predicted ratios


class SpeculationController:
    def __init__(self, config: SpeculationConfig, costs: StepCosts | None) -> None:
        self.config = config
        self.costs = costs
        self.est = _Estimates({r: config.prior_acceptance for r in config.precisions})
        self.kv_blocked = False
        self.on = False
        self.since_draft = 0

    def use_costs(self, costs: StepCosts) -> None:
        """A corrected step-cost table (policy/cost_drift.py); the learned corrections are relative to the old one
        and start again."""
        self.costs = costs
        self.est.correction.clear()
        self.est.ratios.clear()

    # ---- feedback ------------------------------------------------------------------------------------
    def observe_acceptance(self, precision: str, drafted: int, accepted: int) -> None:
        """A verification: ``accepted`` of ``drafted`` draft tokens agreed (each token one weighted sample)."""
        if drafted <= 0:
            return
        if precision not in self.est.measured:  # the first verification replaces the prior
            self.est.measured.add(precision)
            self.est.acceptance[precision] = accepted / drafted
            return
        w = 1.0 - (1.0 - self.config.acceptance_weight) ** drafted
        old = self.est.acceptance.get(precision, self.config.prior_acceptance)
        self.est.acceptance[precision] = old + w * (accepted / drafted - old)

    def observe(self, kind: str, predicted_s: float, measured_s: float, batch: int = 1) -> None:
        """A step of ``kind`` (plain, draft, verify) over ``batch`` sequences took ``measured_s`` where the
        uncorrected cost model said ``predicted_s``. A plain step moves the machine's factor (``plain``: load, a
        slower CPU than the measured one); a draft or verify step moves its kind's factor relative to it, so a load
        change between observations moves every prediction alike instead of tilting the gain. Factors are kept per
        batch bucket (:func:`batch_bucket`), each the median of its latest ``correction_window`` ratios: a first
        call's warm-up or a step slowed by other work is one outlier among them, not a tenth of every later
        estimate."""
        if predicted_s > 0 and measured_s > 0 and kind in STEP_KINDS:
            key = (kind, batch_bucket(batch))
            base = 1.0 if kind == "plain" else self.correction("plain", batch)
            window = self.est.ratios.setdefault(key, deque(maxlen=self.config.correction_window))
            window.append(measured_s / (predicted_s * base))
            self.est.measured.add(key)  # the first measurement replaces the model's 1.0
            self.est.correction[key] = statistics.median(window)

    def correction(self, kind: str, batch: int) -> float:
        """The cost correction of ``kind`` at ``batch`` sequences (1.0 where never measured)."""
        return self.est.correction.get((kind, batch_bucket(batch)), 1.0)

    def measured(self, kind: str, batch: int) -> bool:
        return (kind, batch_bucket(batch)) in self.est.measured

    def acceptance(self, precision: str) -> float:
        return self.est.acceptance.get(precision, self.config.prior_acceptance)

    # ---- the cost model --------------------------------------------------------------------------------
    def plain_s(self, precisions: Sequence[str], tokens: int, corrected: bool = True) -> float:
        """A plain decode step of ``tokens`` sequences."""
        c = self.costs
        assert c is not None
        t = sum(c.layer_cost_s(p, tokens) for p in precisions) + c.rest_cost_s(tokens)
        return t * (self.correction("plain", tokens) if corrected else 1.0)

    def draft_s(self, precisions: Sequence[str], precision: str, tokens: int, corrected: bool = True) -> float:
        """One draft step of ``tokens`` sequences."""
        c = self.costs
        assert c is not None
        layers = sum(c.layer_cost_s(precision_below(p, precision), tokens) for p in precisions)
        head = c.rest_cost_s(tokens) * c.ratio(precision, tokens)
        return (layers + head) * (self._factor("draft", tokens) if corrected else 1.0)

    def verify_s(self, precisions: Sequence[str], tokens: int, corrected: bool = True, batch: int | None = None
                 ) -> float:
        """Verifying ``tokens`` rows (``batch`` sequences' drafts plus their last tokens; default: one each)."""
        factor = self._factor("verify", tokens if batch is None else batch) if corrected else 1.0
        return self.plain_s(precisions, tokens, corrected=False) * factor

    def _factor(self, kind: str, batch: int) -> float:
        return self.correction("plain", batch) * self.correction(kind, batch)

    def gain(self, t: SpeculationTelemetry, precision: str, k: int, acceptance: float | None = None) -> float:
        """Predicted plain seconds per token over speculative seconds per token."""
        b, ps = t.batch_size, t.layer_precisions
        a = self.acceptance(precision) if acceptance is None else acceptance
        plain = self.plain_s(ps, b) / b
        spec = (k * self.draft_s(ps, precision, b)
                + self.verify_s(ps, b * (k + 1), batch=b)) / (b * expected_tokens(a, k))
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
            return SpeculationDecision(True, k, cfg.precisions[0],
                                       f"speculation always: k {k} at {cfg.precisions[0]} {sig}")
        if self.costs is None or not self.costs.rest_s:
            return SpeculationDecision.plain(f"no measured step costs (with the LM head's) to decide on {sig}")
        usable = [r for r in cfg.precisions if r in self.costs.layer_s]
        if not usable:
            return SpeculationDecision.plain(f"no measured cost for the draft precisions {list(cfg.precisions)} {sig}")
        if not self.measured("plain", t.batch_size):  # draft and verify factors are relative to it: measure it first
            return SpeculationDecision.plain(f"no plain decode step measured yet (the machine factor) {sig}")
        best = max(((self.gain(t, r, k), r, k) for r in usable for k in fits), key=lambda x: x[0])
        gain, precision, k = best
        need = cfg.off_gain if self.on else cfg.on_gain
        what = (f"k {k} at {precision}: predicted x{gain:.2f} (acceptance {self.acceptance(precision):.2f}, "
                "corrections "
                + ", ".join(f"{n} {self.correction(n, t.batch_size):.2f}" for n in STEP_KINDS)
                + f" at batch {batch_bucket(t.batch_size)}+)")
        if gain >= need:
            return SpeculationDecision(True, k, precision, f"{what} >= x{need:.2f} {sig}", gain)
        ideal = self.gain(t, precision, k, acceptance=1.0)
        unmeasured = ([precision] if precision not in self.est.measured else []) + [
            n for n in ("draft", "verify") if not self.measured(n, t.batch_size)]
        due = self.since_draft + 1 >= cfg.probe_every
        if (unmeasured and ideal >= cfg.probe_gain) or (ideal >= cfg.on_gain and due):
            why = f"never measured: {', '.join(unmeasured)}" if unmeasured else f"x{ideal:.2f} at full acceptance"
            return SpeculationDecision(True, k, precision, f"probe: {what}, {why} {sig}", gain)
        return SpeculationDecision.plain(f"{what} < x{need:.2f} {sig}", gain)
