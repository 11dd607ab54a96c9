"""Triton Python-backend model hosting one MorphServe engine (decoupled, streaming): glue only.

The engine decides each request's life (admission bound, shedding on arrival, the queue deadline, timeout_s,
cancellation, draining: serve/engine/lifecycle.py) and says how a request ended as an ErrorKind; this file maps
kinds to Triton's error codes and the message tag the HTTP front end and gRPC clients read (serve/triton/errors.py).

Threads in this stub process:
- Triton's execute() thread: validates each request, hands it to the engine with its arrival (the HTTP front end's,
  when it came through the front end), returns.
- the engine loop thread (``engine.start_background()``): runs steps; its per-request callback only
  enqueues ``(RequestOutput, timestamp)`` so the loop never waits on IPC to the server.
- ``morphserve-responder``: drains that queue and sends responses through each request's ``response_sender`` (one per
  token group with stream=true, one in all otherwise; the last carries TRITONSERVER_RESPONSE_COMPLETE_FINAL, an error
  one when the engine ended the request early), hands each output to the request tracker (TTFT, ITL, finish reasons:
  serve/request_tracker.py, shared with the Dynamo worker), and polls ``request.is_cancelled()`` to abort cancelled
  requests in the engine at once (which frees their KV blocks).
- ``morphserve-metrics``: refreshes the gauges from ``engine.stats()`` (it takes the engine lock: not the responder).
- ``morphserve-operator`` (with an ``operator_port``): the operator's controls, loopback only
  (serve/triton/operator_port.py); the inference ports refuse them (serve/triton/controls.py).
- ``morphserve-watchdog``: ends the process at once when tritonserver is gone (serve/triton/stale.py).

Every bad input is answered with a TritonError response carrying the FINAL flag; nothing in
execute() is allowed to raise, so one bad request never takes the model down.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

REPO_ROOT = Path(__file__).resolve().parents[3]
if (REPO_ROOT / "serve").is_dir() and str(REPO_ROOT) not in sys.path:  # checkout-fallback: a plain checkout
    sys.path.append(str(REPO_ROOT))  # checkout-fallback (python -m serve.triton --write-repository drops these)

from serve.engine.errors import error_kind, retry_after_of  # noqa: E402 - light (no torch)
from serve.error_kinds import ErrorKind  # noqa: E402
from serve.logging_setup import configure_logging, get_logger  # noqa: E402
from serve.operator_auth import from_env  # noqa: E402
from serve.request_tracker import OVERLOADED, RequestTracker, TrackedRequest  # noqa: E402
from serve.triton.controls import cancel_target, front_end_arrival  # noqa: E402
from serve.triton.errors import TRITON_CODE, tagged  # noqa: E402
from serve.triton.llmapi import perf_metric_arrays  # noqa: E402
from serve.triton.llmapi_config import ModelYamlError, parse_model_yaml  # noqa: E402
from serve.triton.metrics import Metrics  # noqa: E402
from serve.triton.model_params import ServerParams, engine_config_kwargs  # noqa: E402
from serve.triton.operator_port import OperatorPort  # noqa: E402
from serve.triton.request_inputs import InputError, InputLimits, answered_outputs, parse_request, parse_slo_inputs  # noqa: E402
from serve.triton.stale import exit_with_parent  # noqa: E402
from serve.triton.trtllm import with_parameters  # noqa: E402

log = get_logger("triton_model")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


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
    timing: TrackedRequest      # arrival, first token, token counts: the tracker's record
    parts: list[str] = dataclasses.field(default_factory=list)
    prefix: str = ""            # the prompt, when a non-streaming answer must start with it
    sent_logprobs: int = 0      # streaming: log-probabilities already sent
    logprobs: list[float] | None = None  # return_log_probs: every generated token's log-probability
    abort_sent: bool = False    # the engine was asked to abort it (its final output is on its way)
    perf_metrics: bool = False  # return_perf_metrics: every response carries its perf metrics
    stop_reason: bool = False   # return_stop_reason: the final response carries stop_reason
    outputs: frozenset[str] = frozenset()  # what its responses carry (request_inputs.answered_outputs)


def _input_array(request: Any, name: str) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _response(text: str, num_input: int, num_output: int, finish_reason: str,
              logprobs: tuple[list[float], float] | None = None, out: Any = None,
              inflight: _InFlight | None = None) -> Any:
    """One response; ``logprobs`` = (this response's tokens' log-probabilities, cumulative sum); ``out`` (the
    engine's RequestOutput) and ``inflight`` give the stop reason and perf metrics when the request asked."""
    tensors = [
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("num_input_tokens", np.array([num_input], dtype=np.int32)),
        pb_utils.Tensor("num_output_tokens", np.array([num_output], dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([finish_reason.encode("utf-8")], dtype=np.object_)),
    ]
    if logprobs is not None:
        tensors.append(pb_utils.Tensor("output_log_probs", np.array(logprobs[0], dtype=np.float32)))
        tensors.append(pb_utils.Tensor("cum_log_probs", np.array([logprobs[1]], dtype=np.float32)))
    if inflight is not None and out is not None:
        if inflight.stop_reason and out.finished:
            reason = "None" if out.stop_reason is None else str(out.stop_reason)
            tensors.append(pb_utils.Tensor("stop_reason", np.array([reason.encode("utf-8")], dtype=np.object_)))
        if inflight.perf_metrics and out.metrics is not None:
            tensors += [pb_utils.Tensor(n, a) for n, a in perf_metric_arrays(out.metrics, out.finished).items()]
    if inflight is not None and inflight.outputs:  # empty: built without a request's names (all outputs)
        tensors = [t for t in tensors if t.name() in inflight.outputs]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _error_response(kind: ErrorKind, message: str, retry_after_s: int | None = None) -> Any:
    """An error response of ``kind``: Triton's code for it, and the message with the kind's tag in front."""
    code = getattr(pb_utils.TritonError, TRITON_CODE[kind])
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(tagged(kind, message, retry_after_s), code))


def _send_quietly(sender: Any, response: Any) -> None:
    try:
        sender.send(response, flags=FINAL)
    except Exception:  # noqa: BLE001 - the stream may be gone already
        pass


class TritonPythonModel:
    """Triton entry points: initialize / execute / finalize."""

    def initialize(self, args: dict[str, str]) -> None:
        # tritonserver gone (its launcher killed): end at once, freeing the engine's memory (serve/triton/stale.py)
        exit_with_parent(lambda parent: log.error("tritonserver_gone", parent_pid=parent, action="exiting"))
        self.model_config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", self.model_config.get("name", "morphserve"))
        self.model_version = str(args.get("model_version", "1"))
        self.outputs = frozenset(o["name"] for o in self.model_config.get("output", []))
        params = {k: v.get("string_value", "") for k, v in self.model_config.get("parameters", {}).items()}
        from serve.engine import RequestSLO, SamplingParams  # noqa: PLC0415 - cheap (no torch)

        try:
            server = ServerParams.from_params(params, default_max_tokens=SamplingParams.max_tokens)
        except ValueError as exc:
            raise pb_utils.TritonModelException(str(exc)) from None
        configure_logging(server.log_level)
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("morphserve needs model_transaction_policy { decoupled: true }")
        self.max_tokens_limit = server.max_tokens_limit
        self.default_max_tokens = server.default_max_tokens
        self.poll_interval_s = server.poll_interval_s
        self.limits = InputLimits(max_prompt_bytes=server.max_prompt_bytes, max_list_items=server.max_list_items)

        from serve.config import EngineConfig  # noqa: PLC0415 - heavy imports after logging is set up
        from serve.engine import LLMEngine  # noqa: PLC0415

        self._SamplingParams = SamplingParams
        self._RequestSLO = RequestSLO
        try:  # a bad parameter (a policy key, a size) fails the load with its name, before the model loads
            kwargs, ignored = engine_config_kwargs(params, EngineConfig, REPO_ROOT)
            kwargs.update(self._llmapi_engine_settings(params.get("llmapi_config", ""), args, EngineConfig))
            config = EngineConfig(**kwargs)
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"invalid model parameter: {exc}") from None
        if ignored:
            log.warning("parameters_ignored", parameters=sorted(ignored),
                        reason="not a field of this engine's EngineConfig")
        t0 = time.perf_counter()
        self.engine = LLMEngine(config)
        policy = config.policy_config()
        log.info("engine_loaded", model=self.model_name, config=kwargs, load_s=round(time.perf_counter() - t0, 3),
                 max_model_len=self.engine.max_model_len, budget=self.engine.ledger.as_dict(),
                 policy=None if policy.strategy == "off" else dataclasses.asdict(policy),
                 package=str(Path(parse_request.__code__.co_filename).parents[2]))  # where morphserve was imported from

        self.metrics = Metrics(pb_utils, self.model_name, self.model_version)
        self.tracker = RequestTracker(self.metrics)
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
        self.operator: OperatorPort | None = None
        if server.operator_port:
            try:  # with the operator key every control must be signed; without it, loopback only (else ValueError)
                self.operator = OperatorPort(server.operator_port, self._control, from_env(),
                                             server.operator_host).start()
            except OSError as exc:  # the model serves; only the operator's controls are out of reach
                log.error("operator_port_unavailable", port=server.operator_port, error=str(exc))
            except ValueError as exc:
                raise pb_utils.TritonModelException(str(exc)) from None

    @staticmethod
    def _llmapi_engine_settings(path: str, args: dict[str, str], config_cls: type) -> dict[str, Any]:
        """The engine settings of the LLM-API model's model.yaml (parameter ``llmapi_config``, relative to this
        model's directory), which win over config.pbtxt's; {} when none is named. ValueError names a bad key."""
        if not path:
            return {}
        yaml_path = Path(args.get("model_repository", ".")) / path
        try:
            engine = parse_model_yaml(yaml_path.read_text(),
                                      tuple(f.name for f in dataclasses.fields(config_cls))).engine
        except OSError as exc:
            raise ValueError(f"llmapi_config {yaml_path}: {exc.strerror or exc}") from None
        except ModelYamlError as exc:
            raise ValueError(f"{yaml_path}: {exc}") from None
        if "model" in engine:
            model = Path(str(engine["model"])).expanduser()
            for base in (yaml_path.parent, REPO_ROOT):  # a relative path: to model.yaml's folder, then the checkout
                if not model.is_absolute() and (base / model).exists():
                    engine["model"] = str((base / model).resolve())
                    break
        log.info("llmapi_config_read", path=str(yaml_path), settings=sorted(engine))
        return engine

    # ---- execute -------------------------------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        """Decoupled: register each request with the engine and return; responses come later."""
        for request in requests:
            try:
                self._admit(request)
            except Exception as exc:  # noqa: BLE001 - never let one request take the model down
                log.exception("execute_failed", error=str(exc))
                _send_quietly(request.get_response_sender(),
                              _error_response(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"))
        return None

    def _admit(self, request: Any) -> None:
        arrival = time.perf_counter()
        sender = request.get_response_sender()
        request_id = uuid.uuid4().hex
        client_id = request.request_id() or ""
        parameters = request.parameters()
        try:
            target = cancel_target(parameters)
            if target is not None:  # a BLS model passing on its client's cancellation
                self._cancel_inner_request(target)
                sender.send(flags=FINAL)
                return
            front_end = front_end_arrival(parameters)
            waited = 0.0 if front_end is None else max(0.0, time.monotonic() - front_end)  # front end + Triton
            get_input = lambda name: _input_array(request, name)  # noqa: E731
            parsed = parse_request(get_input, self.max_tokens_limit, self.default_max_tokens,
                                   parameters=parameters, limits=self.limits)
            params = self._SamplingParams(**parsed.sampling_kwargs())
            slo = self._RequestSLO(**dataclasses.asdict(parse_slo_inputs(with_parameters(get_input, parameters))))
        except (InputError, ValueError, TypeError) as exc:
            self._reject(sender, request_id, client_id, ErrorKind.INVALID_INPUT, str(exc))
            return
        inflight = _InFlight(request_id, client_id, request, sender, parsed.stream,
                             self.tracker.start(request_id, arrival - waited))
        if not parsed.stream and not parsed.exclude_input_in_output:
            inflight.prefix = parsed.prompt  # TensorRT-LLM: the answer repeats the prompt unless excluded
        if parsed.return_log_probs:
            inflight.logprobs = []
        inflight.perf_metrics, inflight.stop_reason = parsed.perf_metrics, parsed.stop_reason
        inflight.outputs = answered_outputs(self.outputs, request.requested_output_names())
        with self._lock:
            self._inflight[request_id] = inflight
        try:  # the engine decides admission (draining, shedding, its queue bound) and the deadlines
            self.engine.add_request(parsed.prompt, params, request_id=request_id, callback=self._on_output, slo=slo,
                                    arrival_time=self.engine.clock() - waited, timeout_s=parsed.timeout_s)
        except Exception as exc:  # noqa: BLE001 - every refusal is answered by its kind
            with self._lock:
                self._inflight.pop(request_id, None)
            self.tracker.forget(request_id)  # refused by the engine: answered as an error, not a finished request
            kind = error_kind(exc)
            if kind is ErrorKind.OVERLOADED:
                self.tracker.refused(OVERLOADED)
            if kind is ErrorKind.INTERNAL:
                log.exception("add_request_failed", request_id=request_id, error=str(exc))
            self._reject(sender, request_id, client_id, kind, str(exc), retry_after_of(exc))
            return
        log.info("request_added", request_id=request_id, client_request_id=client_id, max_tokens=parsed.max_tokens,
                 temperature=parsed.temperature, stream=parsed.stream, prompt_chars=len(parsed.prompt),
                 ttft_slo_s=slo.ttft_s, tbt_slo_s=slo.tbt_s, priority=slo.priority, timeout_s=parsed.timeout_s,
                 waited_s=round(waited, 6))
        self._stats_dirty.set()

    def _reject(self, sender: Any, request_id: str, client_id: str, kind: ErrorKind, message: str,
                retry_after_s: int | None = None) -> None:
        log.info("request_rejected", request_id=request_id, client_request_id=client_id, kind=kind.value,
                 error=message)
        sender.send(_error_response(kind, message, retry_after_s), flags=FINAL)

    def _cancel_inner_request(self, inner_id: str) -> None:
        """A BLS model's control: abort its inner request (the one in flight with exactly this server-made id)."""
        with self._lock:
            match = next((f for f in self._inflight.values() if f.client_request_id == inner_id), None)
        if match is None:
            raise InputError(f"no request in flight has id {inner_id!r} (finished already, or never made)")
        self._abort(match)

    def _abort(self, inflight: _InFlight) -> None:
        """Ask the engine to abort (frees its KV blocks now); its final output (kind cancelled) answers it."""
        if not inflight.abort_sent:
            inflight.abort_sent = True
            self.engine.abort_request(inflight.request_id)

    # ---- the operator port (its own thread) ------------------------------------------------------
    def _control(self, name: str, body: Any) -> dict[str, Any]:
        from serve.engine.controls import run_control  # noqa: PLC0415 - light

        answer = run_control(self.engine, name, body)
        log.info("operator_control", control=name, body=body, answer=answer if name != "state" else None)
        self._stats_dirty.set()
        return answer

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
                self.tracker.forget(inflight.request_id)
                self.engine.abort_request(inflight.request_id)
                _send_quietly(inflight.sender, _error_response(ErrorKind.INTERNAL, f"internal error: {exc}"))

    def _handle(self, out: Any, t: float) -> None:
        with self._lock:
            inflight = self._inflight.get(out.request_id)
            if inflight is not None and out.finished:
                del self._inflight[out.request_id]
        if inflight is None:  # already answered (failed to respond, or the model is finalizing)
            return
        self.tracker.on_output(out, t)  # TTFT, ITL; a final output also its finish reason and latencies
        if out.finished and out.error_kind is not None:  # ended early by the engine: answered by its kind
            kind = out.error_kind
            message = out.error or ("request cancelled by the client" if kind is ErrorKind.CANCELLED else kind.value)
            if kind is ErrorKind.INTERNAL:
                message = f"generation failed: {message}"
            _send_quietly(inflight.sender, _error_response(kind, message, out.retry_after_s))  # its client may be gone
            self._finished(inflight, error=message)
            return
        reason = out.finish_reason.value if out.finish_reason is not None else ""
        if inflight.logprobs is not None and out.new_logprobs:
            inflight.logprobs.extend(out.new_logprobs)
        if inflight.stream:
            if out.new_text or out.finished:
                lp = None if inflight.logprobs is None else (inflight.logprobs[inflight.sent_logprobs:],
                                                             float(sum(inflight.logprobs)))
                inflight.sent_logprobs = len(inflight.logprobs or ())
                inflight.sender.send(_response(out.new_text, out.num_prompt_tokens, out.num_output_tokens,
                                               reason if out.finished else "", lp, out, inflight),
                                     flags=FINAL if out.finished else 0)
        else:
            if out.new_text:
                inflight.parts.append(out.new_text)
            if out.finished:
                lp = None if inflight.logprobs is None else (inflight.logprobs, float(sum(inflight.logprobs)))
                inflight.sender.send(_response(inflight.prefix + "".join(inflight.parts), out.num_prompt_tokens,
                                               out.num_output_tokens, reason, lp, out, inflight), flags=FINAL)
        if out.finished:
            self._finished(inflight)

    def _finished(self, inflight: _InFlight, error: str | None = None) -> None:
        timing = inflight.timing
        ttft, e2e = timing.ttft_s, timing.e2e_s
        log.info("request_finished", request_id=inflight.request_id, client_request_id=inflight.client_request_id,
                 finish_reason=timing.finish_reason, num_input_tokens=timing.num_prompt_tokens,
                 num_output_tokens=timing.num_output_tokens, ttft_s=None if ttft is None else round(ttft, 6),
                 e2e_s=None if e2e is None else round(e2e, 6), error=error)
        self._stats_dirty.set()

    def _check_cancellations(self) -> None:
        """Abort the requests whose client cancelled (a gRPC stream cancelled, an HTTP client that left)."""
        with self._lock:
            candidates = [f for f in self._inflight.values() if not f.abort_sent]
        for inflight in candidates:
            try:
                cancelled = inflight.request.is_cancelled()
            except Exception:  # noqa: BLE001 - request already released
                cancelled = False
            if cancelled:
                self._abort(inflight)

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
        """Stop the engine loop and the helper threads; answer what is still in flight (draining)."""
        log.info("finalize", model=self.model_name)
        if self.operator is not None:
            self.operator.stop()
        self._stop.set()
        self._stats_dirty.set()
        self.engine.drain()
        with self._lock:  # what is left is answered "shutting down", not with the engine's aborts below
            leftovers = list(self._inflight.values())
            self._inflight.clear()
        self.engine.stop()
        self._events.put(None)
        self._responder.join(timeout=5)
        self._metrics_thread.join(timeout=5)
        for inflight in leftovers:
            _send_quietly(inflight.sender, _error_response(ErrorKind.DRAINING, "the server is shutting down"))
