"""TensorRT-LLM clients against a real tritonserver: the models ``ensemble`` and ``tensorrt_llm_bls``.

Requests carry exactly the tensors tensorrtllm_backend's inflight_batcher_llm/client/
end_to_end_grpc_client.py sends (``prepare_inputs``: ``[1, 1]`` tensors, its default temperature 1.0,
beam_width 1, exclude_input_in_output always present, stop/bad words as ``[1, n]`` string tensors,
return_log_probs ``[[True]]``) over one gRPC stream per request (start_stream, async_stream_infer,
stop_stream, without empty final responses), and read its outputs as that script does (streaming:
concatenated deltas; otherwise the text of the response; with --check-outputs a non-streaming answer is
the prompt followed by the completion). Greedy answers must equal the engine's own.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

pytestmark = pytest.mark.e2e

grpcclient = pytest.importorskip("tritonclient.grpc")

from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

from serve.triton.client import metric_value, scrape_metrics  # noqa: E402
from serve.triton.server import TritonServer  # noqa: E402
from tests.triton_support import running_server, skip_module_without_triton  # noqa: E402

skip_module_without_triton()

MODELS = ("ensemble", "tensorrt_llm_bls")
SERVER_PARAMS: dict[str, Any] = {
    "engine_dir": "smollm2-135m", "morph_mode": "off", "max_model_len": 256, "num_kv_blocks": 128,
    "max_num_seqs": 8, "max_tokens_limit": 240, "poll_interval_s": 0.02, "num_threads": 1,
}
PROMPT = "The capital of France is"
TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with running_server(SERVER_PARAMS, tmp_path_factory.mktemp("trtllm")) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine():
    import torch

    from serve.config import EngineConfig
    from serve.engine.engine import LLMEngine

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    kwargs = {("model" if k == "engine_dir" else k): v for k, v in SERVER_PARAMS.items()}
    threads = torch.get_num_threads()
    try:
        yield LLMEngine(EngineConfig(**{k: v for k, v in kwargs.items() if k in fields}))
    finally:
        torch.set_num_threads(threads)


def _greedy(engine, prompt: str, **kwargs) -> dict:
    from serve.engine.sampling_params import SamplingParams

    return engine.generate([prompt], SamplingParams(max_tokens=kwargs.pop("max_tokens", TOKENS), **kwargs))[0]


def client_inputs(prompt: str, output_len: int, streaming: bool, *, stop_words: list[str] | None = None,
                  bad_words: list[str] | None = None, return_log_probs: bool = False,
                  exclude_input_in_output: bool = False, temperature: float = 1.0,
                  **extra: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays end_to_end_grpc_client.py's prepare_inputs builds for one prompt (beam_width 1,
    num_return_sequences not sent: the script's default), plus ``extra`` ones."""
    inputs = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.ones_like([[prompt]]).astype(np.int32) * output_len,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[temperature]], dtype=np.float32),
    }
    if bad_words:
        inputs["bad_words"] = np.array([bad_words], dtype=object)
    if stop_words:
        inputs["stop_words"] = np.array([stop_words], dtype=object)
    if return_log_probs:
        inputs["return_log_probs"] = np.array([[True]], dtype=bool)
    inputs["exclude_input_in_output"] = np.array([[exclude_input_in_output]], dtype=bool)
    inputs.update(extra)
    return inputs


@dataclasses.dataclass
class Answer:
    text: str = ""
    responses: list[Any] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)


def run_client(srv: TritonServer, model: str, inputs: dict[str, np.ndarray], streaming: bool,
               log_probs: bool = False) -> Answer:
    """One request the way the script's run_inference sends it and reads the answers."""
    client = grpcclient.InferenceServerClient(url=srv.grpc_url)
    tensors = [_tensor(name, arr) for name, arr in inputs.items()]
    outputs = [grpcclient.InferRequestedOutput("text_output")]
    if log_probs:
        outputs += [grpcclient.InferRequestedOutput("cum_log_probs"),
                    grpcclient.InferRequestedOutput("output_log_probs")]
    results: queue.Queue = queue.Queue()

    def callback(q: queue.Queue, result: Any, error: Any) -> None:
        q.put(error if error else result)

    client.start_stream(callback=partial(callback, results))
    client.async_stream_infer(model, tensors, outputs=outputs, request_id="")
    client.stop_stream()
    client.close()
    answer = Answer()
    while not results.empty():
        result = results.get()
        if isinstance(result, InferenceServerException):
            answer.errors.append(str(result))
            continue
        answer.responses.append(result)
        text = result.as_numpy("text_output")[0].decode("utf-8")
        answer.text = answer.text + text if streaming else text
    return answer


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("exclude", [False, True], ids=["with-prompt", "exclude-input"])
def test_client_script_greedy_equals_engine(server, engine, model: str, streaming: bool, exclude: bool) -> None:
    """The script's defaults (temperature 1.0, no top_k/top_p) mean greedy in TensorRT-LLM."""
    answer = run_client(server, model, client_inputs(PROMPT, TOKENS, streaming, exclude_input_in_output=exclude),
                        streaming)
    assert not answer.errors, answer.errors
    expected = _greedy(engine, PROMPT)["text"]
    if not streaming and not exclude:  # the script's --check-outputs rule
        expected = PROMPT + expected
    assert answer.text == expected
    assert answer.responses[0].as_numpy("text_output").shape == (1,)  # flat, as TensorRT-LLM answers
    if streaming:
        assert len(answer.responses) > 1
    else:
        assert len(answer.responses) == 1


@pytest.mark.parametrize("model", MODELS)
def test_client_script_stop_words_and_log_probs(server, engine, model: str) -> None:
    reference = _greedy(engine, PROMPT, stop=("."), include_stop_str_in_output=True, logprobs=True,
                        max_tokens=32)
    assert reference["finish_reason"] == "stop" and reference["text"].endswith(".")
    for streaming in (False, True):
        answer = run_client(server, model, client_inputs(PROMPT, 32, streaming, stop_words=["."],
                                                         return_log_probs=True, exclude_input_in_output=True),
                            streaming, log_probs=True)
        assert not answer.errors, answer.errors
        assert answer.text == reference["text"], "TensorRT-LLM's stop words end the answer, included"
        logprobs = np.concatenate([r.as_numpy("output_log_probs").reshape(-1) for r in answer.responses])
        cum = answer.responses[-1].as_numpy("cum_log_probs")
        assert answer.responses[-1].as_numpy("output_log_probs").ndim == 3 and cum.shape == (1, 1)
        assert len(logprobs) == len(reference["token_ids"])
        assert np.all(logprobs <= 0) and cum[0, 0] == pytest.approx(float(logprobs.sum()), abs=1e-3)


def test_log_probs_equal_engine(server, engine) -> None:
    got: list[float] = []
    from serve.engine.sampling_params import SamplingParams

    engine.add_request(PROMPT, SamplingParams(max_tokens=TOKENS, logprobs=True),
                       callback=lambda out: got.extend(out.new_logprobs or []))
    while engine.has_unfinished_requests():
        engine.step()
    answer = run_client(server, "tensorrt_llm_bls", client_inputs(PROMPT, TOKENS, False, return_log_probs=True),
                        False, log_probs=True)
    served = answer.responses[0].as_numpy("output_log_probs").reshape(-1)
    assert served.tolist() == pytest.approx(got, abs=1e-4)


def test_penalties_bad_words_min_length_reach_the_engine(server, engine) -> None:
    plain = _greedy(engine, PROMPT)
    banned = plain["text"].split()[0]
    reference = _greedy(engine, PROMPT, repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1,
                        bad_words=(" " + banned,), min_tokens=TOKENS)
    extra = {"repetition_penalty": np.array([[1.3]], dtype=np.float32),
             "presence_penalty": np.array([[0.2]], dtype=np.float32),
             "frequency_penalty": np.array([[0.1]], dtype=np.float32),
             "min_length": np.array([[TOKENS]], dtype=np.int32)}
    answer = run_client(server, "ensemble", client_inputs(PROMPT, TOKENS, False, bad_words=[" " + banned],
                                                          exclude_input_in_output=True, **extra), False)
    assert not answer.errors, answer.errors
    assert answer.text == reference["text"] != plain["text"]


UNSUPPORTED = [
    ("beam_width", np.array([[2]], dtype=np.int32), "beam"),
    ("num_return_sequences", np.array([[3]], dtype=np.int32), "num_return_sequences"),
    ("return_context_logits", np.array([[True]], dtype=bool), "context logits"),
    ("return_generation_logits", np.array([[True]], dtype=bool), "generation logits"),
    ("lora_task_id", np.array([[7]], dtype=np.uint64), "LoRA"),
    ("num_draft_tokens", np.array([[4]], dtype=np.int32), "draft"),
]


@pytest.mark.parametrize(("name", "value", "expected"), UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_inputs_the_engine_cannot_honour_get_a_clear_error(server, name: str, value: np.ndarray,
                                                           expected: str) -> None:
    inputs = client_inputs(PROMPT, 4, False, **{name: value})
    answer = run_client(server, "tensorrt_llm_bls", inputs, False)
    assert answer.errors and expected.lower() in answer.errors[0].lower(), answer.errors
    assert not answer.responses


def _guide(kind: str, guide: str) -> dict[str, np.ndarray]:
    return {"guided_decoding_guide_type": np.array([[kind]]).astype(object),
            "guided_decoding_guide": np.array([[guide]]).astype(object)}


def test_guided_decoding_through_tensorrt_llms_inputs(server) -> None:
    """TensorRT-LLM's guided-decoding inputs, sent by its own client to ensemble (streaming) and
    tensorrt_llm_bls: a JSON schema's answer validates, a regex's matches fully, a bad regex is a clear error."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 3000}},
              "required": ["answer"]}
    inputs = client_inputs("What is the year after 2024? Answer:", 30, True, exclude_input_in_output=True,
                           **_guide("json_schema", json.dumps(schema)))
    answer = run_client(server, "ensemble", inputs, True)
    assert not answer.errors, answer.errors
    jsonschema.validate(json.loads(answer.text), schema)
    inputs = client_inputs("What is the year after 2024? Answer:", 30, False, exclude_input_in_output=True,
                           **_guide("regex", r"\d{4}"))
    answer = run_client(server, "tensorrt_llm_bls", inputs, False)
    assert not answer.errors, answer.errors
    assert re.fullmatch(r"\d{4}", answer.text), answer.text
    answer = run_client(server, "tensorrt_llm_bls", client_inputs(PROMPT, 8, False, **_guide("regex", "([0-9")), False)
    assert answer.errors and "invalid regex guide" in answer.errors[0], answer.errors
    assert not answer.responses


def test_batch_of_two_prompts_is_refused_clearly(server) -> None:
    one, two = client_inputs("a", 4, False), client_inputs("b", 4, False)
    batch = {k: np.concatenate([one[k], two[k]], axis=0) for k in one}
    answer = run_client(server, "ensemble", batch, False)
    assert answer.errors and "batch size 2" in answer.errors[0]


def _generate(srv: TritonServer, model: str, body: dict[str, Any]) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{model}/generate", data=json.dumps(body).encode(),
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_generate_parameters_known_honoured_unknown_refused(server, engine) -> None:
    """Over HTTP generate, JSON keys that are not inputs arrive as request parameters."""
    status, body = _generate(server, "ensemble", {"text_input": PROMPT, "max_tokens": TOKENS, "bad_words": "",
                                                  "stop_words": ""})
    assert status == 200, body
    assert body["text_output"] == PROMPT + _greedy(engine, PROMPT)["text"]
    # "seed" and "min_tokens" are not inputs of ensemble: parameters, honoured
    status, body = _generate(server, "morphserve", {"text_input": PROMPT, "max_tokens": TOKENS, "min_tokens": TOKENS,
                                                    "ignore_eos": False})
    assert status == 200, body
    assert body["num_output_tokens"] == TOKENS
    status, body = _generate(server, "ensemble", {"text_input": PROMPT, "max_tokens": 4, "top_k": 5, "seed": 7,
                                                  "exclude_input_in_output": True})
    status2, body2 = _generate(server, "ensemble", {"text_input": PROMPT, "max_tokens": 4, "top_k": 5, "seed": 7,
                                                    "exclude_input_in_output": True})
    assert status == status2 == 200 and body["text_output"] == body2["text_output"]
    status, body = _generate(server, "tensorrt_llm_bls", {"text_input": PROMPT, "max_tokens": 4, "frobnicate": 1})
    assert status >= 400 and "unknown request parameter" in body["error"] and "frobnicate" in body["error"]
    status, body = _generate(server, "morphserve", {"text_input": PROMPT, "max_tokens": 4, "min_tokens": "two"})
    assert status >= 400 and "min_tokens" in body["error"]


def test_cancelled_bls_stream_frees_engine_blocks(server) -> None:
    """Triton 2.51's BLS cannot cancel; the BLS model passes the client's cancellation on."""
    client = grpcclient.InferenceServerClient(url=server.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    # 200 tokens: more than an idle machine generates before the cancellation lands (64 finished first there)
    inputs = client_inputs("1, 2, 3, 4,", 200, True, exclude_input_in_output=True,
                           end_id=np.array([[49151]], dtype=np.int32))
    client.async_stream_infer("tensorrt_llm_bls", [_tensor(n, a) for n, a in inputs.items()])
    for _ in range(2):
        result, error = got.get(timeout=60)
        assert error is None
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = threading.Event()
    # up to ~30 s: the cancellation travels BLS -> control request -> engine, on a busy host. Both series are
    # waited for: the engine frees the blocks before the model counts the request as cancelled, and a scrape
    # can fall between the two.
    for _ in range(600):
        m = scrape_metrics(server.metrics_url)
        if (metric_value(m, "morphserve_kv_blocks_used", model="morphserve") == 0
                and metric_value(m, "morphserve_requests_finished_total", model="morphserve",
                                 finish_reason="cancelled")):
            break
        deadline.wait(0.05)
    m = scrape_metrics(server.metrics_url)
    assert metric_value(m, "morphserve_kv_blocks_used", model="morphserve") == 0
    assert (metric_value(m, "morphserve_requests_finished_total", model="morphserve", finish_reason="cancelled")
            or 0) >= 1


# ---- metrics: TensorRT-LLM's families, and the Grafana dashboard in the repository ------------------

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "morphserve-triton.json"
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset", "le"}


def dashboard_selectors(dashboard: dict) -> list[tuple[str, dict[str, str]]]:
    """(metric name, label matchers) of every series a dashboard panel's PromQL reads."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = re.sub(r"\b(by|without)\s*\([^)]*\)", " ", target["expr"])
            expr = re.sub(r"\[[^\]]*\]", " ", expr)
            for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?\s*(\()?", expr):
                name, labels, call = m.group(1), m.group(2), m.group(3)
                if call or name in _PROMQL_WORDS:
                    continue
                out.append((name, dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', labels or ""))))
    return out


def test_grafana_dashboard_reads_only_metrics_the_server_exports(server) -> None:
    run_client(server, "ensemble", client_inputs(PROMPT, 4, True), True)  # histograms get samples
    m = scrape_metrics(server.metrics_url)
    selectors = dashboard_selectors(json.loads(DASHBOARD.read_text()))
    names = {name for name, _ in selectors}
    assert {"nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_request_metrics",
            "morphserve_request_queue_time_seconds_bucket", "morphserve_num_preemptions_total"} <= names
    for name, labels in selectors:
        assert name in m, f"dashboard reads {name}, which {server.metrics_url} does not export"
        assert any(all(lbl.get(k) == v for k, v in labels.items()) for lbl, _ in m[name]), (name, labels)


def _series(m: dict, name: str, label: str) -> dict[str, float]:
    return {lbl[label]: v for lbl, v in m.get(name, []) if lbl.get("model") == "morphserve"}


def test_trtllm_metric_families_have_trtllm_meanings(server) -> None:
    run_client(server, "ensemble", client_inputs(PROMPT, 2, False), False)  # one queue-time sample at least
    for _ in range(100):  # idle: the metrics thread refreshes within its interval
        m = scrape_metrics(server.metrics_url)
        idle = _series(m, "nv_trt_llm_request_metrics", "request_type")
        if idle.get("active") == idle.get("waiting") == idle.get("scheduled") == 0:  # each gauge is its own update
            break
        threading.Event().wait(0.05)
    kv = _series(m, "nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type")
    req = _series(m, "nv_trt_llm_request_metrics", "request_type")
    assert set(kv) == {"max", "free", "used", "tokens_per", "fraction"}
    assert set(req) == {"active", "max", "scheduled", "context", "waiting"}
    assert kv["max"] == metric_value(m, "morphserve_kv_blocks_total",
                                     model="morphserve") == SERVER_PARAMS["num_kv_blocks"]
    assert kv["tokens_per"] == 16 and kv["used"] == 0 and kv["free"] == kv["max"] and kv["fraction"] == 0
    assert req["max"] == SERVER_PARAMS["max_num_seqs"] and req["active"] == req["waiting"] == req["scheduled"] == 0
    assert metric_value(m, "morphserve_num_preemptions_total", model="morphserve") is not None
    assert (metric_value(m, "morphserve_request_queue_time_seconds_count", model="morphserve") or 0) >= 1

    client = grpcclient.InferenceServerClient(url=server.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    inputs = client_inputs("1, 2, 3, 4,", 48, True, end_id=np.array([[49151]], dtype=np.int32))
    client.async_stream_infer("tensorrt_llm_bls", [_tensor(n, a) for n, a in inputs.items()])
    try:
        got.get(timeout=60)
        busy = None
        for _ in range(100):
            m = scrape_metrics(server.metrics_url)
            kv = _series(m, "nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type")
            req = _series(m, "nv_trt_llm_request_metrics", "request_type")
            if req["active"] >= 1 and kv["used"] > 0:
                busy = (kv, req)
                break
            threading.Event().wait(0.05)
        assert busy is not None, "never saw the running request in nv_trt_llm_request_metrics"
        kv, req = busy
        assert kv["free"] == kv["max"] - kv["used"] and kv["fraction"] == pytest.approx(kv["used"] / kv["max"])
        assert kv["used"] == metric_value(m, "morphserve_kv_blocks_used", model="morphserve")
        assert req["active"] == metric_value(m, "morphserve_num_requests_running", model="morphserve")
        assert req["scheduled"] >= 1
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def _tensor(name: str, arr: np.ndarray) -> Any:
    t = grpcclient.InferInput(name, arr.shape, np_to_triton_dtype(arr.dtype))
    t.set_data_from_numpy(arr)
    return t
