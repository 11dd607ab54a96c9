"""Self-speculative decoding in a plan, modelled from a given acceptance rate (docs/planner.md, "Self-speculative
decoding"). The planner has no weights, so nothing is drafted: each iteration is charged what drafting would cost,
per token on average.

* **The decision is the engine's**: the server's controller (policy/speculation.py) on the telemetry the engine builds
  (serve/engine/spec_manager.py ``draft_telemetry``: the sequences that may draft, other tokens in the batch, KV usage,
  free blocks, waiting requests, the token budget), with the tables' StepCosts as its cost model (what the engine
  would measure on that GPU), its acceptance held at the given rate, and its corrections fed from the modelled step
  times as the engine feeds them measured ones. So it drafts at small batches and stops where verification wastes
  compute, under KV pressure and with prefill in the batch, as the engine would.
* **A drafting iteration** of B sequences, sequence i drafting ``k_i`` tokens (the decision's k, capped by what it
  may still emit), costs
  ``draft = sum over j < max k_i`` of one forward of the sequences still drafting (decode rows at context
  ``n_i + j``), every layer one ladder step below its precision now (``precision_below``) and the LM head at the draft
  precision, plus ``verify =`` one forward of ``sum (k_i + 1)`` decode rows (contexts ``n_i .. n_i + k_i``) at the
  precisions now, and yields ``sum E(a, k_i)`` tokens on average, ``E(a, k) = (1 - a^(k+1)) / (1 - a)``
  (``expected_tokens``). The engine loop here emits one token per sequence per iteration, so the iteration is charged
  ``(draft + verify) * B / sum E(a, k_i)``: every token costs what a token costs on average while drafting.
* **Not modelled**: the draft's KV blocks (the telemetry counts the free ones; none are taken), the spread of the
  accepted tokens around their mean (token gaps come out even), acceptance that drifts.

The draft precision: the int8 or int4 weight-only GEMM rows where the tables have them (A100), fp8 where they do not
(H100, H200, L40S: the 8-bit draft such a GPU runs). The controller's ladder names its 8-bit precision ``int8``; with
fp8 it is handed the fp8 rows under that name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from policy import FULL
from policy.speculation import (
    SpeculationConfig,
    SpeculationController,
    SpeculationDecision,
    expected_tokens,
    precision_below,
)
from serve.engine.scheduler import ScheduledChunk
from serve.engine.spec_manager import draft_telemetry
from serve.resource_seam import ResourceManagerBase, SchedulerView
from sim.kernel_tables import TableError
from sim.step_model import BatchShape, TableStepModel

DRAFT_PRECISIONS = ("int8", "int4", "fp8")


@dataclass(frozen=True)
class ModelledSpeculation:
    """What a plan assumes: the acceptance rate of one draft token, the longest draft, the draft's precision."""

    acceptance: float
    k: int
    precision: str

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"--speculation-acceptance must be in [0, 1], got {self.acceptance}")
        if self.k < 1:
            raise ValueError(f"--speculation-k must be >= 1, got {self.k}")
        if self.precision not in DRAFT_PRECISIONS:
            raise ValueError(f"--speculation-rung must be one of {list(DRAFT_PRECISIONS)}, got {self.precision!r}")


def default_draft_precision(available: Collection[str]) -> str:
    """int8 where the tables time int8 weight-only GEMMs, else fp8."""
    return "int8" if "int8" in available else "fp8"


def controller_precision(precision: str) -> str:
    """The draft precision's name on the controller's ladder (full, int8, int4): fp8 stands as its 8-bit precision."""
    return "int8" if precision == "fp8" else precision


def draft_precisions(precisions: Sequence[str], precision: str) -> list[str]:
    """Each layer's precision in the draft: one ladder step below the one it serves at
    (policy.speculation.precision_below)."""
    below = [precision_below(p, controller_precision(precision)) for p in precisions]
    return ["fp8" if precision == "fp8" and d == "int8" else d for d in below]


class StepTimes(Protocol):
    def step_s(self, batch: BatchShape, precisions: Sequence[str], head: str = FULL) -> float: ...


def draft_s(model: StepTimes, contexts: Sequence[int], ks: Sequence[int], precisions: Sequence[str], precision: str,
            kv8: float = 0.0) -> float:
    """The draft's forwards: step j runs the sequences still drafting (k_i > j) as decode rows at contexts n_i + j,
    every layer a ladder step down, the LM head at the draft precision."""
    layers = draft_precisions(precisions, precision)
    total = 0.0
    for j in range(max(ks, default=0)):
        rows = [n + j for n, k in zip(contexts, ks) if k > j]
        total += model.step_s(BatchShape(decode_kv_lens=rows, sampled=len(rows), decode_kv8=kv8), layers,
                              head=precision)
    return total


def verify_s(model: StepTimes, contexts: Sequence[int], ks: Sequence[int], precisions: Sequence[str],
             kv8: float = 0.0) -> float:
    """One forward of every sequence's k_i + 1 rows (contexts n_i .. n_i + k_i) at the precisions now."""
    rows = [n + j for n, k in zip(contexts, ks) for j in range(k + 1)]
    return model.step_s(BatchShape(decode_kv_lens=rows, sampled=len(rows), decode_kv8=kv8), precisions)


def charged_s(draft: float, verify: float, ks: Sequence[int], acceptance: float) -> float:
    """What one iteration that emits one token per sequence is charged: the drafting iteration's seconds times B over
    the tokens it yields on average, sum E(a, k_i)."""
    return (draft + verify) * len(ks) / sum(expected_tokens(acceptance, k) for k in ks)


@dataclass
class ModelledSpeculationStats:
    """The plan's "speculation" counters (ResourceStats; no EngineStats fields: nothing was drafted)."""

    mode: str
    decode_iterations: int = 0     # iterations of decodes only (the ones that may draft)
    drafting_iterations: int = 0
    sequence_drafts: int = 0
    draft_tokens: int = 0
    expected_accepted_tokens: float = 0.0
    by_batch: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # batch size -> [decode iters, drafting]
    last_decision: str = ""

    def engine_fields(self) -> dict[str, Any]:
        return {}

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SimSpeculation(ResourceManagerBase):
    """Decides per iteration with the server's controller and charges the iteration its modelled time."""

    name = "speculation"

    def __init__(self, modelled: ModelledSpeculation, mode: str, step_model: TableStepModel, available: Collection[str],
                 max_model_len: int, token_budget: int, clock: Callable[[], float]) -> None:
        if modelled.precision not in available:
            raise TableError(f"the draft precision {modelled.precision} has no GEMM rows in these tables (they have "
                             f"{sorted(set(available) - {FULL})}); choose one with --speculation-rung")
        costs = step_model.step_costs(sorted(set(available) - {FULL}))
        if modelled.precision == "fp8":
            costs = dataclasses.replace(costs, layer_s={**costs.layer_s, "int8": costs.layer_s["fp8"]})
        self.modelled = modelled
        self.precision = controller_precision(modelled.precision)
        self.controller = SpeculationController(
            SpeculationConfig(mode=mode, precisions=(self.precision,), max_k=modelled.k,
                              always_k=min(SpeculationConfig.always_k, modelled.k),
                              prior_acceptance=modelled.acceptance), costs)
        self.step_model = step_model
        self.max_model_len = max_model_len
        self.token_budget = token_budget
        self.clock = clock
        self.scheduler: Any = None
        self.stats = ModelledSpeculationStats(mode)

    def before_schedule(self, scheduler: SchedulerView) -> None:
        self.scheduler = scheduler

    def decide(self, chunks: list[ScheduledChunk],
               precisions: Sequence[str]) -> tuple[SpeculationDecision, list[ScheduledChunk], list[int]]:
        """The controller's decision on this batch, the sequences that draft and each one's draft length."""
        t, drafting, limits = draft_telemetry(chunks, self.scheduler, self.controller.config.max_k, self.max_model_len,
                                              tuple(precisions), self.token_budget, self.clock())
        d = self.controller.decide(t)
        self.stats.last_decision = d.reason
        return d, drafting, [min(d.k, lim) for lim in limits] if d.speculate else []

    def step_s(self, chunks: list[ScheduledChunk], shape: BatchShape, precisions: Sequence[str]) -> float:
        """This iteration's modelled seconds: plain, or drafting's per-token average (module docstring)."""
        c = self.controller
        _, drafting, ks = self.decide(chunks, precisions)
        decodes_only = all(ch.is_decode for ch in chunks)
        self.stats.decode_iterations += decodes_only
        if decodes_only:
            self.stats.by_batch.setdefault(str(len(chunks)), [0, 0])[0] += 1
        if not any(ks):
            plain = self.step_model.step_s(shape, precisions)
            if decodes_only:  # the engine's speculative executor observes its plain decode steps alike
                c.observe("plain", c.plain_s(precisions, len(chunks), corrected=False), plain, len(chunks))
            return plain
        contexts = [ch.start + 1 for ch in drafting]
        draft = draft_s(self.step_model, contexts, ks, precisions, self.modelled.precision, shape.decode_kv8)
        verify = verify_s(self.step_model, contexts, ks, precisions, shape.decode_kv8)
        b = len(drafting)
        c.observe("draft", max(ks) * c.draft_s(precisions, self.precision, b, corrected=False), draft, b)
        c.observe("verify", c.verify_s(precisions, b + sum(ks), corrected=False), verify, b)
        s = self.stats
        s.drafting_iterations += 1
        s.by_batch.setdefault(str(b), [0, 0])[1] += 1
        s.sequence_drafts += sum(1 for k in ks if k)
        s.draft_tokens += sum(ks)
        s.expected_accepted_tokens += sum(expected_tokens(self.modelled.acceptance, k) for k in ks) - b
        return charged_s(draft, verify, ks, self.modelled.acceptance)

    def resource_stats(self) -> ModelledSpeculationStats:
        return self.stats
