"""The engine loop: admission, schedule -> execute -> sample -> stream, in one thread.

Callers add requests from any thread; `step()` runs one iteration; `start_background()` runs steps in a loop thread
while there is work. Callbacks run in the stepping thread after the iteration's state is updated (they may abort).
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from typing import Callable, Iterable, TypeVar

import torch

from serve.config import EngineConfig
from serve.engine.admission import Handoff
from serve.engine.assembly import EngineParts, build_parts, make_scheduler
from serve.engine.errors import EngineError, InvalidRequest, RequestCancelled
from serve.engine.faults import FaultTracker
from serve.engine.grammar_wait import GrammarWait, guide_error
from serve.engine.lifecycle import Lifecycle
from serve.engine.outputs import FinishReason, OutputCollector, RequestOutput
from serve.engine.resources import ResourceManagers
from serve.engine.sampling_params import SamplingParams
from serve.engine.sequence import Sequence
from serve.engine.slo import RequestSLO
from serve.engine.stats import EngineStats, resource_fields
from serve.engine.token_append import Appended, TokenAppender
from serve.engine.torch_device import TorchDevice
from serve.engine.validation import RequestValidator
from serve.guided.compiler import GuideCompiler
from serve.logging_setup import ensure_logging
from serve.memory.block_pool import CacheEvents
from serve.model.loader import LoadedModel
from serve.model.tokenizer import IncrementalDetokenizer
from serve.process.omp_threads import on_short_lived_thread
from serve.resource_seam import YieldsMemory

Callback = Callable[[RequestOutput], None]
M = TypeVar("M")

# Engines whose loop thread runs. The loop is a daemon thread so that a forgotten engine never holds the process
# open; but a daemon thread still inside a torch op when the interpreter finalizes is ended by a forced unwind
# through C++ frames, and the process aborts ("terminate called without an active exception", SIGABRT). atexit
# handlers run before that point, so the loops are stopped there: each finishes its current step and returns.
_RUNNING: "weakref.WeakSet[LLMEngine]" = weakref.WeakSet()


@atexit.register
def _stop_running_engines() -> None:
    for engine in list(_RUNNING):
        engine.stop()


MAX_STEP_FAILURES = 3
"""Consecutive failed iterations after which the engine reports itself unhealthy."""


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 clock: Callable[[], float] | None = None, parts: EngineParts | None = None) -> None:
        self.config = config = config or EngineConfig()
        ensure_logging()
        self.clock = clock or time.perf_counter  # one clock for arrivals, token times and the controller
        if parts is None:
            if config.num_threads:
                torch.set_num_threads(config.num_threads)  # for new threads, and for this one should it step us
            # Loading and packing the weights run parallel torch ops: on a thread that ends after, so that the stepping
            # thread's OpenMP team stays the only one in the process (why: serve/process/omp_threads.py).
            parts = on_short_lived_thread(lambda: build_parts(config, TorchDevice(config, loaded), self.clock),
                                          name="morphserve-load")
        self.faults = FaultTracker(MAX_STEP_FAILURES)
        self._assemble(config, parts)
        self._lock = threading.RLock()  # held for a whole iteration; admission does not take it
        self._handoff = Handoff(config.max_num_waiting)
        self._admission = threading.Lock()  # ids claimed and requests queued one at a time (add_request, the drain)
        self.guides = GuideCompiler(self.tokenizer, self.model_config.vocab_size, config.guided_compile_timeout_s,
                                    backend=config.guided_backend)  # structured output, built or assembled alike
        self.grammars = GrammarWait(self.guides, self._handoff.work.set)  # guided requests wait for their grammar
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False  # stop() asked the loop thread to end
        self.num_steps = self.num_generated_tokens = 0
        self.last_num_scheduled = self.last_num_context = 0  # the last iteration's batch: sequences, prefill chunks
        self.last_step_error: str | None = None
        self._step_listeners: list[Callable[[], None]] = []
        self.lifecycle = Lifecycle(config.queue_timeout_s, config.shed_on_arrival, config.request_timeout_s)
        self.start_rate = self.lifecycle.start_rate

    def _assemble(self, config: EngineConfig, parts: EngineParts) -> None:
        """The loop's state from its parts (built by serve/engine/assembly.py, or simulated by the planner)."""
        self.device, self.dtype = parts.device, parts.dtype
        self.model_config, self.tokenizer, self.max_model_len = parts.model_config, parts.tokenizer, parts.max_model_len
        self.model, self.memory = parts.model, parts.memory
        self.pool, self.ledger, self.kv = self.memory.pool, self.memory.ledger, self.memory.kv
        self.bytes_per_block = self.ledger.slot_bytes
        self.resources = ResourceManagers(parts.resources, self.faults.record)  # a manager's failure: the fault log
        self._wire_resources(config)
        self.executor = parts.executor
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.appender = TokenAppender(self.model_config.eos_token_ids, self.default_generator, self.max_model_len,
                                      self.clock)

    def _wire_resources(self, config: EngineConfig) -> None:
        """The admission bound the resource managers give (the most blocks the mode can reach: what no configuration
        holds is refused at once), and the scheduler, which offers them its shortfalls when one can grow the pool."""
        reachable, note = self.resources.reachable_blocks(self.pool.base_blocks, self.pool.num_blocks)
        # before a preemption the managers that grow the pool cover what they can (quantize before preempt)
        cover = (lambda n: self.resources.cover_shortfall(self.scheduler, n)) if self.resources.grows_pool else None
        self.scheduler = make_scheduler(config, self.pool, self.clock, cover, device_type=self.device.type)
        self.validator = RequestValidator(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                          config.block_size, reachable, note, config.morph_mode)

    def resource_manager(self, kind: type[M]) -> M | None:
        """The engine's resource manager of type ``kind`` (e.g. ``MorphRuntime``), None when it hosts none: the
        public way for tools, the planner and front ends to reach a lever."""
        return self.resources.get(kind)

    @property
    def reachable_blocks(self) -> int:
        """The most KV blocks this engine's mode can ever have (the admission bound)."""
        return self.validator.reachable_blocks

    # ---- admission -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, callback: Callback | None = None,
                    arrival_time: float | None = None, slo: RequestSLO | None = None,
                    timeout_s: float | None = None) -> str:
        """Validate and tokenize in the caller's thread, then hand over to the loop without waiting for the running
        forward. Raises ValueError/TypeError for bad input, the typed errors of serve/engine/errors.py otherwise
        (overloaded, draining, unhealthy: serve/engine/lifecycle.py decides); the engine is unaffected.

        arrival_time (engine clock): count queueing from the request's arrival (a replay's schedule, a front end's
        front end). slo: its TTFT/TBT targets and tier (unset: slo_ttft_s, slo_tbt_s, default_priority from the config).
        timeout_s: its deadline from arrival (default: the config's request_timeout_s)."""
        params = params or SamplingParams()
        arrival = arrival_time if arrival_time is not None else self.clock()
        self.lifecycle.admit(self.clock(), self.num_waiting() - len(self.grammars), self.faults)  # not grammar waiters
        deadline = self.lifecycle.deadline(arrival, timeout_s)
        if slo is not None and not isinstance(slo, RequestSLO):
            raise TypeError("slo must be a RequestSLO")
        targets = (slo or RequestSLO()).resolved(self.config.slo_ttft_s, self.config.slo_tbt_s,
                                                 self.config.default_priority)
        ids, bad_words = self.validator.tokenize(prompt, params)
        # generators live where the logits are sampled (a CPU generator cannot drive a CUDA multinomial)
        gen = torch.Generator(device=self.device).manual_seed(params.seed) if params.seed is not None else None
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(rid, ids, params, arrival, IncrementalDetokenizer(self.tokenizer, params.stop,
                       params.include_stop_str_in_output), callback, gen, slo=targets, bad_words_ids=bad_words,
                       deadline=deadline)
        waits = self.grammars.start(seq)  # a guided request's compile starts now; the loop never waits for it
        try:
            self._hand_over(seq, waits)
        except Exception:
            self.grammars.discard(seq)  # refused: its compile is cancelled
            raise
        if self._lock.acquire(blocking=False):  # engine idle between iterations: admit now, never wait
            try:
                self._admit_handoff()
            finally:
                self._lock.release()
        return rid

    def _hand_over(self, seq: Sequence, waits_for_grammar: bool) -> None:
        """Claim ``seq``'s id among the live requests and queue it for the loop, one request at a time under the
        admission lock (the loop drains between two, never inside one). EngineOverloaded past ``max_num_waiting``
        (the requests waiting for a grammar count, this one apart), InvalidRequest for an id in use."""
        with self._admission:
            if seq.request_id in self._requests:
                raise InvalidRequest(f"request id {seq.request_id!r} is already in use")
            self._handoff.put(seq, len(self.scheduler.waiting) + len(self.grammars) - int(waits_for_grammar))
            self._requests[seq.request_id] = seq  # the loop drains under the same lock: never before this

    def _admit_handoff(self) -> None:
        """Move handed-over requests into the scheduler (caller holds the engine lock)."""
        with self._admission:
            handed = self._handoff.drain()
        for seq in handed:
            if seq.request_id in self._requests and not self.grammars.defer(seq):  # not aborted meanwhile
                self.scheduler.add(seq)
        for seq in self.grammars.ready():
            self.scheduler.add(seq)

    @property
    def healthy(self) -> bool:
        """False after MAX_STEP_FAILURES iterations in a row failed: the engine is broken (a device error, a
        corrupt layer), new requests are refused with the reason and health endpoints should say so.
        Failures pinned to single requests do not count (serve/engine/faults.py)."""
        return self.faults.healthy

    def num_waiting(self) -> int:
        """Requests admitted but not running yet (lock-free: for admission decisions and gauges)."""
        return len(self.scheduler.waiting) + len(self._handoff) + len(self.grammars)

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request (final output: abort, kind cancelled), KV blocks freed at once; False if unknown/ended."""
        with self._lock:
            self._admit_handoff()
            seq = self._requests.get(request_id)
            if seq is None:
                return False
            out = self._finish(seq, FinishReason.ABORT)
            out.error_kind = RequestCancelled.kind
        self._deliver([(seq, out)])
        return True

    def drain(self, draining: bool = True) -> None:
        """Refuse new requests (EngineDraining) while those in flight finish; ``drain(False)`` admits again."""
        self.lifecycle.draining = draining

    # ---- the loop --------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        with self._lock:
            self._admit_handoff()  # so a caller that drives the scheduler itself sees every request
            return self.scheduler.has_work() or len(self.grammars) > 0

    def step(self) -> list[RequestOutput]:
        with self._lock:
            self._admit_handoff()
            produced = [(seq, self._finish_with(seq, err)) for seq, err in  # past a deadline (lifecycle.py), bad guide
                        [*self.lifecycle.expired(list(self._requests.values()), self.clock()), *self.grammars.failed()]]
            self.resources.before_schedule(self.scheduler)
            sched = self.scheduler.schedule()  # may offer the managers a shortfall before it preempts
            self.last_num_scheduled = len(sched.chunks)
            self.last_num_context = sum(1 for c in sched.chunks if not c.is_decode)
            self.resources.after_schedule(sum(c.num_tokens for c in sched.chunks))
            now = self.clock()
            started = 0
            for c in sched.chunks:
                if c.seq.first_scheduled_time is None:
                    c.seq.first_scheduled_time = now
                    started += 1
            self.lifecycle.observe_step(now, started, self.num_waiting() - len(self.grammars))
            if sched.chunks:
                try:
                    logits, sampled = self.executor.execute(sched.chunks)
                except Exception as exc:  # noqa: BLE001 - fail this batch's requests only
                    produced += self._fail_seqs([c.seq for c in sched.chunks], "forward", exc)
                else:
                    self.resources.after_execute(sampled, logits)  # observers only (the quality meter)
                    self.scheduler.on_executed(sched)
                    produced += self._emit(self.appender.append(sampled, logits))  # drafted chunks: accepted runs
                    if self.resources.iteration_ok:  # no manager failed at the boundary or on a shortfall
                        self.faults.iteration_ok()
                self.num_steps += 1
        self._deliver(produced)
        for listener in self._step_listeners:
            listener()
        return [out for _, out in produced]

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` from the stepping thread after every step, outside the engine lock (so it may
        call ``stats()``); idle morph ticks count, so it also sees every swap/restore and pool resize."""
        self._step_listeners.append(listener)

    def _fail_seqs(self, seqs: list[Sequence], where: str, exc: BaseException,
                   iteration_failed: bool = True) -> list[tuple[Sequence, RequestOutput]]:
        """Finish ``seqs`` with an error (their KV blocks are freed); log one event with the traceback."""
        live = [s for s in dict.fromkeys(seqs) if s.request_id in self._requests]
        if (client := guide_error(exc)) is not None:  # a guide that left no allowed token: the client's, no fault
            return [(seq, self._finish_with(seq, client)) for seq in live]
        return self._finish_with_error(live, self.faults.record(where, exc, [s.request_id for s in live],
                                                                iteration_failed))

    def _finish_with_error(self, seqs: list[Sequence], message: str) -> list[tuple[Sequence, RequestOutput]]:
        self.last_step_error = message
        return [(seq, self._finish_with(seq, EngineError(message))) for seq in seqs]

    def _finish_with(self, seq: Sequence, err: EngineError) -> RequestOutput:
        """End ``seq`` with a typed error (its KV blocks are freed): the final output carries its kind."""
        out = self._finish(seq, FinishReason.ERROR)
        out.error, out.error_kind, out.retry_after_s = err.message, err.kind, err.retry_after_s
        return out

    def _emit(self, appended: list[Appended]) -> list[tuple[Sequence, RequestOutput]]:
        """What the batch's tokens did (serve/engine/token_append.py), in order: each token counted and streamed,
        a request that stopped finished, one that failed ended with its error, then a drafted chunk's KV settled."""
        produced: list[tuple[Sequence, RequestOutput]] = []
        for a in appended:
            seq = a.seq
            for t in a.tokens:
                self._count_token(seq, a.now)
                out = (self._finish(seq, t.finish, last_token=t.token, text=t.text) if t.finish is not None
                       else self._output(seq, [t.token], final=False, text=t.text))
                if t.logprob is not None:
                    out.new_logprobs = [t.logprob]
                produced.append((seq, out))
            if a.failed is not None:
                if a.failed.token_taken:
                    self._count_token(seq, a.now)
                produced += self._fail_seqs([seq], a.failed.where, a.failed.error, iteration_failed=False)
            if a.settle is not None:
                a.settle()
        return produced

    def _count_token(self, seq: Sequence, now: float) -> None:
        """A token generated at ``now``: the engine's count, the request's token times, the managers' latency."""
        self.num_generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.resources.on_first_token(now, now - seq.arrival_time)
        elif seq.last_token_time is not None:
            self.resources.on_token_gap(now, now - seq.last_token_time)
        seq.last_token_time = now

    def _finish(self, seq: Sequence, reason: FinishReason, last_token: int | None = None,
                text: str | None = None) -> RequestOutput:
        self.scheduler.finish(seq)
        self.grammars.discard(seq)
        self._requests.pop(seq.request_id, None)
        self.resources.on_request_finished(seq.request_id)
        seq.finish_reason = reason
        new = [last_token] if last_token is not None else []
        return self._output(seq, new, final=True, text=text)

    def _output(self, seq: Sequence, new_tokens: list[int], final: bool, text: str | None = None) -> RequestOutput:
        """``text``: what the tokens released, taken as each went in (token_append.py); else the detokenizer's now."""
        return RequestOutput(request_id=seq.request_id, new_token_ids=new_tokens,
                             new_text=text if text is not None else seq.detokenizer.delta(final), finished=final,
                             finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
                             num_output_tokens=seq.num_output_tokens, arrival_time=seq.arrival_time,
                             first_token_time=seq.first_token_time, first_scheduled_time=seq.first_scheduled_time,
                             stop_reason=seq.stop_reason, priority=seq.slo.priority)

    def _deliver(self, produced: Iterable[tuple[Sequence, RequestOutput]]) -> None:
        for seq, out in produced:
            if out.finished or seq.params.perf_metrics:  # counted once the step is done (drafts settle last)
                out.metrics = seq.metrics()
            if seq.callback is not None:
                try:
                    seq.callback(out)
                except Exception as exc:  # noqa: BLE001 - a caller's bug must not stop the loop
                    self.faults.record("callback", exc, [seq.request_id], iteration_failed=False)

    # ---- background mode -------------------------------------------------------------------------
    def start_background(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="morphserve-engine", daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    def _loop(self) -> None:
        while True:
            self._handoff.work.clear()  # cleared before looking, so a request added after this wakes us
            with self._lock:
                if self._stopping:
                    return
                self._admit_handoff()
                idle = not (self.scheduler.has_work() or self.grammars.has_failures())
                at_rest = self.resources.is_at_rest() and not len(self.grammars)  # grammar waiters' deadlines tick
            if idle:  # a manager not at rest or requests waiting for a grammar: tick so that calm restores / expiry run
                woke = self._handoff.work.wait(None if at_rest else 0.05)
                if at_rest or woke:
                    continue
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - not pinned to a batch: fail what is in flight
                self._fail_all(self.faults.record("iteration", exc, list(self._requests)))

    def _fail_all(self, message: str) -> None:
        with self._lock:
            self._admit_handoff()
            produced = self._finish_with_error(list(self._requests.values()), message)
        self._deliver(produced)

    def stop(self) -> None:
        """Stop the loop thread and abort whatever is still queued or running."""
        with self._lock:
            self._stopping = True
        self._handoff.work.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        _RUNNING.discard(self)
        for rid in list(self._requests):
            self.abort_request(rid)

    # ---- convenience -----------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[dict]:
        """Run prompts to completion in this thread; returns {"text", "token_ids", "finish_reason"} per prompt."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        collect = OutputCollector()
        rids = [self.add_request(p, sp, callback=collect) for p, sp in zip(prompts, params_list)]
        while not all(collect.finished(r) for r in rids):
            if not self.step() and not self.has_unfinished_requests():
                break
            self.grammars.wait_if_idle(self.scheduler)  # only grammars compiling: wait for one rather than spin
        return [collect.results[r] for r in rids]

    def set_cache_events(self, listener: CacheEvents | None) -> None:
        """Report every change of the prefix cache to ``listener`` from now on (KV events for Dynamo's router);
        it first hears the cache root in force. Blocks registered before this are not reported."""
        with self._lock:
            if listener is not None:
                listener.root_changed(self.pool.cache_root)
            self.pool.events = listener

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (vLLM's ``LLM.reset_prefix_cache``); running requests keep their KV."""
        self.between_steps(self.pool.clear_cache)

    def stats(self) -> EngineStats:
        with self._lock:
            busy = self.scheduler.has_work()
            kv = self.scheduler.kv_cache_manager
            resources = self.resources.stats()
            ledger = self.ledger.as_dict()
            return EngineStats(
                kv_blocks_total=self.pool.num_blocks, kv_blocks_used=self.pool.num_used,
                kv_cache_usage_perc=self.pool.usage, kv_blocks_cached=self.pool.num_cached,
                kv_blocks_base=self.pool.base_blocks, block_size=self.config.block_size,
                scheduler=self.config.scheduler, num_running=len(self.scheduler.running),
                num_waiting=self.num_waiting(), max_num_seqs=self.scheduler.max_num_seqs,
                num_scheduled_last_step=self.last_num_scheduled if busy else 0,
                num_context_last_step=self.last_num_context if busy else 0,
                critical_decodes_unscheduled=getattr(self.scheduler, "num_critical_unscheduled", 0),
                num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
                num_generated_tokens=self.num_generated_tokens, prefix_cache_queries=kv.prefix_queried_tokens,
                prefix_cache_hits=kv.prefix_hit_tokens, memory=ledger, memory_held_bytes=ledger["held"],
                healthy=self.healthy, failed_iterations=self.faults.failed_iterations,
                last_step_error=self.last_step_error, resources=resources, **resource_fields(resources))

    def between_steps(self, work: Callable[[], M]) -> M:
        """``work()`` run between two iterations (the loop waits for it), e.g. an operator's measurement."""
        with self._lock:
            return work()

    def request_memory_yield(self, nbytes: int | None) -> dict:
        """The operator's yield control: keep ``nbytes`` given back to the device (or host) until cleared
        (None/0: reclaim under the reclaim rule). ValueError when this engine cannot yield."""
        yielder = self.resources.get(YieldsMemory)
        if yielder is None:
            raise ValueError(f"morph mode {self.config.morph_mode!r} holds no quantized layers and cannot yield "
                             "memory; serve a dynamic mode (default, performance, accuracy)")
        with self._lock:
            state = yielder.request_yield(nbytes)
        self._handoff.work.set()  # an idle loop wakes and ticks until the request is met
        return state

    def shutdown(self) -> None:
        self.stop()
        self.guides.close()
        self.resources.shutdown()
