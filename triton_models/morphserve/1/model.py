"""Triton Python-backend model hosting one MorphServe engine (decoupled, streaming).

Threads in this stub process:
- Triton's execute() thread: validates each request, registers it, hands it to the engine, returns.
- the engine loop thread (``engine.start_background()``): runs steps; its per-request callback only
  enqueues ``(RequestOutput, timestamp)`` so the loop never waits on IPC to the server.
- ``morphserve-responder``: drains that queue and sends responses through each request's
  ``response_sender`` (one per token group with stream=true, one in all otherwise; the last carries
  TRITONSERVER_RESPONSE_COMPLETE_FINAL), records TTFT/ITL, and polls ``request.is_cancelled()`` to
  abort cancelled requests in the engine at once (which frees their KV blocks).
- ``morphserve-metrics``: refreshes the gauges from ``engine.stats()`` (which waits for the engine
  lock, so it must not run on the responder thread).

Every bad input is answered with a TritonError response carrying the FINAL flag; nothing in
execute() is allowed to raise, so one bad request never takes the model down.
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import sys
import threading
import time
import types
import typing
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:  # a plain checkout without `pip install -e .`
    sys.path.append(str(REPO_ROOT))

from serve.logging_setup import configure_logging, get_logger  # noqa: E402

log = get_logger("triton_model")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

# Parameters consumed here rather than passed to EngineConfig.
_MODEL_ONLY_PARAMS = {"engine_dir", "max_tokens_limit", "default_max_tokens", "poll_interval_s", "log_level"}
# config.pbtxt parameter -> EngineConfig field, where the names differ.
_PARAM_ALIASES = {"engine_dir": "model"}

# Histogram buckets (seconds): vLLM's, with finer low buckets for small models on CPU.
_TTFT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0]
_E2E_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0]


try:
    from policy import KNOWN_PRECISIONS as _KNOWN_PRECISIONS
except ImportError:  # pragma: no cover - policy package absent
    _KNOWN_PRECISIONS = ("fp8", "int8", "int4")


class InputError(ValueError):
    """A request the model refuses; the message goes back to the client verbatim."""


# --------------------------------------------------------------------------------------------------
# Parameters -> EngineConfig
# --------------------------------------------------------------------------------------------------


def _coerce(raw: str, hint: Any, name: str) -> Any:
    """Convert a config.pbtxt string to the type of an EngineConfig field (``int | None`` etc.)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else str
    try:
        if hint is bool:
            low = raw.strip().lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return low in ("true", "1", "yes")
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
    except ValueError:
        raise ValueError(f"model parameter {name}={raw!r} is not a valid {getattr(hint, '__name__', hint)}") from None
    return raw


def engine_config_kwargs(params: dict[str, str], config_cls: type, repo_root: Path) -> tuple[dict[str, Any], list[str]]:
    """Map config.pbtxt parameters onto ``config_cls`` fields; empty strings mean "engine default".

    Returns (kwargs, ignored parameter names). Relative paths in engine_dir are resolved against the
    repository root so the server does not depend on its working directory.
    """
    hints = typing.get_type_hints(config_cls)
    fields = {f.name for f in dataclasses.fields(config_cls)}
    kwargs: dict[str, Any] = {}
    ignored: list[str] = []
    for key, raw in params.items():
        field = _PARAM_ALIASES.get(key, key)
        if raw == "" or (key in _MODEL_ONLY_PARAMS and key not in _PARAM_ALIASES):
            continue
        if field not in fields:
            ignored.append(key)
            continue
        value = _coerce(raw, hints.get(field, str), key)
        if field == "model" and isinstance(value, str):
            p = Path(value).expanduser()
            if not p.is_absolute() and (repo_root / p).exists():
                value = str(repo_root / p)
        kwargs[field] = value
    return kwargs, ignored


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


class _Histogram:
    """A Prometheus histogram; falls back to ``<name>_sum``/``<name>_count`` counters when the Python
    backend has no HISTOGRAM kind (it has one in Triton 2.51)."""

    def __init__(self, families: list[Any], name: str, description: str, labels: dict[str, str],
                 buckets: list[float]) -> None:
        if hasattr(pb_utils.MetricFamily, "HISTOGRAM"):
            fam = pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.HISTOGRAM)
            families.append(fam)
            self._hist = fam.Metric(labels=labels, buckets=buckets)
            self._sum = self._count = None
        else:  # pragma: no cover - older Triton
            self._hist = None
            fs = pb_utils.MetricFamily(name=f"{name}_sum", description=description, kind=pb_utils.MetricFamily.COUNTER)
            fc = pb_utils.MetricFamily(name=f"{name}_count", description=description, kind=pb_utils.MetricFamily.COUNTER)
            families += [fs, fc]
            self._sum, self._count = fs.Metric(labels=labels), fc.Metric(labels=labels)

    def observe(self, value: float) -> None:
        if self._hist is not None:
            self._hist.observe(value)
        else:  # pragma: no cover
            self._sum.increment(value)
            self._count.increment(1)


class Metrics:
    """The model's Prometheus families (project prefix ``morphserve_``), fed from engine.stats() and
    from the responder thread's per-request timings."""

    def __init__(self, model_name: str, version: str) -> None:
        # MetricFamily objects must stay referenced: a collected family disappears from /metrics.
        self._families: list[Any] = []
        self._labels = {"model": model_name, "version": version}
        self._lock = threading.Lock()
        g = self._family_metric
        self.kv_usage = g("morphserve_kv_cache_usage_perc", "KV-cache usage: used / total blocks (0-1).", "GAUGE")
        self.kv_used = g("morphserve_kv_blocks_used", "KV-cache blocks in use.", "GAUGE")
        self.kv_total = g("morphserve_kv_blocks_total", "KV-cache blocks in the pool (grows when layers are quantized).", "GAUGE")
        self.running = g("morphserve_num_requests_running", "Requests in the running batch.", "GAUGE")
        self.waiting = g("morphserve_num_requests_waiting", "Requests waiting to be scheduled.", "GAUGE")
        self.swaps = g("morphserve_swaps_total", "Layers swapped to a quantized variant.", "COUNTER")
        self.restores = g("morphserve_restores_total", "Layers restored to full precision.", "COUNTER")
        self.prompt_tokens = g("morphserve_prompt_tokens_total", "Prompt tokens of finished requests.", "COUNTER")
        self.generation_tokens = g("morphserve_generation_tokens_total", "Generated tokens.", "COUNTER")
        self.ttft = _Histogram(self._families, "morphserve_time_to_first_token_seconds",
                               "Time from request arrival at the model to its first token.", self._labels, _TTFT_BUCKETS)
        self.itl = _Histogram(self._families, "morphserve_inter_token_latency_seconds",
                              "Gap between consecutive tokens of a request.", self._labels, _ITL_BUCKETS)
        self.e2e = _Histogram(self._families, "morphserve_e2e_request_latency_seconds",
                              "Time from request arrival at the model to its final response.", self._labels, _E2E_BUCKETS)
        self._layers_family = self._new_family("morphserve_layers_quantized",
                                               "Decoder layers currently held in each quantized precision.", "GAUGE")
        self._layers: dict[str, Any] = {}
        for precision in _KNOWN_PRECISIONS:  # present (at 0) from the start, for dashboards
            self._layers[precision] = self._layers_family.Metric(labels={**self._labels, "precision": precision})
            self._layers[precision].set(0.0)
        self._finished_family = self._new_family("morphserve_requests_finished_total",
                                                 "Finished requests by finish reason.", "COUNTER")
        self._finished: dict[str, Any] = {}
        self._last_swaps = 0.0
        self._last_restores = 0.0

    def _new_family(self, name: str, description: str, kind: str) -> Any:
        fam = pb_utils.MetricFamily(name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind))
        self._families.append(fam)
        return fam

    def _family_metric(self, name: str, description: str, kind: str) -> Any:
        return self._new_family(name, description, kind).Metric(labels=self._labels)

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        """Copy engine.stats() into the gauges; totals become counter increments."""
        with self._lock:
            self.kv_usage.set(float(stats.get("kv_cache_usage_perc", 0.0)))
            self.kv_used.set(float(stats.get("kv_blocks_used", 0)))
            self.kv_total.set(float(stats.get("kv_blocks_total", 0)))
            self.running.set(float(stats.get("num_running", 0)))
            self.waiting.set(float(stats.get("num_waiting", 0)))
            layers = dict(stats.get("layers_quantized") or {})
            for precision in set(layers) | set(self._layers):
                m = self._layers.get(precision)
                if m is None:
                    m = self._layers[precision] = self._layers_family.Metric(
                        labels={**self._labels, "precision": str(precision)})
                m.set(float(layers.get(precision, 0)))
            swaps = float(stats.get("swaps_total", 0))
            if swaps > self._last_swaps:
                self.swaps.increment(swaps - self._last_swaps)
                self._last_swaps = swaps
            restores = float(stats.get("restores_total", 0))
            if restores > self._last_restores:
                self.restores.increment(restores - self._last_restores)
                self._last_restores = restores

    def request_finished(self, reason: str, prompt_tokens: int) -> None:
        with self._lock:
            m = self._finished.get(reason)
            if m is None:
                m = self._finished[reason] = self._finished_family.Metric(labels={**self._labels, "finish_reason": reason})
            m.increment(1)
            if prompt_tokens > 0:
                self.prompt_tokens.increment(prompt_tokens)


# --------------------------------------------------------------------------------------------------
# Request parsing
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ParsedRequest:
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    ignore_eos: bool = False


def _scalar(request: Any, name: str, kind: str) -> Any:
    """The single element of an optional input, or None when absent. ``kind`` names the expected type
    for error messages; Triton has already checked the data type against config.pbtxt."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    arr = t.as_numpy()
    if arr.size != 1:
        raise InputError(f"{name} must hold exactly one {kind}, got a tensor of shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _utf8(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(
                f"{name} is not valid UTF-8: byte 0x{bytes(value)[e.start]:02x} at position {e.start} "
                f"({e.reason}); send the text UTF-8 encoded"
            ) from None
    raise InputError(f"{name} must be a string, got {type(value).__name__}")


def parse_request(request: Any, max_tokens_limit: int, default_max_tokens: int) -> ParsedRequest:
    """Validate a Triton request's inputs; raise InputError with a message meant for the client."""
    t = pb_utils.get_input_tensor_by_name(request, "text_input")
    if t is None:
        raise InputError("missing required input 'text_input' (TYPE_STRING, shape [1]): the prompt text")
    arr = t.as_numpy()
    if arr.size != 1:
        raise InputError(f"text_input must hold exactly one string, got a tensor of shape {list(arr.shape)}")
    prompt = _utf8(arr.reshape(-1)[0], "text_input")
    if not prompt:
        raise InputError("text_input is empty")

    mt = _scalar(request, "max_tokens", "INT32")
    max_tokens = default_max_tokens if mt is None else int(mt)
    if max_tokens <= 0:
        raise InputError(f"max_tokens must be a positive integer, got {max_tokens}")
    if max_tokens > max_tokens_limit:
        raise InputError(f"max_tokens={max_tokens} exceeds this server's limit (max_tokens_limit={max_tokens_limit})")

    temp = _scalar(request, "temperature", "FP32")
    temperature = 0.0 if temp is None else float(temp)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise InputError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")

    tp = _scalar(request, "top_p", "FP32")
    top_p = 1.0 if tp is None else float(tp)
    if not (0.0 < top_p <= 1.0):
        raise InputError(f"top_p must be in (0, 1], got {top_p}")

    tk = _scalar(request, "top_k", "INT32")
    top_k = 0 if tk is None else int(tk)
    if top_k < 0:
        raise InputError(f"top_k must be >= 0 (0 disables top-k), got {top_k}")

    sd = _scalar(request, "seed", "UINT64")
    seed = None if sd is None else int(sd)

    stop: tuple[str, ...] = ()
    st = pb_utils.get_input_tensor_by_name(request, "stop")
    if st is not None:
        stop = tuple(_utf8(v, "stop") for v in st.as_numpy().reshape(-1))
        if any(s == "" for s in stop):
            raise InputError("stop strings must be non-empty")

    sm = _scalar(request, "stream", "BOOL")
    stream = bool(sm) if sm is not None else False
    ie = _scalar(request, "ignore_eos", "BOOL")
    ignore_eos = bool(ie) if ie is not None else False
    return ParsedRequest(prompt, max_tokens, temperature, top_p, top_k, seed, stop, stream, ignore_eos)


# --------------------------------------------------------------------------------------------------
# In-flight requests
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _InFlight:
    request_id: str
    client_request_id: str
    request: Any
    sender: Any
    stream: bool
    arrival: float
    parts: list[str] = dataclasses.field(default_factory=list)
    last_token_time: float | None = None
    first_token_time: float | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0


def _response(text: str, num_input: int, num_output: int, finish_reason: str) -> Any:
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("num_input_tokens", np.array([num_input], dtype=np.int32)),
            pb_utils.Tensor("num_output_tokens", np.array([num_output], dtype=np.int32)),
            pb_utils.Tensor("finish_reason", np.array([finish_reason.encode("utf-8")], dtype=np.object_)),
        ]
    )


def _error_response(message: str, code: Any = None) -> Any:
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    """Triton entry points: initialize / execute / finalize."""

    def initialize(self, args: dict[str, str]) -> None:
        self.model_config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", self.model_config.get("name", "morphserve"))
        self.model_version = str(args.get("model_version", "1"))
        params = {k: v.get("string_value", "") for k, v in self.model_config.get("parameters", {}).items()}
        configure_logging(params.get("log_level") or "info")
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("morphserve needs model_transaction_policy { decoupled: true }")

        def int_param(key: str, default: int) -> int:
            raw = params.get(key, "")
            try:
                return int(raw) if raw else default
            except ValueError:
                raise pb_utils.TritonModelException(f"model parameter {key}={raw!r} is not an integer") from None

        self.max_tokens_limit = int_param("max_tokens_limit", 4096)
        self.default_max_tokens = int_param("default_max_tokens", 16)
        self.poll_interval_s = float(params.get("poll_interval_s") or 0.02)

        from serve.config import EngineConfig  # noqa: PLC0415 - heavy imports after logging is set up
        from serve.engine import LLMEngine  # noqa: PLC0415
        from serve.sampling_params import SamplingParams  # noqa: PLC0415

        self._SamplingParams = SamplingParams
        kwargs, ignored = engine_config_kwargs(params, EngineConfig, REPO_ROOT)
        if ignored:
            log.warning("parameters_ignored", parameters=sorted(ignored),
                        reason="not a field of this engine's EngineConfig")
        t0 = time.perf_counter()
        self.engine = LLMEngine(EngineConfig(**kwargs))
        log.info("engine_loaded", model=self.model_name, config=kwargs, load_s=round(time.perf_counter() - t0, 3),
                 max_model_len=self.engine.max_model_len)

        self.metrics = Metrics(self.model_name, self.model_version)
        self._inflight: dict[str, _InFlight] = {}
        self._lock = threading.Lock()
        self._events: queue.SimpleQueue[tuple[Any, float] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._stats_dirty = threading.Event()
        self.engine.start_background()
        self._responder = threading.Thread(target=self._responder_loop, name="morphserve-responder", daemon=True)
        self._metrics_thread = threading.Thread(target=self._metrics_loop, name="morphserve-metrics", daemon=True)
        self._responder.start()
        self._metrics_thread.start()

    # ---- execute -------------------------------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        """Decoupled: register each request with the engine and return; responses come later."""
        for request in requests:
            try:
                self._admit(request)
            except Exception as exc:  # noqa: BLE001 - never let one request take the model down
                log.exception("execute_failed", error=str(exc))
                try:
                    request.get_response_sender().send(
                        _error_response(f"internal error: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL),
                        flags=FINAL)
                except Exception:  # noqa: BLE001 - sender already closed
                    pass
        return None

    def _admit(self, request: Any) -> None:
        arrival = time.perf_counter()
        sender = request.get_response_sender()
        request_id = uuid.uuid4().hex
        client_id = request.request_id() or ""
        try:
            parsed = parse_request(request, self.max_tokens_limit, self.default_max_tokens)
            params = self._SamplingParams(
                max_tokens=parsed.max_tokens, temperature=parsed.temperature, top_p=parsed.top_p,
                top_k=parsed.top_k, seed=parsed.seed, stop=parsed.stop,
                ignore_eos=parsed.ignore_eos)
        except (InputError, ValueError, TypeError) as exc:
            self._reject(sender, request_id, client_id, str(exc))
            return
        inflight = _InFlight(request_id, client_id, request, sender, parsed.stream, arrival)
        with self._lock:
            self._inflight[request_id] = inflight
        try:
            self.engine.add_request(parsed.prompt, params, request_id=request_id, callback=self._on_output)
        except (ValueError, TypeError) as exc:  # e.g. prompt longer than the context
            with self._lock:
                self._inflight.pop(request_id, None)
            self._reject(sender, request_id, client_id, str(exc))
            return
        log.info("request_added", request_id=request_id, client_request_id=client_id, max_tokens=parsed.max_tokens,
                 temperature=parsed.temperature, stream=parsed.stream, prompt_chars=len(parsed.prompt))
        self._stats_dirty.set()

    def _reject(self, sender: Any, request_id: str, client_id: str, message: str) -> None:
        log.info("request_rejected", request_id=request_id, client_request_id=client_id, error=message)
        sender.send(_error_response(message), flags=FINAL)

    # ---- engine callback (engine loop thread) ----------------------------------------------------
    def _on_output(self, out: Any) -> None:
        self._events.put((out, time.perf_counter()))

    # ---- responder thread ------------------------------------------------------------------------
    def _responder_loop(self) -> None:
        next_cancel_check = 0.0
        while True:
            # Poll fast only while requests are in flight (cancellation checks); idle, wake rarely.
            timeout = self.poll_interval_s if self._inflight else 0.5
            try:
                item = self._events.get(timeout=timeout)
            except queue.Empty:
                item = False
            if item is None:  # finalize()
                return
            if item is not False:
                self._handle_safely(*item)
                # Drain what else is ready before checking cancellations again.
                while True:
                    try:
                        item = self._events.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    self._handle_safely(*item)
            now = time.perf_counter()
            if now >= next_cancel_check:
                self._check_cancellations()
                next_cancel_check = now + self.poll_interval_s

    def _handle_safely(self, out: Any, t: float) -> None:
        try:
            self._handle(out, t)
        except Exception as exc:  # noqa: BLE001 - keep the responder alive for the other requests
            log.exception("respond_failed", request_id=getattr(out, "request_id", None), error=str(exc))
            with self._lock:
                inflight = self._inflight.pop(getattr(out, "request_id", ""), None)
            if inflight is not None:
                self.engine.abort_request(inflight.request_id)
                try:
                    inflight.sender.send(_error_response(f"internal error: {exc}", pb_utils.TritonError.INTERNAL),
                                         flags=FINAL)
                except Exception:  # noqa: BLE001
                    pass

    def _handle(self, out: Any, t: float) -> None:
        with self._lock:
            inflight = self._inflight.get(out.request_id)
            if inflight is not None and out.finished:
                del self._inflight[out.request_id]
        if inflight is None:  # already answered (cancelled, or failed)
            return
        n_new = len(out.new_token_ids)
        if n_new:
            if inflight.last_token_time is None:
                inflight.first_token_time = t
                self.metrics.ttft.observe(t - inflight.arrival)
            else:
                gap = (t - inflight.last_token_time) / n_new
                for _ in range(n_new):
                    self.metrics.itl.observe(gap)
            inflight.last_token_time = t
            self.metrics.generation_tokens.increment(n_new)
        inflight.num_input_tokens = out.num_prompt_tokens
        inflight.num_output_tokens = out.num_output_tokens
        reason = out.finish_reason.value if out.finish_reason is not None else ""

        if out.finished and (out.error or reason == "error"):
            inflight.sender.send(_error_response(f"generation failed: {out.error or 'unknown error'}",
                                                 pb_utils.TritonError.INTERNAL), flags=FINAL)
            self._finished(inflight, reason or "error", t, error=out.error)
            return
        if inflight.stream:
            if out.new_text or out.finished:
                inflight.sender.send(_response(out.new_text, out.num_prompt_tokens, out.num_output_tokens,
                                               reason if out.finished else ""),
                                     flags=FINAL if out.finished else 0)
        else:
            if out.new_text:
                inflight.parts.append(out.new_text)
            if out.finished:
                inflight.sender.send(_response("".join(inflight.parts), out.num_prompt_tokens,
                                               out.num_output_tokens, reason), flags=FINAL)
        if out.finished:
            self._finished(inflight, reason, t)

    def _finished(self, inflight: _InFlight, reason: str, t: float, error: str | None = None) -> None:
        e2e = t - inflight.arrival
        self.metrics.e2e.observe(e2e)
        self.metrics.request_finished(reason or "unknown", inflight.num_input_tokens)
        ttft = None if inflight.first_token_time is None else round(inflight.first_token_time - inflight.arrival, 6)
        log.info("request_finished", request_id=inflight.request_id, client_request_id=inflight.client_request_id,
                 finish_reason=reason, num_input_tokens=inflight.num_input_tokens,
                 num_output_tokens=inflight.num_output_tokens, ttft_s=ttft, e2e_s=round(e2e, 6), error=error)
        self._stats_dirty.set()

    def _check_cancellations(self) -> None:
        with self._lock:
            candidates = list(self._inflight.values())
        for inflight in candidates:
            try:
                cancelled = inflight.request.is_cancelled()
            except Exception:  # noqa: BLE001 - request already released
                cancelled = False
            if not cancelled:
                continue
            with self._lock:
                if self._inflight.pop(inflight.request_id, None) is None:
                    continue  # finished meanwhile
            aborted = self.engine.abort_request(inflight.request_id)  # frees its KV blocks now
            log.info("request_cancelled", request_id=inflight.request_id,
                     client_request_id=inflight.client_request_id, num_output_tokens=inflight.num_output_tokens,
                     aborted_in_engine=aborted)
            self.metrics.request_finished("cancelled", inflight.num_input_tokens)
            try:
                inflight.sender.send(_error_response("request cancelled by the client",
                                                     pb_utils.TritonError.CANCELLED), flags=FINAL)
            except Exception:  # noqa: BLE001 - the stream may be gone already
                pass
            self._stats_dirty.set()

    # ---- metrics thread --------------------------------------------------------------------------
    def _metrics_loop(self) -> None:
        interval = max(self.poll_interval_s, 0.25)
        while not self._stop.is_set():
            self._stats_dirty.wait(timeout=interval)
            self._stats_dirty.clear()
            if self._stop.is_set():
                return
            try:
                self.metrics.update_from_stats(self.engine.stats())
            except Exception as exc:  # noqa: BLE001
                log.exception("metrics_update_failed", error=str(exc))
                time.sleep(interval)

    # ---- finalize --------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Stop the engine loop and the helper threads; answer what is still in flight."""
        log.info("finalize", model=self.model_name)
        self._stop.set()
        self._stats_dirty.set()
        self.engine.stop()
        self._events.put(None)
        self._responder.join(timeout=5)
        self._metrics_thread.join(timeout=5)
        with self._lock:
            leftovers = list(self._inflight.values())
            self._inflight.clear()
        for inflight in leftovers:
            try:
                inflight.sender.send(_error_response("server shutting down", pb_utils.TritonError.UNAVAILABLE),
                                     flags=FINAL)
            except Exception:  # noqa: BLE001
                pass
