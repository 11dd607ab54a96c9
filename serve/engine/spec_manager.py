"""Self-speculative decoding as a resource manager: the controller's decision per iteration, the draft's KV blocks
taken and given back exactly, the acceptance counters.

The speculative executor (serve/engine/spec_executor.py) asks :meth:`SpeculationManager.plan` for every batch.
The manager builds the controller's telemetry (policy/speculation.py), and when it says draft, takes the blocks
each sequence's draft positions need from the KV-cache manager (never preempting for them: a sequence whose
blocks do not fit drafts fewer tokens). After verification :meth:`settle` counts the accepted tokens as computed,
registers the blocks they filled in the prefix cache and frees the blocks only rejected positions had taken, so a
sequence holds exactly the blocks plain decoding would hold at the same length.

Which requests draft: decoding sequences (their last token the only one left to compute) whose request did not
opt out (``SamplingParams.speculate``), with no structured-output guide (its grammar state cannot roll back here)
and no log-probabilities asked for: those decode without speculation, as do iterations with prefill chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from policy.costs import StepCosts
from policy.speculation import SpeculationController, SpeculationDecision, SpeculationTelemetry
from serve.engine.scheduler import ScheduledChunk
from serve.engine.sequence import Sequence, SequenceStatus
from serve.morph.draft import DraftBank
from serve.resource_seam import ResourceManagerBase, SchedulerView


def may_draft(chunk: ScheduledChunk) -> bool:
    """Whether this chunk's sequence may draft (the module docstring says which do)."""
    seq, p = chunk.seq, chunk.seq.params
    return (chunk.is_decode and chunk.samples and seq.is_decoding and p.speculate and seq.guide is None
            and not p.logprobs)


def draft_limit(seq: Sequence, max_model_len: int) -> int:
    """Draft tokens worth verifying for ``seq``: what it may still emit minus the target's own token, and no
    position past the context length."""
    left = seq.params.max_tokens - seq.num_output_tokens - 1
    return max(0, min(left, max_model_len - seq.num_tokens))


def draft_telemetry(chunks: list[ScheduledChunk], scheduler: Any, max_k: int, max_model_len: int,
                    layer_precisions: tuple[str, ...], token_budget: int,
                    now_s: float) -> tuple[SpeculationTelemetry, list[ScheduledChunk], list[int]]:
    """The controller's telemetry for a batch (its chunks, the scheduler's KV-cache manager and queue), the chunks
    that may draft and each one's draft limit. Shared with the planner (sim/speculation.py), which decides alike."""
    kvm = scheduler.kv_cache_manager
    drafting = [c for c in chunks if may_draft(c)]
    other = sum(c.num_tokens for c in chunks) - len(drafting)
    limits = [draft_limit(c.seq, max_model_len) for c in drafting]
    bs = kvm.block_size
    draft_blocks = tuple(sum(max(0, -(-(c.seq.num_computed_tokens + 1 + min(k, lim)) // bs) - len(c.seq.block_ids))
                             for c, lim in zip(drafting, limits)) for k in range(1, max_k + 1))
    pool = kvm.pool
    t = SpeculationTelemetry(now_s=now_s, batch_size=len(drafting), other_tokens=other, kv_usage=pool.usage,
                             kv_blocks_free=pool.num_free, num_waiting=scheduler.num_waiting(),
                             draft_blocks=draft_blocks, layer_precisions=layer_precisions, token_budget=token_budget)
    return t, drafting, limits


@dataclass(frozen=True)
class SpeculationStats:
    """The manager's snapshot (``EngineStats.resources["speculation"]``), with vLLM's spec-decode names."""

    mode: str
    num_steps: int            # iterations that drafted
    num_drafts: int           # sequence drafts verified (vLLM: spec_decode_num_drafts)
    num_draft_tokens: int     # draft tokens proposed
    num_accepted_tokens: int  # draft tokens the target agreed with
    acceptance_rate: float    # accepted / drafted so far (0 before any draft)
    acceptance_by_rung: dict[str, float]
    last_decision: str

    def engine_fields(self) -> dict[str, Any]:
        return {"spec_decode_num_steps": self.num_steps, "spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_draft_acceptance_rate": self.acceptance_rate}


@dataclass
class DraftPlan:
    """One drafting iteration: the decision, and the tokens each sequence drafts (0: it verifies only its last)."""

    decision: SpeculationDecision
    chunks: list[ScheduledChunk]
    ks: list[int]
    blocks_taken: int = 0
    precisions: list[str] = field(default_factory=list)  # the draft's per-layer precisions


class SpeculationManager(ResourceManagerBase):
    name = "speculation"

    def __init__(self, controller: SpeculationController, drafts: DraftBank, token_budget: int,
                 max_model_len: int, clock: Callable[[], float]) -> None:
        self.controller = controller
        self.drafts = drafts
        self.token_budget = token_budget
        self.max_model_len = max_model_len
        self.clock = clock
        self.scheduler: Any = None
        self.num_steps = self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.last_decision: SpeculationDecision | None = None
        self.decisions: list[SpeculationDecision] = []  # the recent ones (tests, logs); bounded below
        self.accepted_per_draft: list[int] = []  # the latest verifications' accepted counts (bounded)

    @property
    def mode(self) -> str:
        return self.controller.config.mode

    def before_schedule(self, scheduler: SchedulerView) -> None:
        self.scheduler = scheduler  # the KV-cache manager and queue the plan reads

    # ---- per batch -----------------------------------------------------------------------------------
    def plan(self, chunks: list[ScheduledChunk]) -> DraftPlan | None:
        """Ask the controller about this batch; on yes take the draft blocks and say how many tokens each drafts."""
        kvm = getattr(self.scheduler, "kv_cache_manager", None)
        if kvm is None or not chunks:
            return None
        t, drafting, limits = draft_telemetry(chunks, self.scheduler, self.controller.config.max_k, self.max_model_len,
                                              tuple(layer.precision for layer in self.drafts.model.layers),
                                              self.token_budget, self.clock())
        decision = self.controller.decide(t)
        self._remember(decision)
        if not decision.speculate or decision.precision is None:
            return None
        ks, taken = [], 0
        for c, lim in zip(drafting, limits):
            k = min(decision.k, lim)
            before = len(c.seq.block_ids)
            while k > 0 and not kvm.allocate_slots(c.seq, 1 + k):  # fewer draft tokens, never a preemption
                k -= 1
            taken += len(c.seq.block_ids) - before
            ks.append(k)
        if not any(ks):
            return None
        self.num_steps += 1
        return DraftPlan(decision, drafting, ks, taken, self.drafts.precisions(decision.precision))

    def settle(self, seq: Sequence, precision: str, drafted: int, accepted: int) -> None:
        """After verification: ``accepted`` of ``drafted`` draft tokens were emitted (plus the target's own). Their
        positions count as computed, the blocks they filled are registered, the rest of the draft's blocks are
        freed. A sequence that finished meanwhile already gave back all of its blocks."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.accepted_per_draft = (self.accepted_per_draft + [accepted])[-4096:]
        self.controller.observe_acceptance(precision, drafted, accepted)
        seq.num_draft_tokens += drafted
        seq.num_accepted_draft_tokens += accepted
        if seq.status is not SequenceStatus.RUNNING:
            return
        kvm = self.scheduler.kv_cache_manager
        before = seq.num_computed_tokens
        seq.num_computed_tokens += accepted
        kvm.cache_full_blocks(seq, before)
        kvm.trim(seq, seq.num_computed_tokens)

    def _remember(self, decision: SpeculationDecision) -> None:
        self.last_decision = decision
        self.decisions = (self.decisions + [decision])[-256:]

    def use_costs(self, costs: StepCosts) -> None:
        """A corrected step-cost table (serve/morph/cost_check.py): the controller's cost model reads it from now on."""
        self.controller.use_costs(costs)

    def resource_stats(self) -> SpeculationStats:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return SpeculationStats(self.mode, self.num_steps, self.num_drafts, self.num_draft_tokens,
                                self.num_accepted_tokens, rate, dict(self.controller.est.acceptance),
                                self.last_decision.reason if self.last_decision else "")
