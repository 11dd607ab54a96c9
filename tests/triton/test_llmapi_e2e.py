"""TensorRT-LLM's LLM-API model (``tensorrt_llm``) against a real tritonserver, called the way upstream's own client
(``triton_backend/tools/llmapi_client.py``) and Triton's LLM guide call it.

The client's requests: ``text_input`` BYTES [1] and ``sampling_param_max_tokens`` INT32 [1], a request id, the
request parameter ``Streaming``; on the gRPC stream when it streams or stops early; a stop is a second request with
the same id, ``text_input`` one empty string and ``stop`` [True], or ``stop_stream(cancel_requests=True)``. A
cancelled request's caller sees CANCELLED "Request cancelled by client". Greedy answers must equal the engine's
own; the perf metrics must equal what the engine counted for that request.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

grpcclient = pytest.importorskip("tritonclient.grpc")

from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

from serve.triton.install import TritonLaunchError  # noqa: E402
from serve.triton.llmapi_config import BlsSettings  # noqa: E402
from serve.triton.operator_port import post_control  # noqa: E402
from serve.triton.repository import write_repository  # noqa: E402
from serve.triton.server import TritonServer, free_port  # noqa: E402
from tests.triton_support import running_server, skip_module_without_triton  # noqa: E402

skip_module_without_triton()

PARAMS: dict[str, Any] = {
    "engine_dir": "smollm2-135m", "morph_mode": "off", "max_model_len": 512, "num_kv_blocks": 160,
    "max_num_seqs": 8, "max_tokens_limit": 400, "poll_interval_s": 0.02, "num_threads": 1, "speculation": "always",
}
PROMPT = "What is ML?"
MODEL = "tensorrt_llm"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with running_server(PARAMS, tmp_path_factory.mktemp("llmapi"), operator_port=free_port()) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine():
    import torch

    from serve.config import EngineConfig
    from serve.engine.engine import LLMEngine

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    kwargs = {("model" if k == "engine_dir" else k): v for k, v in PARAMS.items()}
    threads = torch.get_num_threads()
    try:
        yield LLMEngine(EngineConfig(**{**{k: v for k, v in kwargs.items() if k in fields}, "speculation": "off"}))
    finally:
        torch.set_num_threads(threads)


def _greedy(engine, prompt: str, max_tokens: int) -> str:
    from serve.engine.sampling_params import SamplingParams

    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]["text"]


def _generate(srv: TritonServer, body: dict[str, Any], model: str = MODEL) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{model}/generate", data=json.dumps(body).encode(),
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _tensor(name: str, arr: np.ndarray) -> Any:
    t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    t.set_data_from_numpy(arr)
    return t


def client_inputs(text: str, output_len: int, **extra: np.ndarray) -> list[Any]:
    """What llmapi_client.py sends: text_input BYTES [1], sampling_param_max_tokens INT32 [1] (plus ``extra``)."""
    arrays = {"text_input": np.array([text.encode()], dtype=object),
              "sampling_param_max_tokens": np.array([output_len], dtype=np.int32), **extra}
    return [_tensor(n, a) for n, a in arrays.items()]


def stop_inputs() -> list[Any]:
    """llmapi_client.py's stop request: one empty text_input and stop [True]."""
    return [_tensor("text_input", np.empty([1], dtype=np.bytes_).astype(object)),
            _tensor("stop", np.array([True], dtype=bool))]


class Stream:
    """One gRPC stream (start_stream / async_stream_infer) collecting (result, error) pairs."""

    def __init__(self, srv: TritonServer) -> None:
        self.client = grpcclient.InferenceServerClient(srv.grpc_url)
        self.got: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.got.put((result, error)))

    def send(self, inputs: list[Any], request_id: str, streaming: bool = True) -> None:
        self.client.async_stream_infer(MODEL, inputs, request_id=request_id, parameters={"Streaming": streaming})

    def next(self, timeout: float = 120) -> tuple[Any, Any]:
        return self.got.get(timeout=timeout)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def _text(result: Any) -> str:
    return result.as_numpy("text_output").reshape(-1)[0].decode()


def _cancelled(error: Any) -> bool:
    return isinstance(error, InferenceServerException) and "Request cancelled by client" in str(error)


def _state(srv: TritonServer) -> dict:
    return post_control(srv.operator_port, "state")["stats"]


def _wait_idle(srv: TritonServer) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = _state(srv)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {stats}")


def test_triton_guides_curl_and_greedy_equal_the_engine(server, engine) -> None:
    status, body = _generate(server, {"text_input": PROMPT, "sampling_param_max_tokens": 20})
    assert status == 200, body
    assert body["model_name"] == MODEL and body["text_output"].startswith(PROMPT)  # the prompt is echoed by default
    status, body = _generate(server, {"text_input": PROMPT, "sampling_param_max_tokens": 20,
                                      "sampling_param_top_k": 1, "sampling_param_exclude_input_from_output": True})
    assert status == 200, body
    assert body["text_output"] == _greedy(engine, PROMPT, 20)
    status, body = _generate(server, {"text_input": PROMPT})  # upstream's max_tokens default: 32 tokens
    assert status == 200 and body["text_output"] == PROMPT + _greedy(engine, PROMPT, 32)


def test_streamed_answers_carry_the_text_so_far(server, engine) -> None:
    stream = Stream(server)
    try:
        stream.send(client_inputs(PROMPT, 16, streaming=np.array([True]), return_finish_reason=np.array([True])),
                    "s1")
        texts, reasons = [], []
        while True:
            result, error = stream.next()
            assert error is None, error
            texts.append(_text(result))
            reasons.append(result.as_numpy("finish_reason").reshape(-1)[0].decode())
            if reasons[-1] != "None":
                break
    finally:
        stream.close()
    assert len(texts) > 1 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, never the prompt
    assert texts[-1] == _greedy(engine, PROMPT, 16) and reasons[-1] == "length" and set(reasons[:-1]) == {"None"}


def test_stop_by_request_id_ends_only_that_request(server, engine) -> None:
    """The client's --stop-after-ms path: a stop request with the same id; another id runs on, and the next
    request's answer equals the first's."""
    before = _greedy(engine, PROMPT, 24)
    stream = Stream(server)
    try:
        stream.send(client_inputs(PROMPT, 300, streaming=np.array([True])), "victim")
        stream.send(client_inputs(PROMPT, 24, sampling_param_exclude_input_from_output=np.array([True])), "bystander",
                    streaming=False)
        result, error = stream.next()
        assert error is None  # the victim streams
        stopper = Stream(server)
        try:
            stopper.send(stop_inputs(), "victim")
            _, stop_error = stopper.next()
        finally:
            stopper.close()
        assert _cancelled(stop_error), stop_error
        victim_ended = bystander = None
        while victim_ended is None or bystander is None:
            result, error = stream.next()
            if error is not None:
                assert _cancelled(error), error
                victim_ended = True
            elif result.get_response().id == "bystander":
                bystander = _text(result)
    finally:
        stream.close()
    assert bystander == before
    stats = _wait_idle(server)
    assert stats["kv_blocks_used"] == 0, "the stopped request's KV blocks were not freed"
    status, body = _generate(server, {"text_input": PROMPT, "sampling_param_max_tokens": 24,
                                      "sampling_param_exclude_input_from_output": True})
    assert status == 200 and body["text_output"] == before


def test_stop_for_an_unknown_finished_or_missing_id(server) -> None:
    stream = Stream(server)
    try:
        stream.send(stop_inputs(), "nobody-has-this-id")
        assert _cancelled(stream.next()[1])
        stream.send(client_inputs(PROMPT, 4), "done-1", streaming=False)
        result, error = stream.next()
        assert error is None and _text(result)
        stream.send(stop_inputs(), "done-1")
        assert _cancelled(stream.next()[1])
        stream.send(stop_inputs(), "")
        _, error = stream.next()
        assert error is not None and "A request id must be provided" in str(error)
    finally:
        stream.close()


def test_cancellation_ends_the_request_and_frees_its_blocks(server) -> None:
    """The client's --stop-via-request-cancel path: stop_stream(cancel_requests=True)."""
    stream = Stream(server)
    stream.send(client_inputs(PROMPT, 300, streaming=np.array([True])), "c1")
    _, error = stream.next()
    assert error is None
    stream.close(cancel=True)
    stats = _wait_idle(server)
    assert stats["kv_blocks_used"] == 0


def test_perf_metrics_are_the_engines_counts(server) -> None:
    """A prompt of several blocks sent twice: the second finds its blocks in the prefix cache, and
    kv_cache_reused_block is what the engine's prefix-hit counter grew by; speculation (always) drafts, and the
    request's draft counts are what the engine's counters grew by; the times are ordered."""
    prompt = "The history of the city begins with a small settlement by the river. " * 6
    body = {"text_input": prompt, "sampling_param_max_tokens": 12, "sampling_param_return_perf_metrics": True,
            "sampling_param_exclude_input_from_output": True}
    status, first = _generate(server, body)
    assert status == 200, first
    before = _wait_idle(server)
    status, second = _generate(server, body)
    assert status == 200, second
    after = _wait_idle(server)
    block = after["block_size"]
    assert second["kv_cache_reused_block"] > 0
    assert second["kv_cache_reused_block"] * block == after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert (second["kv_cache_alloc_total_blocks"]
            == second["kv_cache_reused_block"] + second["kv_cache_alloc_new_blocks"])
    assert second["kv_cache_hit_rate"] == pytest.approx(
        second["kv_cache_reused_block"] / (second["kv_cache_reused_block"] + second["kv_cache_missed_block"]))
    assert first["kv_cache_reused_block"] == 0 and first["kv_cache_hit_rate"] == 0
    assert (second["total_draft_tokens"]
            == after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"])
    assert second["total_accepted_draft_tokens"] == (after["spec_decode_num_accepted_tokens"]
                                                     - before["spec_decode_num_accepted_tokens"])
    assert second["total_draft_tokens"] > 0
    assert second["acceptance_rate"] == pytest.approx(second["total_accepted_draft_tokens"]
                                                      / second["total_draft_tokens"])
    times = [second[k] for k in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                                 "last_token_time_ns")]
    assert 0 < times[0] <= times[1] <= times[2] <= times[3], times
    assert times[0] <= time.monotonic_ns()  # CLOCK_MONOTONIC nanoseconds, upstream's steady clock


def test_finish_and_stop_reasons_and_cumulative_logprob(server) -> None:
    status, body = _generate(server, {"text_input": "Count: one, two, three,", "sampling_param_max_tokens": 40,
                                      "sampling_param_stop": [","], "return_finish_reason": True,
                                      "return_stop_reason": True, "return_cumulative_logprob": True,
                                      "sampling_param_exclude_input_from_output": True})
    assert status == 200, body
    assert body["finish_reason"] == "stop" and body["stop_reason"] == "," and body["cumulative_logprob"] < 0
    status, body = _generate(server,
                             {"text_input": PROMPT, "sampling_param_max_tokens": 3, "return_finish_reason": True,
                                      "return_stop_reason": True})
    assert body["finish_reason"] == "length" and body["stop_reason"] == "None"


@pytest.mark.parametrize("body, named", [
    ({"sampling_param_best_of": 2}, "sampling_param_best_of"),
    ({"lora_id": 1}, "lora_id"),
    ({"lora_name": "x"}, "lora_name"),
    ({"image_url": ["http://127.0.0.1/cat.png"]}, "image_url"),
    ({"sampling_param_logits_post_processor_name": "ban"}, "sampling_param_logits_post_processor_name"),
    ({"sampling_param_top_p": 1.5}, "sampling_param_top_p"),
    ({"sampling_param_temperature": -0.5}, "sampling_param_temperature"),
    ({"sampling_param_max_tokens": 0}, "sampling_param_max_tokens"),
    ({"max_tokens": 16}, "max_tokens"),
])
def test_refused_inputs_are_named(server, body: dict, named: str) -> None:
    status, answer = _generate(server, {"text_input": PROMPT, **body})
    assert status == 400 and named in answer.get("error", ""), answer


@pytest.mark.slow
def test_quality_outputs_of_both_engine_models(tmp_path: Path) -> None:
    """An 8-bit KV cache with the quality meter sampling every step (morph_mode default hosts it): both models answer
    the quality outputs with the perf metrics, every output token read 8-bit KV, the meter sampled the request and its
    agreement is a share; a request without the flag gets none of them, and a gRPC request naming one output gets
    that one alone."""
    from serve.triton.llmapi import QUALITY_OUTPUTS

    params = {**PARAMS, "morph_mode": "default", "kv_cache_dtype": "int8", "quality_meter": 1000, "speculation": "off"}
    with running_server(params, tmp_path) as srv:
        status, body = _generate(srv, {"text_input": PROMPT, "sampling_param_max_tokens": 8,
                                       "return_finish_reason": True, "sampling_param_return_perf_metrics": True})
        assert status == 200 and body["finish_reason"] == "length", body
        assert body["kv_8bit_tokens"] == 8 and 0 <= body["quantized_layer_tokens"] <= 8
        assert 0 < body["quality_samples"] <= 8 and 0.0 <= body["quality_agreement"] <= 1.0
        status, body = _generate(srv, {"text_input": PROMPT, "max_tokens": 6, "ignore_eos": True,
                                       "return_perf_metrics": True}, model="morphserve")
        assert status == 200, body
        assert body["kv_8bit_tokens"] == body["num_output_tokens"] == 6 and body["quality_samples"] > 0, body
        status, plain = _generate(srv, {"text_input": PROMPT, "max_tokens": 6}, model="morphserve")
        assert status == 200 and not set(plain) & set(QUALITY_OUTPUTS), plain
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        got: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        try:
            client.async_stream_infer(MODEL,
                                      client_inputs(PROMPT, 4, sampling_param_return_perf_metrics=np.array([True])),
                                      request_id="q1", outputs=[grpcclient.InferRequestedOutput("quality_samples")])
            result, error = got.get(timeout=120)
        finally:
            client.stop_stream()
            client.close()
        assert error is None, error
        assert result.as_numpy("text_output") is None and result.as_numpy("quality_samples").tolist()[0] > 0


@pytest.mark.slow
def test_unary_model_runs_upstreams_cancel_sequence(tmp_path: Path) -> None:
    """model.yaml triton_config.decoupled: false (upstream's default): unary gRPC calls (ModelInfer), as upstream's
    test_llmapi_cancel.py makes them: a stop for an id not yet used and for a finished request answer CANCELLED, a
    request after them answers as the first; streaming is refused; a model.yaml with an unknown key is refused before
    the server starts, naming it (the models' own load reads it with the same parser: test_llmapi_contract.py)."""
    srv = TritonServer(params=PARAMS, log_path=tmp_path / "unary.log", also_load=[MODEL],
                       llmapi=BlsSettings(decoupled=False))
    srv.start()
    try:
        srv.wait_ready(timeout=300)
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        with pytest.raises(InferenceServerException, match="Request cancelled by client") as err:
            client.infer(MODEL, stop_inputs(), request_id="1")
        assert err.value.status() == "StatusCode.CANCELLED"
        first = _text(client.infer(MODEL, client_inputs("The current time is", 20), request_id="1"))
        with pytest.raises(InferenceServerException, match="Request cancelled by client"):
            client.infer(MODEL, stop_inputs(), request_id="1")
        assert _text(client.infer(MODEL, client_inputs("The current time is", 20), request_id="2")) == first
        with pytest.raises(InferenceServerException, match="decoupled"):
            client.infer(MODEL, client_inputs(PROMPT, 4, streaming=np.array([True])), request_id="3")
    finally:
        srv.stop()
    bad = tmp_path / "bad"
    write_repository(bad, {"engine_dir": "smollm2-135m", "morph_mode": "off", "num_threads": 1})
    yaml_path = bad / MODEL / "1" / "model.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("morphserve:", "morphserve:\n  morph_mod: default", 1))
    srv = TritonServer(bad, log_path=tmp_path / "bad.log", workdir=tmp_path / "bad-work")
    with pytest.raises(TritonLaunchError, match="morph_mod"):  # the launcher refuses before starting anything
        srv.start()
    assert srv.proc is None
