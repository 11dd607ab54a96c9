"""SLAI: SLO-aware scheduling with per-request TBT deadlines (arXiv 2508.01002), beside FCFS.

Decisions only: it returns the same ``SchedulerOutput`` as the FCFS scheduler, so the executor is untouched.
Each iteration, within the token budget (``max_num_batched_tokens``) and the running-sequence cap:

1. Deadlines. A running decode's (``Sequence.is_decoding``) last schedulable time is
   ``LST = time of its last token (the end of the batch that produced it) + its TBT target - theta * mean
   batch duration`` (running mean over the last ``window`` batches). theta is fixed, or dynamic:
   ``theta_low`` while KV usage < ``kv_threshold``, ``theta_high`` above.
   The iteration's token budget (``tbt_budget``, policy/slai_budget.py): no more tokens than a batch can take and
   still end before the earliest running decode's deadline (last token + TBT target), by a step-time model fitted
   on this scheduler's own measured batches, but never fewer than the decodes plus ``min_prompt_tokens``; so a
   prefill chunk never stretches an iteration past the tightest tier's TBT.
2. Critical decodes (now >= LST, or a deadline this iteration and the next would pass at the predicted length)
   first, in (LST, arrival) order, within the budget and ``max_decodes``.
   When no KV block is free for one, the most recently admitted partially-done prefill is preempted;
   failing that, the decode itself. Before any preemption the KV-cache manager offers the shortfall met to
   its hook (the morph runtime quantizes before preempt), as under FCFS.
3. Partially-done prefills continue (chunk = min(remaining, budget left)), in admission order; one that
   finds no block may preempt newer partial prefills only, else it waits.
4. New prefills are admitted (skipped in a batch that preempted): tier first (0 = strict), then
   previously preempted sequences, then by TTFT deadline (policy/slai_admission.py: prompts near their deadline by
   deadline, the rest shortest remaining prompt first, prompts already past it last; ``deadline_admission``
   False: shortest remaining prompt, then arrival).
5. Leftover budget goes to the non-critical decodes in LST order (no preemption for them).

While KV binds (usage at or above ``kv_threshold``, or the last admission found no block for the request at the
head of the queue), rule 5 runs right after rule 2: deferring a decode then buys the queue no prefill (it waits
for blocks, not for budget) and only keeps the decode's blocks held longer, so every waiting request waits longer
for them. Those decodes still preempt nobody; prefills take what budget they leave.

The engine's clock is passed in, so tests drive every rule with a fake clock.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Callable

from policy.slai_admission import admission_key
from policy.slai_budget import fit_step_time, must_run_now, token_budget
from serve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from serve.engine.sequence import Sequence, SequenceStatus
from serve.memory.block_pool import BlockPool


@dataclass(frozen=True)
class SlaiConfig:
    theta: float | None = None     # fixed theta; None = dynamic (theta_low / theta_high)
    theta_low: float = 3.0
    theta_high: float = 6.0
    kv_threshold: float = 0.96     # KV usage at or above which dynamic theta is theta_high
    max_decodes: int | None = None  # decodes per batch; None = the running-sequence cap
    window: int = 32               # batches in the running mean of the batch duration (and the step-time fit)
    tbt_budget: bool = True        # cap each iteration's tokens by the tightest running decode's TBT deadline
    min_prompt_tokens: int = 16    # prompt tokens an iteration may always take beside its decodes (admission moves)
    kv_bound_decodes_first: bool = True  # while KV binds admission, no decode is deferred (module docstring)
    deadline_admission: bool = True  # rule 4's order by TTFT deadline (policy/slai_admission.py); False: shortest
    urgent_share: float = 0.5      # a prompt with less than this share of its TTFT target left is urgent

    def __post_init__(self) -> None:
        for name in ("theta", "theta_low", "theta_high"):
            v = getattr(self, name)
            if v is not None and not (0.0 <= v < math.inf):
                raise ValueError(f"slai {name} must be a finite number >= 0, got {v!r}")
        if not 0.0 < self.kv_threshold <= 1.0:
            raise ValueError(f"slai kv_threshold must be in (0, 1], got {self.kv_threshold!r}")
        if self.max_decodes is not None and self.max_decodes < 1:
            raise ValueError(f"slai max_decodes must be >= 1, got {self.max_decodes!r}")
        if self.window < 1:
            raise ValueError(f"slai window must be >= 1, got {self.window!r}")
        if self.min_prompt_tokens < 0:
            raise ValueError(f"slai min_prompt_tokens must be >= 0, got {self.min_prompt_tokens!r}")
        if not 0.0 <= self.urgent_share <= 1.0:
            raise ValueError(f"slai urgent_share must be in [0, 1], got {self.urgent_share!r}")


class SlaiScheduler(Scheduler):
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 clock: Callable[[], float], config: SlaiConfig | None = None, prefix_caching: bool = False,
                 on_shortfall: Callable[[int], object] | None = None) -> None:
        super().__init__(pool, block_size, max_num_seqs, max_num_batched_tokens, prefix_caching, on_shortfall)
        self.clock = clock
        self.config = config or SlaiConfig()
        self.max_decodes = self.config.max_decodes or max_num_seqs
        self._durations: collections.deque[float] = collections.deque(maxlen=self.config.window)
        self._sizes: collections.deque[tuple[int, float]] = collections.deque(maxlen=self.config.window)
        self._batch_start: float | None = None
        self.last_budget = max_num_batched_tokens  # the last iteration's token budget, and why
        self.last_budget_reason = ""
        self._last_token: dict[Sequence, float] = {}
        self.last_critical_unscheduled = 0   # critical decodes the last batch could not fit
        self.admission_short_of_blocks = False  # the last admission found no block for the head of the queue
        self.num_critical_unscheduled = 0    # the same, summed over all batches

    # ---- deadlines -----------------------------------------------------------------------------
    def mean_batch_s(self) -> float:
        return sum(self._durations) / len(self._durations) if self._durations else 0.0

    def theta(self) -> float:
        c = self.config
        if c.theta is not None:
            return c.theta
        return c.theta_high if self.kv_cache_manager.usage >= c.kv_threshold else c.theta_low

    def deadline(self, seq: Sequence) -> float:
        """When a running decode's next token is due: its last token + its TBT target, on the engine clock."""
        last = self._last_token.get(seq, seq.last_token_time if seq.last_token_time is not None else seq.arrival_time)
        assert seq.slo.tbt_s is not None, "the engine resolves every request's targets"
        return last + seq.slo.tbt_s

    def lst(self, seq: Sequence) -> float:
        """Last schedulable time of a running decode, on the engine clock."""
        return self.deadline(seq) - self.theta() * self.mean_batch_s()

    def kv_bound(self) -> bool:
        """Whether KV memory, not the token budget, limits admission now (every decode is then critical)."""
        return self.config.kv_bound_decodes_first and (
            self.admission_short_of_blocks or self.kv_cache_manager.usage >= self.config.kv_threshold)

    # ---- the decision ----------------------------------------------------------------------------
    def _schedule(self) -> SchedulerOutput:
        now = self.clock()
        self._batch_start = now
        out = SchedulerOutput()
        scheduled: set[Sequence] = set()
        decodes = sorted((s for s in self.running if s.is_decoding), key=lambda s: (self.lst(s), s.arrival_time))
        budget = self.max_num_batched_tokens
        fit = fit_step_time(list(self._sizes)) if self.config.tbt_budget else None
        if fit is not None and decodes:
            budget, self.last_budget_reason = token_budget(now, [self.deadline(s) for s in decodes], fit, budget,
                                                           min(len(decodes), self.max_decodes),
                                                           self.config.min_prompt_tokens)
        urgent = (lambda s: now >= self.lst(s) or (fit is not None and must_run_now(now, self.deadline(s),
                                                                                   fit.predict(budget))))
        critical = [s for s in decodes if urgent(s)]
        relaxed = [s for s in decodes if not urgent(s)]
        self.last_budget = budget
        missed = 0
        for seq in critical:                                               # rule 2
            if budget < 1 or self._num_decodes(out) >= self.max_decodes or seq.status is not SequenceStatus.RUNNING:
                missed += 1
                continue
            if self._allocate(seq, 1, out, victims=self._prefill_victims(scheduled), self_last=True):
                budget -= self._add(out, scheduled, seq, 1)
            else:
                missed += 1
        relaxed_first = self.kv_bound()
        if relaxed_first:
            budget = self._relaxed(out, scheduled, relaxed, budget)                # rule 5 while KV binds
        for seq in [s for s in self.running if not s.is_decoding and s not in scheduled]:   # rule 3
            if budget < 1:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            victims = self._prefill_victims(scheduled, after=seq)
            if seq.status is SequenceStatus.RUNNING and self._allocate(seq, n, out, victims=victims):
                budget -= self._add(out, scheduled, seq, n)
        if not out.preempted:                                              # rule 4
            budget = self._admit(out, scheduled, budget)
        if not relaxed_first:
            budget = self._relaxed(out, scheduled, relaxed, budget)                # rule 5
        if not out.chunks and relaxed and relaxed[0].status is SequenceStatus.RUNNING:
            # Nothing else can run (no free block): treat the earliest deadline as critical rather than idle.
            if self._allocate(relaxed[0], 1, out, victims=self._prefill_victims(scheduled), self_last=True):
                self._add(out, scheduled, relaxed[0], 1)
        self.last_critical_unscheduled = missed
        self.num_critical_unscheduled += missed
        return out

    def _relaxed(self, out: SchedulerOutput, scheduled: set[Sequence], relaxed: list[Sequence], budget: int) -> int:
        """Rule 5: non-critical decodes in LST order within the budget left; they preempt nobody."""
        for seq in relaxed:
            if budget < 1 or self._num_decodes(out) >= self.max_decodes:
                break
            if seq.status is SequenceStatus.RUNNING and self._allocate(seq, 1, out, victims=[]):
                budget -= self._add(out, scheduled, seq, 1)
        return budget

    def _admit(self, out: SchedulerOutput, scheduled: set[Sequence], budget: int) -> int:
        order = sorted(self.waiting, key=self._admission_key(self.clock()))
        if not order:
            self.admission_short_of_blocks = False
        for seq in order:
            if budget < 1 or len(self.running) >= self.max_num_seqs:
                break
            n = self._claim_blocks(seq, budget)
            self.admission_short_of_blocks = n is None
            if n is None:
                break  # a later (longer or lower-tier) prompt must not overtake this one
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._add(out, scheduled, seq, n)
        return budget

    def _admission_key(self, now: float) -> Callable[[Sequence], tuple]:
        c = self.config
        if not c.deadline_admission:
            return lambda s: (s.slo.priority, 0 if s.num_output_tokens else 1, s.num_tokens - s.num_computed_tokens,
                              s.arrival_time)
        return lambda s: admission_key(now, s.slo.priority, s.num_output_tokens > 0,
                                       s.num_tokens - s.num_computed_tokens, s.arrival_time,
                                       math.inf if s.slo.ttft_s is None else s.slo.ttft_s, c.urgent_share)

    def _add(self, out: SchedulerOutput, scheduled: set[Sequence], seq: Sequence, n: int) -> int:
        out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
        scheduled.add(seq)
        return n

    @staticmethod
    def _num_decodes(out: SchedulerOutput) -> int:
        return sum(1 for c in out.chunks if c.seq.is_decoding)

    def _prefill_victims(self, scheduled: set[Sequence], after: Sequence | None = None) -> list[Sequence]:
        """Running partially-done prefills not in this batch, most recently admitted first (only those
        admitted after ``after`` when given)."""
        running = self.running
        start = running.index(after) + 1 if after is not None else 0
        return [s for s in reversed(running[start:]) if not s.is_decoding and s not in scheduled]

    def _allocate(self, seq: Sequence, n: int, out: SchedulerOutput, victims: list[Sequence],
                  self_last: bool = False) -> bool:
        """Blocks for n more tokens of seq, preempting ``victims`` in order (then seq itself when self_last)."""
        return self._allocate_or_preempt(seq, n, out, iter([*victims, *([seq] if self_last else [])]))

    # ---- bookkeeping -----------------------------------------------------------------------------
    def on_executed(self, out: SchedulerOutput) -> None:
        super().on_executed(out)
        now = self.clock()
        if self._batch_start is not None and out.chunks:
            self._durations.append(now - self._batch_start)
            self._sizes.append((out.num_tokens, now - self._batch_start))
        for chunk in out.chunks:
            if chunk.samples:
                self._last_token[chunk.seq] = now
        self._batch_start = None

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        self._last_token.pop(seq, None)

    def slo_signals(self, now: float) -> tuple[int, float | None]:
        slack = [s.arrival_time + s.slo.ttft_s - now for s in self.waiting  # type: ignore[operator]
                 if s.first_token_time is None]
        return self.last_critical_unscheduled, (min(slack) if slack else None)
