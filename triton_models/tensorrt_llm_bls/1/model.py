"""TensorRT-LLM's model names (``tensorrt_llm_bls``, ``ensemble``) over the one engine of ``morphserve``.

Glue only: each request's ``[1, ...]`` tensors and parameters become the morphserve model's inputs
(``serve.triton.trtllm.trtllm_to_morphserve``: TensorRT-LLM's defaults made explicit), go to that model
through BLS (decoupled), and its responses come back with the batch dimension (``batched``). A thread per
request waits on the BLS response iterator, so execute() returns at once. The Python backend of Triton
2.51 cannot cancel a BLS request, so a client's cancellation is passed on as a control request to the
engine model (parameter ``morphserve_cancel`` with the inner request's server-made id, which no client ever
sees: serve/triton/controls.py), which aborts the inner request and frees its KV blocks. Errors carry their
kind's tag (serve/triton/errors.py), as the engine model's do.
"""

from __future__ import annotations

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
from serve.triton.controls import CANCEL_PARAMETER, new_inner_request_id  # noqa: E402
from serve.triton.errors import TRITON_CODE, tagged  # noqa: E402
from serve.triton.request_inputs import InputError, answered_outputs  # noqa: E402
from serve.triton.stale import exit_with_parent  # noqa: E402
from serve.triton.trtllm import batched, trtllm_to_morphserve  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ENGINE_OUTPUTS = ("text_output", "num_input_tokens", "num_output_tokens", "finish_reason", "cum_log_probs",
                  "output_log_probs")


def _input(request: Any, name: str) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _error(message: str, kind: ErrorKind = ErrorKind.INVALID_INPUT) -> Any:
    code = getattr(pb_utils.TritonError, TRITON_CODE[kind])
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(tagged(kind, message), code))


class TritonPythonModel:
    """Triton entry points: initialize / execute / finalize."""

    def initialize(self, args: dict[str, str]) -> None:
        exit_with_parent()  # tritonserver gone (its launcher killed): this stub ends too (serve/triton/stale.py)
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.target = params.get("morphserve_model_name") or "morphserve"
        self.outputs = {o["name"] for o in config.get("output", [])}
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(f"{config.get('name')} needs model_transaction_policy {{ decoupled: "
                                                "true }")

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), name="trtllm-bls", daemon=True).start()
        return None

    def _serve(self, request: Any) -> None:
        sender = request.get_response_sender()
        try:
            arrays = trtllm_to_morphserve(lambda name: _input(request, name), request.parameters())
        except (InputError, ValueError) as exc:
            sender.send(_error(str(exc)), flags=FINAL)
            return
        inner_id = new_inner_request_id()  # server-made: the only kind of id morphserve_cancel accepts
        inner = pb_utils.InferenceRequest(
            model_name=self.target, request_id=inner_id, requested_output_names=list(ENGINE_OUTPUTS),
            inputs=[pb_utils.Tensor(name, arr) for name, arr in arrays.items()])
        # "streaming" until the client has its final response ("done") or the engine was asked to abort the
        # inner request ("aborted"). After that the iterator is drained to the engine's own final response,
        # so no response is left behind and the thread ends with the inner request.
        state = "streaming"
        outputs = answered_outputs(self.outputs, request.requested_output_names())
        try:
            for response in inner.exec(decoupled=True):
                if state != "streaming":
                    continue
                if request.is_cancelled():
                    state = self._abort(sender, inner_id)
                elif self._forward(sender, response, outputs):
                    state = "done"
            if state == "streaming":
                sender.send(flags=FINAL)
        except Exception as exc:  # noqa: BLE001 - answer the client, keep the model serving
            if state == "streaming":
                # A send to a client that has gone (cancelled stream) raises here before is_cancelled() is
                # seen: without this abort the inner request would run to its end holding KV blocks.
                self._cancel(inner_id)
                self._send_quietly(sender, _error(f"internal error: {type(exc).__name__}: {exc}", ErrorKind.INTERNAL))

    def _abort(self, sender: Any, inner_id: str) -> str:
        """The client cancelled: abort the inner request in the engine and answer CANCELLED."""
        self._cancel(inner_id)
        self._send_quietly(sender, _error("request cancelled by the client", ErrorKind.CANCELLED))
        return "aborted"

    @staticmethod
    def _send_quietly(sender: Any, response: Any) -> None:
        try:
            sender.send(response, flags=FINAL)
        except Exception:  # noqa: BLE001 - the client's stream may be gone already
            pass

    def _forward(self, sender: Any, response: Any, outputs: frozenset[str]) -> bool:
        """Send one engine response on with the batch dimension, carrying ``outputs``; True when it was the last."""
        if response.has_error():
            sender.send(pb_utils.InferenceResponse(error=response.error()), flags=FINAL)
            return True
        outs = {name: t.as_numpy() for name in ENGINE_OUTPUTS
                if (t := pb_utils.get_output_tensor_by_name(response, name)) is not None}
        if not outs:  # the engine model's empty final response
            return False
        reason = outs.get("finish_reason")
        final = reason is not None and bool(reason.reshape(-1)[0])
        tensors = [pb_utils.Tensor(n, a) for n, a in batched(outs).items() if n in outputs]
        sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)
        return final

    def _cancel(self, inner_id: str) -> None:
        """Ask the engine model to abort the inner request (BLS requests cannot be cancelled here)."""
        control = pb_utils.InferenceRequest(
            model_name=self.target, requested_output_names=["text_output"],
            inputs=[pb_utils.Tensor("text_input", np.array([b""], dtype=np.object_))],
            parameters={CANCEL_PARAMETER: inner_id})
        for _ in control.exec(decoupled=True):
            pass

    def finalize(self) -> None:
        """Nothing to release: the request threads end with their requests."""
