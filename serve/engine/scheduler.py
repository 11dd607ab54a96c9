"""Continuous batching: decides which sequences run this iteration and with how many tokens.

Shape of vLLM v1's scheduler: running sequences first (decodes and unfinished prefill chunks, FCFS),
then admission of waiting ones, all within a per-iteration token budget and a cap on running sequences.
Prompts longer than the budget are prefilled in chunks. When KV blocks run out the newest running
sequence is preempted: its blocks are freed and it is recomputed later (its generated tokens are kept).
With prefix caching, a sequence that starts (or restarts) takes the longest run of its full blocks already
in the pool's prefix cache and computes only the rest; blocks it fills are registered for others.
The scheduler allocates and frees blocks (that is part of deciding); it never runs the model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serve.engine.sequence import Sequence, SequenceStatus
from serve.memory.block_pool import BlockPool
from serve.memory.prefix_hash import extend_block_hashes


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int        # first token position computed in this chunk (= seq.num_computed_tokens)
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits yield a new token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool = False) -> None:
        self.pool = pool
        self.prefix_caching = prefix_caching
        self.prefix_queried_tokens = 0   # prompt tokens looked up in the prefix cache at admission
        self.prefix_hit_tokens = 0       # of which found there (not computed again)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._allocate_or_preempt(seq, n, out, scheduled):
                break  # seq itself was preempted; everything after it is gone too
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            scheduled.add(id(seq))
            budget -= n
            i += 1
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                n = self._claim_blocks(seq, budget)
                if n is None:
                    break  # FCFS: do not let later requests overtake the head of the queue
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= n
        return out

    def _claim_blocks(self, seq: Sequence, budget: int) -> int | None:
        """Blocks for the first chunk of a waiting sequence: its cached prefix (when it starts from scratch and
        prefix caching is on), then new blocks for at most ``budget`` more tokens. Returns the chunk's token
        count, or None with nothing taken when the pool cannot hold it."""
        hits: list[int] = []
        looked_up = self.prefix_caching and seq.num_computed_tokens == 0 and not seq.block_ids
        if looked_up:
            if seq.hash_epoch != self.pool.cache_epoch:
                seq.block_hashes, seq.hash_epoch = [], self.pool.cache_epoch
            # at least the last token is computed: its logits give the next token
            full = (seq.num_tokens - 1) // self.block_size
            hits = self.pool.lookup(extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, full,
                                                        seq.hash_epoch)[:full])
            self.pool.take(hits)
            seq.block_ids = list(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        blocks = self.pool.allocate(seq.blocks_needed(n, self.block_size))
        if blocks is None:
            if hits:
                self.pool.free(hits)
                seq.block_ids, seq.num_computed_tokens = [], 0
            return None
        seq.block_ids.extend(blocks)
        if looked_up:
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += len(hits) * self.block_size
        return n

    def _allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        needed = seq.blocks_needed(n, self.block_size)
        while True:
            blocks = self.pool.allocate(needed)
            if blocks is not None:
                seq.block_ids.extend(blocks)
                return True
            victim = self.running[-1]
            assert id(victim) not in scheduled, "victims are always after the current sequence"
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def on_executed(self, out: SchedulerOutput) -> None:
        bs = self.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            before = seq.num_computed_tokens
            seq.num_computed_tokens += chunk.num_tokens
            full = seq.num_computed_tokens // bs
            # blocks this chunk filled hold KV for a known prefix: register them (only while the epoch the
            # sequence started computing in is current, so every block of the chain came from the same weights)
            if (self.prefix_caching and full > before // bs and seq.hash_epoch == self.pool.cache_epoch
                    and seq.status is SequenceStatus.RUNNING):
                hashes = extend_block_hashes(seq.block_hashes, seq.token_ids, bs, full, seq.hash_epoch)
                for j in range(before // bs, full):
                    self.pool.register(seq.block_ids[j], hashes[j])

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.pool.free(seq.block_ids)
            seq.block_ids = []

    def blocks_needed_by_waiting(self) -> int:
        return sum(s.blocks_needed(s.num_tokens - s.num_computed_tokens, self.block_size) for s in self.waiting)

    # ---- the SchedulerView the morph runtime reads ---------------------------------------------------
    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def oldest_waiting_arrival(self) -> float | None:
        return self.waiting[0].arrival_time if self.waiting else None

    def blocks_short_for_running(self) -> int:
        """Blocks the running sequences' next chunks (as schedule() would size them) need beyond the free
        ones; positive means schedule() is about to preempt."""
        budget, needed = self.max_num_batched_tokens, 0
        for seq in self.running:
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            needed += seq.blocks_needed(n, self.block_size)
            budget -= n
        return needed - self.pool.num_free

    def slo_signals(self, now: float) -> tuple[int, float | None]:
        """(critical decodes left out of the last batch, least TTFT slack of a waiting request in seconds).

        FCFS tracks no deadlines, so it reports none and the controller sees exactly what it saw before
        SLO-aware scheduling existed; the slai scheduler overrides this.
        """
        return 0, None
