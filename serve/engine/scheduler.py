"""Continuous batching: decides which sequences run this iteration and with how many tokens.

Shape of vLLM v1's scheduler: running sequences first (decodes and unfinished prefill chunks, FCFS),
then admission of waiting ones, all within a per-iteration token budget and a cap on running sequences.
Prompts longer than the budget are prefilled in chunks. When KV blocks run out the newest running
sequence is preempted: its blocks are freed and it is recomputed later (its generated tokens are kept).
Blocks come from the KV-cache manager (serve/memory/kv_cache_manager.py), which every scheduler shares: with
prefix caching, a sequence that starts (or restarts) takes the longest run of its full blocks already in the
pool's prefix cache and computes only the rest; blocks it fills are registered for others. Before any
scheduler preempts, the manager offers the shortfall it met to its hook (quantize before preempt). The
scheduler asks for and frees blocks (that is part of deciding); it never runs the model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from serve.engine.sequence import Sequence, SequenceStatus
from serve.memory.block_pool import BlockPool
from serve.memory.kv_cache_manager import KVCacheManager


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int        # first token position computed in this chunk (= seq.num_computed_tokens)
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last logits yield a new token."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """One token after a cached context: the forward's decode shape (the executor batches it with the other
        decodes, attending straight over its blocks; the engine counts every other chunk as context). Wider than
        ``Sequence.is_decoding``: a prompt's last token run alone (a chunk boundary or a prefix-cache hit leaves
        it) is a decode chunk of a sequence that is not yet decoding; every decoding sequence's chunk is one."""
        return self.num_tokens == 1 and self.start > 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool = False, on_shortfall: Callable[[int], object] | None = None) -> None:
        self.kv_cache_manager = KVCacheManager(pool, block_size, prefix_caching, on_shortfall)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def pool(self) -> BlockPool:
        """The block pool the KV-cache manager hands out (read it; blocks come and go through the manager)."""
        return self.kv_cache_manager.pool

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self.kv_cache_manager.begin_step()
        return self._schedule()

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        victims = self._newest_running(scheduled)
        # what the sequences after running[i] need in this pass (read while running[i] is being allocated)
        rest = lambda: self._blocks_for_chunks(self.running[i + 1:], budget - n)  # noqa: E731
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._allocate_or_preempt(seq, n, out, victims, lookahead=rest):
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

    def _blocks_for_chunks(self, seqs: list[Sequence], budget: int) -> int:
        """Blocks the next chunks of ``seqs``, taken in order within ``budget`` tokens, need."""
        needed = 0
        for seq in seqs:
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            needed += self.kv_cache_manager.num_blocks_needed(seq, n)
            budget -= n
        return needed

    def _newest_running(self, scheduled: set[int]) -> Iterator[Sequence]:
        """FCFS's victims: the newest running sequence, again and again (the list shrinks with each)."""
        while True:
            victim = self.running[-1]
            assert id(victim) not in scheduled, "victims are always after the current sequence"
            yield victim

    def _claim_blocks(self, seq: Sequence, budget: int) -> int | None:
        """Blocks for the first chunk of a waiting sequence: its cached prefix (when it starts from scratch and
        prefix caching is on), then new blocks for at most ``budget`` more tokens. Returns the chunk's token
        count, or None with nothing taken when the pool cannot hold it."""
        hits = self.kv_cache_manager.get_computed_blocks(seq)
        n = min(seq.num_tokens - seq.num_computed_tokens - len(hits or ()) * self.block_size, budget)
        return n if self.kv_cache_manager.allocate_slots(seq, n, hits) else None

    def _allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput, victims: Iterator[Sequence],
                             lookahead: Callable[[], int] = lambda: 0) -> bool:
        """Blocks for n more tokens of running ``seq``, preempting ``victims`` in order while the pool is short;
        False when seq itself was preempted or no victim is left. Before each preemption the KV-cache manager
        may cover the shortfall met (quantize before preempt): the blocks seq needs plus ``lookahead()``, what
        the rest of this pass will need."""
        kv = self.kv_cache_manager
        while not kv.allocate_slots(seq, n):
            victim = next(victims, None)
            if victim is None:
                return False
            kv.cover_shortfall(kv.num_blocks_needed(seq, n) + lookahead())
            if kv.allocate_slots(seq, n):
                return True  # the pool grew: nobody is preempted
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def on_executed(self, out: SchedulerOutput) -> None:
        for chunk in out.chunks:
            seq = chunk.seq
            before = seq.num_computed_tokens
            seq.num_computed_tokens += chunk.num_tokens
            if seq.status is SequenceStatus.RUNNING:
                self.kv_cache_manager.cache_full_blocks(seq, before)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def blocks_needed_by_waiting(self) -> int:
        kv = self.kv_cache_manager
        return sum(kv.num_blocks_needed(s, s.num_tokens - s.num_computed_tokens) for s in self.waiting)

    # ---- the running blocks the KV-precision rung converts (serve/engine/kv_rung.py) ------------------------
    def cold_full_blocks(self) -> list[int]:
        """Blocks of running sequences whose every token is computed (never one being written), oldest first:
        every sequence's first block (running order), then every second block, and so on."""
        bs = self.block_size
        tables = [s.block_ids[: s.num_computed_tokens // bs] for s in self.running]
        depth = max((len(t) for t in tables), default=0)
        return [t[j] for j in range(depth) for t in tables if j < len(t)]

    def replace_blocks(self, moves: dict[int, int]) -> None:
        """Blocks moved (``old -> new``): every sequence holding one now holds the new one."""
        for seq in [*self.running, *self.waiting]:
            self.kv_cache_manager.repoint(seq, moves)

    # ---- the SchedulerView the morph runtime reads ---------------------------------------------------
    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def oldest_waiting_arrival(self) -> float | None:
        return self.waiting[0].arrival_time if self.waiting else None

    def running_tiers(self) -> tuple[int, ...]:
        """The SLO tiers with a sequence running, each once, strictest first."""
        return tuple(sorted({s.slo.priority for s in self.running if s.slo.priority is not None}))

    def slo_signals(self, now: float) -> tuple[int, float | None]:
        """(critical decodes left out of the last batch, least TTFT slack of a waiting request in seconds).

        FCFS tracks no deadlines, so it reports none and the controller sees exactly what it saw before
        SLO-aware scheduling existed; the slai scheduler overrides this.
        """
        return 0, None
