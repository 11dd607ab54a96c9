"""No client of the inference ports can act for another client or for the operator (Reliability III findings 1 and 2),
against a real tritonserver in the shipped dynamic morph mode: while four clients stream, a client that sends
``morphserve_cancel`` (empty, or a well-formed id it made up) or ``morphserve_memory`` over HTTP or gRPC is
refused 400 with a clear error; the four streams finish in full, every layer stays at full precision and nothing
is given back. The operator port (loopback only) yields and reclaims (operator controls off the data
plane)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.e2e
pytest.importorskip("tritonclient.grpc")

from serve.error_kinds import ErrorKind  # noqa: E402
from serve.triton.client import GenerationError, GrpcStream, generate_http, metric_value, request_inputs, scrape_metrics  # noqa: E402
from serve.triton.controls import new_inner_request_id  # noqa: E402
from serve.triton.operator_port import post_control  # noqa: E402
from serve.triton.server import TritonServer  # noqa: E402
from tests.triton_support import running_server, skip_module_without_triton  # noqa: E402

skip_module_without_triton()

MODEL = "morphserve"
TOKENS = 48
# The shipped mode (config.pbtxt: default, device_memory auto); a short context and one thread keep it light, a KV
# pool that holds the four streams gives the controller no reason of its own to quantize, and a short reclaim calm
# period lets the yielded bytes come back within the test.
PARAMS: dict[str, Any] = {"engine_dir": "smollm2-135m", "morph_mode": "default", "max_model_len": 256,
                          "num_kv_blocks": 128, "num_threads": 1, "policy": json.dumps({"memory_reclaim_calm_s": 0.5})}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with running_server(PARAMS, tmp_path_factory.mktemp("operator")) as srv:
        yield srv


def http(srv: TritonServer, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(),
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - loopback
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


def grpc_error(srv: TritonServer, parameters: dict[str, Any]) -> GenerationError | None:
    try:
        with GrpcStream(srv.grpc_url, MODEL) as s:
            s.send(request_inputs("x", max_tokens=2, stream=True), parameters=parameters)
            list(s.responses(timeout=120))
    except GenerationError as e:
        return e
    return None


def metric(srv: TritonServer, name: str) -> float:
    return metric_value(scrape_metrics(srv.metrics_url), name, model=MODEL) or 0.0


def wait_for(cond, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def stream(srv: TritonServer, i: int, started: threading.Event, out: dict[int, Any]) -> None:
    """One client streaming over HTTP (through the front end, whose requests all carry Triton request id "")."""
    try:
        c = generate_http(f"Client {i}: count slowly: 1, 2,", url=srv.http_url, stream=True, max_tokens=TOKENS,
                          ignore_eos=True, temperature=0.0, timeout=300, on_text=lambda _t: started.set())
        out[i] = (c.num_output_tokens, c.finish_reason)
    except Exception as e:  # noqa: BLE001 - reported by the assertion
        out[i] = f"{type(e).__name__}: {e}"


def test_a_client_cannot_cancel_others_or_yield_memory_and_the_operator_can(server: TritonServer) -> None:
    results: dict[int, Any] = {}
    started = [threading.Event() for _ in range(4)]
    clients = [threading.Thread(target=stream, args=(server, i, started[i], results)) for i in range(4)]
    for th in clients:
        th.start()
    assert all(e.wait(120) for e in started), results

    # finding 1: {"text_input": "x", "morphserve_cancel": ""} used to end every stream in flight
    status, error = http(server, {"text_input": "x", "morphserve_cancel": ""})
    assert status == 400 and "morphserve_cancel" in error and "server made" in error, (status, error)
    forged = new_inner_request_id()  # well formed, but no BLS model made it
    status, error = http(server, {"text_input": "x", "morphserve_cancel": forged})
    assert status == 400 and "no request in flight" in error, (status, error)
    err = grpc_error(server, {"morphserve_cancel": ""})
    assert err is not None and err.kind is ErrorKind.INVALID_INPUT and "morphserve_cancel" in str(err)
    # finding 2: {"text_input": "", "morphserve_memory": "yield 512MiB"} used to quantize every layer
    for command in ("yield 512MiB", "reclaim", "yield " + "9" * 40 + "B"):
        status, error = http(server, {"text_input": "x", "morphserve_memory": command})
        assert status == 400 and "operator control" in error and "--operator-port" in error, (command, status, error)
    err = grpc_error(server, {"morphserve_memory": "yield 512MiB"})
    assert err is not None and err.kind is ErrorKind.INVALID_INPUT and "operator control" in str(err)

    for th in clients:
        th.join(timeout=300)
    assert results == {i: (TOKENS, "length") for i in range(4)}  # every other client's stream finished in full
    assert metric(server, "morphserve_layers_quantized") == 0 and metric(server, "morphserve_swaps_total") == 0
    assert (metric(server, "morphserve_memory_yielded_bytes") == 0
            and metric(server, "morphserve_memory_yields_total") == 0)

    # the operator port can: a yield gives bytes back (a KV extent or a quantized layer's), reclaim takes them back
    answer = post_control(server.operator_port, "memory_yield", {"size": "1MiB"})
    assert answer["status"] == "ok" and answer["memory_yield"]["yield_request_bytes"] == 2**20, answer
    wait_for(lambda: metric(server, "morphserve_memory_yielded_bytes") >= 2**20, "the yield")
    assert metric(server, "morphserve_memory_yields_total") >= 1
    assert post_control(server.operator_port, "memory_reclaim")["status"] == "ok"
    wait_for(lambda: metric(server, "morphserve_memory_yielded_bytes") == 0
             and metric(server, "morphserve_memory_reclaims_total") >= 1, "the reclaim")
    refused = post_control(server.operator_port, "memory_yield", {"size": "lots"})
    assert refused["status"] == "error" and "must be a size" in refused["message"]


KEY = "operator-e2e-key-5b1d"


@pytest.mark.slow
def test_with_the_operator_key_memory_is_released_and_resumed(tmp_path, monkeypatch) -> None:
    """trtllm-serve's memory endpoints on the operator port, with the key in the server's environment: unsigned or
    wrongly signed requests get 401 and change nothing; signed, release parks the engine (admission refused, layers
    quantized and their bytes given back), a release of a tag that does not map is refused by name, resume brings
    full precision back and the next answer equals the one before."""
    from serve.operator_auth import ENV_KEY
    from serve.triton.operator_port import operator_request

    monkeypatch.setenv(ENV_KEY, KEY)
    with running_server(PARAMS, tmp_path) as srv:
        port = srv.operator_port
        body = {"text_input": "The capital of France is", "max_tokens": 24}
        status, before = http(srv, body)
        assert status == 200

        def stats() -> dict[str, Any]:
            return post_control(port, "state", key=KEY)["stats"]

        start = stats()
        for method, path, payload in [("POST", "/release_memory", {"tags": ["model_weights"]}),
                                      ("GET", "/memory_status", None), ("POST", "/engine/control/memory_yield",
                                                                         {"size": "1MiB"})]:
            for key in (None, "not-the-key"):
                status, answer = operator_request(port, method, path, payload, key=key)
                assert status == 401 and "detail" in answer and KEY not in json.dumps(answer), (path, answer)
        after_refusals = stats()
        assert after_refusals["memory_yielded_bytes"] == 0 and not sum(after_refusals["layers_quantized"].values())
        assert operator_request(port, "GET", "/memory_status", key=KEY) == (200,
                                                                            {"state": "running", "parked_tags": []})

        status, answer = operator_request(port, "POST", "/release_memory", {"tags": ["model_weights", "kv_cache"]},
                                          key=KEY, timeout=300)
        assert (status, answer) == (200, {"status": "success"})
        assert operator_request(port, "GET", "/memory_status", key=KEY) == (
            200, {"state": "parked", "parked_tags": ["kv_cache", "model_weights"]})
        parked = stats()
        assert parked["memory_yielded_bytes"] > 0 and sum(parked["layers_quantized"].values()) > 0
        assert parked["memory_held_bytes"] < start["memory_held_bytes"]
        status, refused = http(srv, body)
        assert status == 503 and "resume" in refused, refused
        assert operator_request(port, "POST", "/release_memory", {"tags": ["model_weights"]}, key=KEY) == (
            200, {"status": "success"})  # already parked: nothing more to do
        status, answer = operator_request(port, "POST", "/release_memory", {"tags": ["sampler"]}, key=KEY)
        assert status == 400 and "sampler" in answer["error"]["message"]

        status, answer = operator_request(port, "POST", "/resume_memory", None, key=KEY, timeout=300)
        assert (status, answer) == (200, {"status": "success"})
        resumed = stats()
        assert resumed["memory_yielded_bytes"] == 0 and not sum(resumed["layers_quantized"].values())
        assert resumed["memory_held_bytes"] == start["memory_held_bytes"]
        assert operator_request(port, "GET", "/memory_status", key=KEY) == (200,
                                                                            {"state": "running", "parked_tags": []})
        assert http(srv, body) == (200, before)
