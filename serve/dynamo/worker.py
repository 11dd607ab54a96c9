"""The MorphServe engine as an NVIDIA Dynamo worker (``dynamo.common.backend.LLMEngine``).

Dynamo's Rust ``Worker`` owns registration, the request plane, cancellation monitoring and shutdown; this
class owns the engine. Token ids come in (the frontend tokenized and applied the chat template with the
tokenizer directory this worker registers), token ids go out, streamed from the engine thread. A
cancelled request is aborted in the engine at once, which frees its KV blocks. Live KV capacity and usage
go to Dynamo's snapshot publisher after every engine step that changed them (so a morph transition shows
as a new ``dynamo_component_total_blocks``); the prefix cache's blocks go to the KV-aware router as KV events
(serve/dynamo/kv_events.py); the engine's metrics and the request tracker's latency histograms and finish
reasons (serve/request_tracker.py, shared with the Triton model) are bridged into the worker's ``/metrics``;
``POST /engine/control/morph_state`` on the worker's system port returns the engine's state, and the operator's
controls (serve/engine/controls.py: memory_yield, memory_reclaim, drain, resume, state) are served there too,
never through the inference path.

The engine decides each request's life (the queue deadline, shedding, timeouts, draining:
serve/engine/lifecycle.py, from the same EngineConfig fields as the Triton model) and says how a request ended
as an ErrorKind; ``dynamo_error`` maps kinds to the exceptions Dynamo 1.6.1's frontend answers with the right
status (checked against it: InvalidArgument 400, HttpError(503) 503 without migrating the request,
ConnectionTimeout 504, which the frontend also migrates, hence serve/dynamo/deadlines.py).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from dynamo.common.backend import EngineConfig as DynamoEngineConfig
from dynamo.common.backend import LLMEngine as DynamoLLMEngine
from dynamo.common.backend import LlmRegistration, WorkerConfig
from dynamo.common.backend.publisher import ComponentSnapshot, PushSource
from dynamo.llm.exceptions import Cancelled, ConnectionTimeout, EngineShutdown, HttpError, InvalidArgument, Unknown

from serve.dynamo.bridge import OutputStream
from serve.dynamo.cli import WorkerOptions, parse_worker_args
from serve.dynamo.deadlines import ExpiredContexts
from serve.dynamo.kv_events import KvEventBridge
from serve.dynamo.metrics import CapacityPublisher, KvSnapshot, RequestMetrics, exposition
from serve.dynamo.model_card import write_model_card_dir
from serve.dynamo.requests import RequestError, chunk, to_engine_request
from serve.engine import LLMEngine
from serve.engine.controls import CONTROLS, ControlError, run_control
from serve.engine.errors import error_kind, retry_after_of
from serve.engine.stats import EngineStats
from serve.error_kinds import ErrorKind
from serve.logging_setup import configure_logging, get_logger
from serve.operator_auth import AuthError, check_bind, from_env
from serve.request_tracker import CANCELLED, OVERLOADED, RequestTracker

log = get_logger("morphserve.dynamo.worker")
MORPH_STATE_CONTROL = "morph_state"  # the engine's stats and what the worker published (the others: CONTROLS)


def dynamo_error(kind: ErrorKind, message: str) -> Exception:
    """The exception Dynamo's frontend answers with this kind's status (OpenAI-style error object)."""
    if kind is ErrorKind.INVALID_INPUT:
        return InvalidArgument(message)                    # 400, the message kept
    if kind in (ErrorKind.OVERLOADED, ErrorKind.DRAINING, ErrorKind.UNAVAILABLE):
        return HttpError(503, message)                     # 503 (1.6.1 drops the message and any Retry-After)
    if kind is ErrorKind.DEADLINE_EXCEEDED:
        return ConnectionTimeout(message)                  # 504 "Request deadline exceeded"
    if kind is ErrorKind.CANCELLED:
        return Cancelled(message)                          # 499
    return Unknown(message)                                # 500


class MorphServeWorker(DynamoLLMEngine):
    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.engine: LLMEngine | None = None
        self.card_dir = card_dir(options)
        self.capacity = CapacityPublisher(self._stats_or_none)
        self.registered_total_blocks: int | None = None
        self.kv_events: KvEventBridge | None = None  # the prefix cache, told to Dynamo's KV-aware router
        self._inflight: dict[str, str] = {}  # Dynamo context id -> engine request id
        self.request_metrics = RequestMetrics()
        self.tracker = RequestTracker(self.request_metrics)  # TTFT, ITL, e2e, finish reasons per request
        self.expired = ExpiredContexts()  # contexts past their deadline: the frontend's retries of them fail at once
        # the operator key: every control on the system port signed with it (serve/operator_auth.py, in the body:
        # Dynamo hands the worker the parsed JSON only); without it the system port must stay on loopback
        self.auth = from_env()
        check_bind(os.environ.get("DYN_SYSTEM_HOST", "127.0.0.1"), self.auth, "the Dynamo system port")

    # ---- lifecycle ---------------------------------------------------------------------------------
    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[MorphServeWorker, WorkerConfig]:
        options = parse_worker_args(argv)
        configure_logging(options.log_level)
        worker = cls(options)
        config = WorkerConfig(
            namespace=options.namespace, component=options.component, endpoint=options.endpoint,
            model_name=str(worker.card_dir), served_model_name=options.served_model_name,
            discovery_backend=options.discovery_backend, request_plane=options.request_plane,
            event_plane=options.event_plane,
        )
        return worker, config

    async def start(self, worker_id: int) -> DynamoEngineConfig:
        opts = self.options
        try:
            self.engine = await asyncio.to_thread(LLMEngine, opts.engine)
        except Exception as exc:  # noqa: BLE001 - a bad model or budget must say why the worker did not start
            raise EngineShutdown(f"engine failed to start: {type(exc).__name__}: {exc}") from exc
        engine = self.engine
        write_model_card_dir(self.card_dir, engine.tokenizer, engine.model_config, engine.max_model_len)
        engine.add_step_listener(self.capacity.on_step)
        self.capacity.on_step()  # the gauges have values before the first step
        if engine.config.enable_prefix_caching:  # no cache, no events: the router scores load only
            self.kv_events = KvEventBridge()
            engine.set_cache_events(self.kv_events)
            engine.add_step_listener(self.kv_events.flush)
        engine.start_background()
        stats = engine.stats()
        self.registered_total_blocks = int(stats.kv_blocks_total)
        log.info("dynamo_worker_started", worker_id=format(worker_id, "x"), model=opts.engine.model,
                 served_model_name=opts.served_model_name, morph_mode=opts.engine.morph_mode,
                 kv_blocks_total=stats.kv_blocks_total, max_model_len=engine.max_model_len, card_dir=str(self.card_dir))
        return DynamoEngineConfig(
            model=str(self.card_dir), served_model_name=opts.served_model_name,
            llm=LlmRegistration(context_length=engine.max_model_len, kv_cache_block_size=engine.config.block_size,
                                total_kv_blocks=self.registered_total_blocks, max_num_seqs=engine.config.max_num_seqs,
                                max_num_batched_tokens=engine.config.max_num_batched_tokens),
        )

    async def kv_event_sources(self) -> list[Any]:
        """Dynamo builds a KvEventPublisher (block size: the registration's) and hands it to the bridge."""
        return [] if self.kv_events is None else [PushSource(on_ready=self.kv_events.attach, dp_rank=0)]

    async def cleanup(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)
            log.info("dynamo_worker_stopped")

    # ---- requests ----------------------------------------------------------------------------------
    async def generate(self, request: dict[str, Any], context: Any) -> AsyncGenerator[dict[str, Any], None]:
        arrival = time.perf_counter()
        engine = self.engine
        if engine is None:
            raise EngineShutdown("the engine is not running")
        eos = set(engine.model_config.eos_token_ids) | set(request.get("eos_token_ids") or [])
        expired = self.expired.get(context.id())
        if expired is not None:  # the frontend migrating a request whose deadline passed here: no new deadline
            raise dynamo_error(ErrorKind.DEADLINE_EXCEEDED, expired)
        try:
            mapped = to_engine_request(request, eos, self.options.default_max_tokens)
        except (RequestError, ValueError, TypeError) as exc:
            raise InvalidArgument(str(exc)) from None
        stream = OutputStream(asyncio.get_running_loop())
        rid = f"{context.id()}-{uuid.uuid4().hex[:8]}"
        self.tracker.start(rid, arrival)
        try:  # the engine decides admission (draining, shedding, its queue bound) and the deadlines
            await asyncio.to_thread(engine.add_request, mapped.prompt_token_ids, mapped.params, request_id=rid,
                                    callback=stream.push,
                                    arrival_time=engine.clock() - (time.perf_counter() - arrival))
        except BaseException as exc:  # every refusal is answered by its kind
            self.tracker.forget(rid)  # never admitted: an error answer, not a finished request
            if not isinstance(exc, Exception):  # the generator is being cancelled
                raise
            kind = error_kind(exc)
            if kind is ErrorKind.OVERLOADED:
                self.tracker.refused(OVERLOADED)
            log.info("request_refused", request_id=rid, kind=kind.value, error=str(exc),
                     retry_after_s=retry_after_of(exc))
            raise dynamo_error(kind, str(exc)) from None
        self._inflight[context.id()] = rid
        try:
            async for out in stream:
                self.tracker.on_output(out)  # timed as the worker's event loop sees it
                if not out.finished:
                    if out.new_token_ids:
                        yield chunk(out.new_token_ids)
                    continue
                reason = out.finish_reason.value if out.finish_reason is not None else None
                kind = out.error_kind
                if kind is not None and kind is not ErrorKind.CANCELLED:  # ended early by the engine: by its kind
                    if kind is ErrorKind.DEADLINE_EXCEEDED:
                        self.expired.add(context.id(), out.error or "deadline exceeded")
                    message = out.error or kind.value
                    log.info("request_ended", request_id=rid, kind=kind.value, error=message)
                    raise dynamo_error(kind, f"generation failed: {message}" if kind is ErrorKind.INTERNAL else message)
                yield chunk(out.new_token_ids, reason, out.num_prompt_tokens, out.num_output_tokens, out,
                            engine.config.block_size)
        finally:
            self._inflight.pop(context.id(), None)
            if not stream.finished:  # the client went away or the stream was closed: free the KV blocks now,
                # from a thread (abort waits for the engine lock; the event loop keeps streaming meanwhile)
                self.tracker.finish(rid, CANCELLED)
                try:
                    asyncio.get_running_loop().run_in_executor(None, self._abort, engine, rid)
                except RuntimeError:  # no running loop (the generator is being collected at shutdown)
                    self._abort(engine, rid)

    async def abort(self, context: Any) -> None:
        rid = self._inflight.get(context.id())
        if rid is not None and self.engine is not None:
            self.tracker.finish(rid, CANCELLED)  # before the engine's own final output (abort) can count it
            aborted = await asyncio.to_thread(self._abort, self.engine, rid)
            log.info("request_aborted", request_id=rid, was_running=aborted)

    def _abort(self, engine: LLMEngine, rid: str) -> bool:
        """Abort (frees the KV blocks) and publish the freed capacity now, not at the next engine step."""
        aborted = engine.abort_request(rid)
        if aborted:
            self.capacity.on_step()
        return aborted

    # ---- metrics and controls ----------------------------------------------------------------------
    def _stats_or_none(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        def publish(snap: KvSnapshot) -> None:
            publisher.publish(0, ComponentSnapshot(kv_used_blocks=snap.used_blocks, kv_total_blocks=snap.total_blocks,
                                                   gpu_cache_usage=snap.usage, dp_rank=0, kv_cache_hit_rate=None))
        self.capacity.attach(publish)

    async def register_prometheus(self, metrics: Any) -> None:
        labels = dict(getattr(metrics, "auto_labels", None) or {})

        def render() -> str:  # called on a runtime thread per scrape: the stats of the last step, no engine lock
            stats = self.capacity.last_stats
            engine = exposition(stats, labels) if stats is not None else ""
            return engine + self.request_metrics.exposition(labels)
        metrics.register_prometheus_expfmt_callback(render)

    def supported_controls(self) -> set[str]:
        return {MORPH_STATE_CONTROL, *CONTROLS}

    async def engine_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.auth is not None:
            try:
                body = self.auth.check_body(f"/engine/control/{control}", body or {})
            except AuthError as exc:
                log.warning("operator_request_refused", control=control, reason=str(exc))
                return {"status": "error", "code": 401, "message": str(exc)}
        if control in CONTROLS:
            return await self._operator_control(control, body)
        if control != MORPH_STATE_CONTROL:
            return {"status": "error", "message": f"unsupported engine control: {control}"}
        stats = await asyncio.to_thread(self._stats_or_none)
        if stats is None:
            return {"status": "error", "message": "the engine is not running"}
        last = self.capacity.last
        return {
            "status": "ok", "morph_mode": self.options.engine.morph_mode, "stats": stats.as_dict(),
            "registered_total_kv_blocks": self.registered_total_blocks,
            "published": {"snapshots": self.capacity.published,
                          "kv_total_blocks": last.total_blocks if last else None,
                          "kv_used_blocks": last.used_blocks if last else None},
        }


    async def _operator_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        """The operator's controls (serve/engine/controls.py), on the system port only."""
        engine = self.engine
        if engine is None:
            return {"status": "error", "message": "the engine is not running"}
        try:
            answer = await asyncio.to_thread(run_control, engine, control, body)
        except ControlError as exc:
            return {"status": "error", "message": str(exc)}
        log.info("operator_control", control=control, body=body)
        return answer


def card_dir(options: WorkerOptions) -> Path:
    """Where the tokenizer card goes. The frontend accepts a second worker for a model only if its card is
    identical to the first one's, path included, so every worker of a model must use the same path (on
    every machine): --model-card-dir, or by default one derived from the served model name. It is left in
    place at exit (other workers may still be registered with it)."""
    if options.model_card_dir:
        return Path(options.model_card_dir).resolve()
    return Path(tempfile.gettempdir()) / f"morphserve-dynamo-card-{options.served_model_name}"


def main(argv: list[str] | None = None) -> None:
    from dynamo.common.backend.run import run  # noqa: PLC0415

    run(MorphServeWorker, argv)
