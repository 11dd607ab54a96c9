"""TensorRT-LLM's LLM-API Triton model (``tensorrt_llm``) over the one engine of the engine model (``morphserve``).

Glue only: each request's inputs become the engine model's (``serve.triton.llmapi.llmapi_to_engine``: upstream's
defaults made explicit), go to that model through BLS, and its responses come back as the LLM-API outputs the
request asked for (``engine_to_llmapi``; streamed answers carry the text so far, as upstream's). 1/model.yaml is
read at load (serve/triton/llmapi_config.py): a bad key fails the load naming it, and ``triton_config.decoupled``
must agree with this model's transaction policy.

Ending a request early, as upstream's model does:
- a request with ``stop`` = true and the request id of an in-flight request of this model ends that request (its
  caller gets CANCELLED "Request cancelled by client") and is itself answered CANCELLED, whether or not such a
  request was in flight; requests of other ids are untouched. Request ids are chosen by clients: the trust model
  and ``morphserve.stop_by_request_id: false`` (which turns this off) are in docs/hardening.md;
- a client's cancellation (gRPC) is seen by a poller every ``triton_config.cancellation_check_period_ms``.
Either way the engine model is asked to abort the inner request (parameter ``morphserve_cancel`` with the inner
request's server-made id, serve/triton/controls.py), which frees its KV blocks at once.

Threads: one per request (waits on the BLS response iterator, so execute() returns at once) and the poller.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

REPO_ROOT = Path(__file__).resolve().parents[3]
if (REPO_ROOT / "serve").is_dir() and str(REPO_ROOT) not in sys.path:  # checkout-fallback: a plain checkout
    sys.path.append(str(REPO_ROOT))  # checkout-fallback (python -m serve.triton --write-repository drops these)

from serve.error_kinds import ErrorKind  # noqa: E402
from serve.triton.controls import (  # noqa: E402
    ARRIVAL_PARAMETER,
    CANCEL_PARAMETER,
    INTERNAL_PARAMETERS,
    new_inner_request_id,
    refuse_operator_controls,
)
from serve.triton.errors import TRITON_CODE, tagged  # noqa: E402
from serve.triton.input_error import InputError  # noqa: E402
from serve.triton.llmapi import (  # noqa: E402
    ENGINE_OUTPUTS,
    check_parameters,
    engine_to_llmapi,
    is_stop_request,
    llmapi_to_engine,
)
from serve.triton.llmapi_config import ModelYamlError, parse_model_yaml  # noqa: E402
from serve.triton.request_inputs import answered_outputs  # noqa: E402
from serve.triton.stale import exit_with_parent  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCELLED_BY_CLIENT = "Request cancelled by client"  # upstream's words, which its client looks for


def _input(request: Any, name: str) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _error(message: str, kind: ErrorKind = ErrorKind.INVALID_INPUT) -> Any:
    code = getattr(pb_utils.TritonError, TRITON_CODE[kind])
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(tagged(kind, message), code))


def _cancelled() -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(CANCELLED_BY_CLIENT, pb_utils.TritonError.CANCELLED))


@dataclasses.dataclass(eq=False)
class _InFlight:
    """One request of this model while its inner request runs; ``answered`` once its final response is sent."""

    client_id: str
    inner_id: str
    request: Any
    sender: Any
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    answered: bool = False

    def send(self, response: Any, final: bool) -> bool:
        """Send unless the final response went already; False when it did (or the client is gone)."""
        with self.lock:
            if self.answered:
                return False
            self.answered = final
            try:
                self.sender.send(response, flags=FINAL if final else 0)
            except Exception:  # noqa: BLE001 - the client's stream may be gone
                self.answered = True
                return False
            return True


class TritonPythonModel:
    """Triton entry points: initialize / execute / finalize."""

    def initialize(self, args: dict[str, str]) -> None:
        exit_with_parent()  # tritonserver gone (its launcher killed): this stub ends too (serve/triton/stale.py)
        config = json.loads(args["model_config"])
        self.outputs = frozenset(o["name"] for o in config.get("output", []))
        path = Path(args["model_repository"]) / str(args.get("model_version", "1")) / "model.yaml"
        from serve.config import EngineConfig  # noqa: PLC0415 - a dataclass: its field names

        fields = tuple(f.name for f in dataclasses.fields(EngineConfig))
        try:
            self.bls = parse_model_yaml(path.read_text(), fields).bls
        except FileNotFoundError:
            raise pb_utils.TritonModelException(f"{path} is missing: the tensorrt_llm model reads its configuration "
                                                "there (docs/triton.md)") from None
        except ModelYamlError as exc:
            raise pb_utils.TritonModelException(f"{path}: {exc}") from None
        decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        if decoupled != self.bls.decoupled:
            raise pb_utils.TritonModelException(
                f"model.yaml says triton_config.decoupled: {str(self.bls.decoupled).lower()} but config.pbtxt's "
                f"model_transaction_policy says decoupled: {str(decoupled).lower()}; make them agree (python -m "
                "serve.triton --write-repository writes both)")
        self._lock = threading.Lock()
        self._inflight: dict[str, _InFlight] = {}   # by inner id
        self._stopping = threading.Event()
        self._poller = threading.Thread(target=self._poll_cancellations, name="tensorrt_llm-cancel", daemon=True)
        self._poller.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), name="tensorrt_llm-request", daemon=True).start()
        return None

    # ---- one request -----------------------------------------------------------------------------
    def _serve(self, request: Any) -> None:
        sender = request.get_response_sender()
        client_id = request.request_id() or ""

        def get(name: str) -> np.ndarray | None:
            return _input(request, name)

        try:
            if is_stop_request(get):
                self._stop(client_id, sender)
                return
            parameters = json.loads(request.parameters() or "{}")
            refuse_operator_controls(parameters)
            check_parameters(parameters, INTERNAL_PARAMETERS)
            arrays, options = llmapi_to_engine(get)
            if options.stream and not self.bls.decoupled:
                raise InputError("streaming needs a decoupled model: this tensorrt_llm model is not (model.yaml "
                                 "triton_config.decoupled: false)")
        except (InputError, ValueError) as exc:
            self._send_quietly(sender, _error(str(exc)))
            return
        flight = _InFlight(client_id, new_inner_request_id(), request, sender)
        inner_params = {ARRIVAL_PARAMETER: parameters[ARRIVAL_PARAMETER]} if ARRIVAL_PARAMETER in parameters else {}
        inner = pb_utils.InferenceRequest(
            model_name=self.bls.engine_model, request_id=flight.inner_id,
            requested_output_names=list(ENGINE_OUTPUTS), parameters=inner_params,
            inputs=[pb_utils.Tensor(name, arr) for name, arr in arrays.items()])
        with self._lock:
            self._inflight[flight.inner_id] = flight
        text = ""
        outputs = answered_outputs(self.outputs, request.requested_output_names())
        try:
            for response in inner.exec(decoupled=True):  # drained to the engine model's own final response
                if flight.answered:
                    continue
                if response.has_error():
                    flight.send(pb_utils.InferenceResponse(error=response.error()), final=True)
                    continue
                outs = {n: t.as_numpy() for n in ENGINE_OUTPUTS
                        if (t := pb_utils.get_output_tensor_by_name(response, n)) is not None}
                if not outs:  # the engine model's empty final response
                    continue
                text = text + _text(outs) if options.stream else _text(outs)
                final = bool(_text(outs, "finish_reason"))
                tensors = [pb_utils.Tensor(n, a) for n, a in engine_to_llmapi(outs, text, options, outputs).items()]
                flight.send(pb_utils.InferenceResponse(output_tensors=tensors), final=final)
            if not flight.answered:
                flight.send(pb_utils.InferenceResponse(), final=True)
        except Exception as exc:  # noqa: BLE001 - answer the client, keep the model serving
            if not flight.answered:
                self._cancel(flight.inner_id)  # do not leave the inner request running with its KV blocks
                flight.send(_error(f"internal error: {type(exc).__name__}: {exc}", ErrorKind.INTERNAL), final=True)
        finally:
            with self._lock:
                self._inflight.pop(flight.inner_id, None)

    # ---- ending requests early --------------------------------------------------------------------
    def _stop(self, client_id: str, sender: Any) -> None:
        """A stop request: end the in-flight requests of ``client_id``; it is answered CANCELLED in every case."""
        if not self.bls.stop_by_request_id:
            self._send_quietly(sender, _error("stop by request id is turned off on this server (model.yaml "
                                              "morphserve.stop_by_request_id: false); cancel the request's own "
                                              "call or stream instead"))
            return
        if not client_id:
            self._send_quietly(sender, _error("A request id must be provided for request cancellation"))
            return
        with self._lock:
            targets = [f for f in self._inflight.values() if f.client_id == client_id]
        for flight in targets:
            self._end(flight)
        self._send_quietly(sender, _cancelled())

    def _end(self, flight: _InFlight) -> None:
        """Answer ``flight`` CANCELLED and abort its inner request in the engine."""
        if flight.send(_cancelled(), final=True):
            self._cancel(flight.inner_id)

    def _poll_cancellations(self) -> None:
        period = self.bls.cancellation_check_period_ms / 1000
        while not self._stopping.wait(period):
            with self._lock:
                flights = [f for f in self._inflight.values() if not f.answered]
            for flight in flights:
                try:
                    cancelled = flight.request.is_cancelled()
                except Exception:  # noqa: BLE001 - request already released
                    cancelled = False
                if cancelled:
                    self._end(flight)

    def _cancel(self, inner_id: str) -> None:
        """Ask the engine model to abort the inner request (BLS requests cannot be cancelled in Triton 2.51)."""
        control = pb_utils.InferenceRequest(
            model_name=self.bls.engine_model, requested_output_names=["text_output"],
            inputs=[pb_utils.Tensor("text_input", np.array([b""], dtype=np.object_))],
            parameters={CANCEL_PARAMETER: inner_id})
        for _ in control.exec(decoupled=True):
            pass

    @staticmethod
    def _send_quietly(sender: Any, response: Any) -> None:
        try:
            sender.send(response, flags=FINAL)
        except Exception:  # noqa: BLE001 - the client may be gone already
            pass

    def finalize(self) -> None:
        self._stopping.set()


def _text(outs: dict[str, np.ndarray], name: str = "text_output") -> str:
    arr = outs.get(name)
    if arr is None or arr.size == 0:
        return ""
    v = arr.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, (bytes, np.bytes_)) else str(v)
