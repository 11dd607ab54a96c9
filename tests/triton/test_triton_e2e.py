"""End-to-end tests against a real tritonserver (the one bundled in nvidia-pytriton) serving the
morphserve Python-backend model on free loopback ports.

One server per test session (fixture ``triton_server``); the tests run sequentially and each leaves
no request in flight, so KV-block gauges read after a test start from zero.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

pytest.importorskip("tritonclient.grpc")

from serve.triton.__main__ import build_parser, params_from_args  # noqa: E402
from serve.triton.client import (  # noqa: E402
    GenerationError,
    GrpcStream,
    generate_http,
    metric_value,
    parse_prometheus_text,
    request_inputs,
    scrape_metrics,
)
from serve.triton.install import TritonLaunchError, find_triton_install, server_env  # noqa: E402
from serve.triton.repository import (  # noqa: E402
    DEFAULT_MODEL_REPOSITORY,
    fill_config_parameters,
    read_config_parameters,
)
from serve.triton.server import TritonServer, free_port  # noqa: E402
from tests.triton_support import running_server, skip_module_without_triton  # noqa: E402

skip_module_without_triton()

MODEL = "morphserve"
MAX_MODEL_LEN = 256
MAX_TOKENS_LIMIT = 64
NUM_KV_BLOCKS = 128
# Small context and pool keep the server and the in-process reference engine light; morphing is off
# so the server's greedy output is comparable with the reference engine's.
SERVER_PARAMS: dict[str, Any] = {
    "engine_dir": "smollm2-135m",
    "morph_mode": "off",
    "max_model_len": MAX_MODEL_LEN,
    "num_kv_blocks": NUM_KV_BLOCKS,
    "max_num_seqs": 8,
    "max_tokens_limit": MAX_TOKENS_LIMIT,
    "poll_interval_s": 0.02,
    # One torch thread: with other processes on the same cores, OpenMP's spinning threads made a
    # 2-thread engine ~16x slower here. The reference engine uses the same setting.
    "num_threads": 1,
}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "Water boils at",
    "My favorite programming language is",
    "The largest planet in the solar system is",
    "In 1969, humans",
]
GREEDY_TOKENS = 16


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """A tritonserver on free 127.0.0.1 ports serving the morphserve model; log kept under tmp."""
    with running_server(SERVER_PARAMS, tmp_path_factory.mktemp("triton")) as srv:
        yield srv


@pytest.fixture(scope="session")
def reference_greedy() -> dict[str, str]:
    """prompt -> the engine's own greedy completion of GREEDY_TOKENS tokens, each prompt run alone
    in-process with the server's engine configuration."""
    import torch

    from serve.config import EngineConfig
    from serve.engine.engine import LLMEngine
    from serve.engine.sampling_params import SamplingParams

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    kwargs = {("model" if k == "engine_dir" else k): v for k, v in SERVER_PARAMS.items()}
    threads = torch.get_num_threads()  # the engine sets torch's process-wide thread count; restore it
    try:
        engine = LLMEngine(EngineConfig(**{k: v for k, v in kwargs.items() if k in fields}))
        params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0)
        return {p: engine.generate([p], params)[0]["text"] for p in PROMPTS}
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _post(srv: TritonServer, endpoint: str, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(
        f"http://{srv.http_url}/v2/models/{MODEL}/{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _sse_events(raw: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data:"):]) for line in raw.splitlines() if line.startswith("data:")]


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _gauge(srv: TritonServer, name: str) -> float:
    value = metric_value(scrape_metrics(srv.metrics_url), name, model=MODEL)
    assert value is not None, f"{name} missing from {srv.metrics_url}"
    return value


def _grpc_error(arrays: dict[str, np.ndarray], srv: TritonServer) -> str:
    """Send one request that must fail; return the error text."""
    with GrpcStream(srv.grpc_url, MODEL) as s:
        s.send(arrays)
        with pytest.raises(GenerationError) as info:
            for _ in s.responses(timeout=60):
                pass
    return str(info.value)


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


def test_http_generate(triton_server: TritonServer, reference_greedy: dict[str, str]) -> None:
    prompt = PROMPTS[0]
    status, raw = _post(triton_server, "generate", {"text_input": prompt, "max_tokens": GREEDY_TOKENS})
    assert status == 200, raw
    body = json.loads(raw)
    assert body["model_name"] == MODEL
    assert isinstance(body["text_output"], str) and body["text_output"]
    assert body["num_input_tokens"] > 0
    assert 1 <= body["num_output_tokens"] <= GREEDY_TOKENS
    assert body["finish_reason"] in ("length", "stop")
    assert body["text_output"] == reference_greedy[prompt]


def test_sse_generate_stream(triton_server: TritonServer, reference_greedy: dict[str, str]) -> None:
    prompt = PROMPTS[2]
    status, raw = _post(triton_server, "generate_stream",
                        {"text_input": prompt, "max_tokens": GREEDY_TOKENS, "stream": True})
    assert status == 200, raw
    events = _sse_events(raw)
    assert len(events) > 1, f"expected one event per token group, got {events}"
    assert all("error" not in e for e in events), events
    counts = [e["num_output_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] <= GREEDY_TOKENS
    assert all(e["finish_reason"] == "" for e in events[:-1])
    assert events[-1]["finish_reason"] in ("length", "stop")
    assert "".join(e["text_output"] for e in events) == reference_greedy[prompt]


def test_client_http_and_grpc_agree(triton_server: TritonServer) -> None:
    streamed: list[str] = []
    http = generate_http(PROMPTS[3], url=triton_server.http_url, max_tokens=8)
    grpc = GrpcStream(triton_server.grpc_url)
    with grpc:
        g = grpc.generate(PROMPTS[3], max_tokens=8, stream=True, on_text=streamed.append)
        whole = grpc.generate(PROMPTS[3], max_tokens=8, stream=False)  # same stream, second request
    assert http.text == g.text == "".join(streamed) == whole.text
    assert len(whole.chunks) == 1, "stream=false must answer with exactly one response"
    assert g.num_output_tokens == http.num_output_tokens
    assert g.ttft_s is not None and g.ttft_s <= g.e2e_s


def test_sampling_options_pass_through(triton_server: TritonServer) -> None:
    url = triton_server.http_url
    a = generate_http(PROMPTS[2], url=url, max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    b = generate_http(PROMPTS[2], url=url, max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    assert a.text == b.text, "same seed must give the same sample"
    stopped = generate_http(PROMPTS[0], url=url, max_tokens=GREEDY_TOKENS, stop=["."])
    assert stopped.finish_reason == "stop", stopped
    assert "." not in stopped.text
    fixed = generate_http("Hi", url=url, max_tokens=20, ignore_eos=True, stream=True)
    assert fixed.num_output_tokens == 20 and fixed.finish_reason == "length"


def test_concurrent_grpc_streams_match_engine_greedy(triton_server: TritonServer,
                                                     reference_greedy: dict[str, str]) -> None:
    results: dict[str, Any] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(PROMPTS))

    def worker(prompt: str) -> None:
        try:
            with GrpcStream(triton_server.grpc_url, MODEL) as s:
                barrier.wait(timeout=30)
                results[prompt] = s.generate(prompt, max_tokens=GREEDY_TOKENS, temperature=0.0, stream=True)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert set(results) == set(PROMPTS)
    for prompt in PROMPTS:
        c = results[prompt]
        assert c.text == reference_greedy[prompt], \
            f"{prompt!r}: server {c.text!r} != engine {reference_greedy[prompt]!r}"
        assert c.finish_reason in ("length", "stop")
        if c.num_output_tokens and c.num_output_tokens > 1:
            assert len(c.chunks) > 1, "stream=true must stream more than one response"


def test_cancelled_stream_frees_kv_blocks(triton_server: TritonServer) -> None:
    before = scrape_metrics(triton_server.metrics_url)
    cancelled_before = metric_value(before, "morphserve_requests_finished_total", model=MODEL,
                                    finish_reason="cancelled") or 0.0
    _wait_for(lambda: _gauge(triton_server, "morphserve_kv_blocks_used") == 0, 10, "an idle KV pool")

    s = GrpcStream(triton_server.grpc_url, MODEL).__enter__()
    try:
        # ignore_eos keeps the request generating for all MAX_TOKENS_LIMIT tokens unless cancelled.
        s.send(request_inputs("1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=MAX_TOKENS_LIMIT, stream=True, ignore_eos=True))
        responses = s.responses(timeout=60)
        for _ in range(2):
            item = next(responses)
            assert not item["final"], "request finished before it could be cancelled"
        _wait_for(lambda: _gauge(triton_server, "morphserve_kv_blocks_used") > 0, 10, "KV blocks in use")
        assert _gauge(triton_server, "morphserve_num_requests_running") >= 1
        s.cancel()
    finally:
        s.close()
    _wait_for(lambda: _gauge(triton_server, "morphserve_kv_blocks_used") == 0, 10, "KV blocks freed after cancel")
    after = scrape_metrics(triton_server.metrics_url)
    assert metric_value(after, "morphserve_num_requests_running", model=MODEL) == 0
    assert metric_value(after, "morphserve_kv_cache_usage_perc", model=MODEL) == 0
    cancelled_after = metric_value(after, "morphserve_requests_finished_total", model=MODEL,
                                   finish_reason="cancelled")
    assert cancelled_after == cancelled_before + 1, "the request was not cancelled (it finished on its own?)"
    # The server keeps serving.
    assert generate_http(PROMPTS[0], url=triton_server.http_url, max_tokens=4).num_output_tokens


def test_metrics_scraped_and_parsed(triton_server: TritonServer) -> None:
    generate_http(PROMPTS[4], url=triton_server.http_url, max_tokens=8, stream=True)
    m = scrape_metrics(triton_server.metrics_url)
    for name in (
        "morphserve_kv_cache_usage_perc",
        "morphserve_kv_blocks_used",
        "morphserve_kv_blocks_total",
        "morphserve_num_requests_running",
        "morphserve_num_requests_waiting",
        "morphserve_swaps_total",
        "morphserve_restores_total",
        "morphserve_generation_tokens_total",
    ):
        assert metric_value(m, name, model=MODEL) is not None, f"{name} missing"
    total = metric_value(m, "morphserve_kv_blocks_total", model=MODEL)
    used = metric_value(m, "morphserve_kv_blocks_used", model=MODEL)
    assert total is not None and total > 0 and used is not None and 0 <= used <= total
    assert 0.0 <= metric_value(m, "morphserve_kv_cache_usage_perc", model=MODEL) <= 1.0
    assert {lbl["precision"] for lbl, _ in m["morphserve_layers_quantized"]} >= {"int8", "int4"}
    for hist in ("morphserve_time_to_first_token_seconds", "morphserve_inter_token_latency_seconds"):
        count = metric_value(m, f"{hist}_count", model=MODEL)
        assert count is not None and count >= 1, f"{hist} has no observations"
        assert metric_value(m, f"{hist}_sum", model=MODEL) > 0
        buckets = sorted(((float(lbl["le"]), v) for lbl, v in m[f"{hist}_bucket"] if lbl.get("model") == MODEL))
        assert buckets[-1] == (float("inf"), count)
        assert [v for _, v in buckets] == sorted(v for _, v in buckets), "bucket counts must be cumulative"
    tiers = {lbl.get("tier"): v for lbl, v in m.get("morphserve_tier_inter_token_latency_seconds_count", [])
             if lbl.get("model") == MODEL}  # the same gaps by the request's SLO tier (the config's default here)
    assert tiers and all(t is not None and t.isdigit() for t in tiers) and sum(tiers.values()) >= 1, tiers
    assert (metric_value(m, "nv_inference_request_success", model=MODEL) or 0) >= 1


BAD_GRPC_INPUTS: list[tuple[str, Callable[[], dict[str, np.ndarray]], str]] = [
    ("missing text_input", lambda: {"max_tokens": np.array([4], dtype=np.int32)}, "text_input"),
    ("text_input wrong dtype", lambda: {"text_input": np.array([1], dtype=np.int32)}, "text_input"),
    ("max_tokens wrong dtype",
     lambda: {"text_input": np.array([b"hi"], dtype=np.object_), "max_tokens": np.array([4.0], dtype=np.float32)},
     "max_tokens"),
    ("max_tokens zero", lambda: request_inputs("hi", max_tokens=0), "max_tokens must be a positive integer"),
    ("max_tokens negative", lambda: request_inputs("hi", max_tokens=-3), "max_tokens must be a positive integer"),
    ("max_tokens above limit", lambda: request_inputs("hi", max_tokens=MAX_TOKENS_LIMIT + 1), "max_tokens_limit"),
    ("prompt longer than context", lambda: request_inputs("hello " * (MAX_MODEL_LEN + 50), max_tokens=4), "context"),
    ("non-UTF-8 bytes", lambda: request_inputs(b"caf\xe9 \xff\xfe", max_tokens=4), "UTF-8"),
    ("negative temperature", lambda: request_inputs("hi", max_tokens=4, temperature=-0.5), "temperature"),
    ("empty prompt", lambda: request_inputs("", max_tokens=4), "empty"),
]


@pytest.mark.parametrize(("case", "make", "expected"), BAD_GRPC_INPUTS, ids=[c[0] for c in BAD_GRPC_INPUTS])
def test_bad_input_answered_with_clear_error(triton_server: TritonServer, case: str,
                                             make: Callable[[], dict[str, np.ndarray]], expected: str) -> None:
    message = _grpc_error(make(), triton_server)
    assert expected.lower() in message.lower(), f"{case}: unclear error {message!r}"
    assert triton_server.proc is not None and triton_server.proc.poll() is None, "server died"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"max_tokens": 4}, "text_input"),
        # the HTTP front end's type check
        ({"text_input": "hi", "max_tokens": "four"}, "max_tokens must be an integer"),
        ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"text_input": "hi", "max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens_limit"),
        ({"text_input": "hi", "max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"text_input": "hello " * (MAX_MODEL_LEN + 50), "max_tokens": 4}, "context"),
    ],
    ids=["missing", "wrong-type", "zero", "above-limit", "temperature", "too-long"],
)
def test_bad_http_input_answered_with_error(triton_server: TritonServer, body: dict[str, Any], expected: str) -> None:
    status, raw = _post(triton_server, "generate", body)
    assert status >= 400, raw
    assert expected.lower() in json.loads(raw)["error"].lower(), raw


def test_memory_control_is_the_operators_not_the_clients(triton_server: TritonServer) -> None:
    """The yield control (docs/memory-yield.md) is refused on the inference port and reaches the engine through the
    operator port: this server's mode (off) holds no quantized layers, so the engine's own refusal comes back."""
    from serve.triton.operator_port import post_control

    status, raw = _post(triton_server, "generate", {"text_input": "", "morphserve_memory": "yield 1MiB"})
    assert status == 400 and "operator control" in json.loads(raw)["error"], raw
    answer = post_control(triton_server.operator_port, "memory_yield", {"size": "1MiB"})
    assert answer["status"] == "error" and "cannot yield memory" in answer["message"], answer
    answer = post_control(triton_server.operator_port, "memory_yield", {"size": "give 1MiB"})
    assert answer["status"] == "error" and "must be a size" in answer["message"], answer


def test_server_keeps_serving_after_bad_inputs(triton_server: TritonServer) -> None:
    for make in (lambda: request_inputs("hi", max_tokens=0), lambda: request_inputs(b"\xff", max_tokens=2)):
        _grpc_error(make(), triton_server)
    c = generate_http(PROMPTS[1], url=triton_server.http_url, max_tokens=4)
    assert c.text and c.num_output_tokens
    assert triton_server.proc is not None and triton_server.proc.poll() is None
    assert "Traceback" not in Path(triton_server.log_path).read_text(errors="replace")


# --------------------------------------------------------------------------------------------------
# Launcher and client pieces (no model engine needed)
# --------------------------------------------------------------------------------------------------


def test_config_parameters_fill_and_read_back() -> None:
    text = (DEFAULT_MODEL_REPOSITORY / MODEL / "config.pbtxt").read_text()
    params = read_config_parameters(text)
    for key in ("engine_dir", "morph_mode", "device_memory", "max_num_seqs", "max_num_batched_tokens",
                "max_tokens_limit", "slo_ttft_s"):
        assert key in params, f"config.pbtxt lacks parameter {key}"
    filled = fill_config_parameters(text, {"engine_dir": 'engines/a "b"', "max_num_seqs": 4, "device_memory": None})
    back = read_config_parameters(filled)
    assert back["engine_dir"] == 'engines/a "b"'
    assert back["max_num_seqs"] == "4"
    assert back["device_memory"] == ""
    assert {k: v for k, v in back.items() if k not in ("engine_dir", "max_num_seqs", "device_memory")} == {
        k: v for k, v in params.items() if k not in ("engine_dir", "max_num_seqs", "device_memory")}
    with pytest.raises(TritonLaunchError, match="max_num_seq"):
        fill_config_parameters(text, {"max_num_seq": 4})


def test_cli_maps_flags_to_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PORT", "18000")
    args = build_parser().parse_args(
        ["--engine-dir", "engines/x", "--max-num-seqs", "4", "--slo-ttft-s", "1.5", "--param", "max_model_len=512",
         "--", "--log-info=true"])
    assert args.http_port == 18000 and args.grpc_port == 8001 and args.metrics_port == 8002
    assert params_from_args(args) == {"engine_dir": "engines/x", "max_num_seqs": 4, "slo_ttft_s": 1.5,
                                      "max_model_len": "512"}
    assert "--log-info=true" in args.extra


def test_server_env_orders_paths(tmp_path: Path) -> None:
    import sysconfig

    (tmp_path / "python3").touch()
    env = server_env(tmp_path, use_gpu=False, base={"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib"})
    assert env["PATH"].split(":")[0] == str(tmp_path)
    assert env["LD_LIBRARY_PATH"].split(":")[0] == sysconfig.get_config_var("LIBDIR")
    assert env["LD_LIBRARY_PATH"].endswith("/opt/lib")
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(TritonLaunchError, match="python3"):
        server_env(tmp_path / "nope", use_gpu=False)


def test_free_port_is_bindable() -> None:
    import socket

    with socket.socket() as held:  # a port in use (listening) is never handed out
        held.bind(("127.0.0.1", 0))
        held.listen()
        ports = [free_port() for _ in range(5)]
        assert held.getsockname()[1] not in ports
    for port in ports:
        assert 1024 <= port <= 65535
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            assert s.getsockname() == ("127.0.0.1", port)


def test_parse_prometheus_text() -> None:
    m = parse_prometheus_text(
        '# HELP a_seconds x\n# TYPE a_seconds histogram\n'
        'a_seconds_bucket{model="m",le="0.1"} 1\na_seconds_bucket{model="m",le="+Inf"} 2\n'
        'a_seconds_sum{model="m"} 0.25\nup 1\n')
    assert metric_value(m, "a_seconds_bucket", model="m", le="+Inf") == 2
    assert metric_value(m, "a_seconds_sum", model="m") == 0.25
    assert metric_value(m, "up") == 1
    assert metric_value(m, "missing") is None


def test_failed_model_load_raises_with_log_tail(tmp_path: Path) -> None:
    """A model that fails in initialize() makes tritonserver exit; wait_ready says why."""
    model_dir = tmp_path / "repo" / "broken" / "1"
    model_dir.mkdir(parents=True)
    (model_dir.parent / "config.pbtxt").write_text(
        'name: "broken"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'instance_group [ { count: 1 kind: KIND_CPU } ]\n')
    (model_dir / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('deliberately broken model xyzzy')\n")
    srv = TritonServer(tmp_path / "repo", "broken", log_path=tmp_path / "server.log")
    srv.start()
    try:
        with pytest.raises(TritonLaunchError, match="xyzzy"):
            srv.wait_ready(timeout=120)
    finally:
        srv.stop()
    assert srv.proc is None


def _load_model_module() -> Any:
    """Import triton_models/morphserve/1/model.py outside Triton (its utils module is pure Python)."""
    import importlib.util as iu
    import sys

    utils_dir = find_triton_install().python_backend_utils.parent
    if str(utils_dir) not in sys.path:
        sys.path.append(str(utils_dir))
    spec = iu.spec_from_file_location("morphserve_triton_model", DEFAULT_MODEL_REPOSITORY / MODEL / "1" / "model.py")
    assert spec is not None and spec.loader is not None
    module = iu.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_config_defaults_build_a_valid_engine_config() -> None:
    """Every default in config.pbtxt must be accepted by EngineConfig (caught here, not at server start)."""
    from serve.config import EngineConfig

    model = _load_model_module()
    params = read_config_parameters((DEFAULT_MODEL_REPOSITORY / MODEL / "config.pbtxt").read_text())
    kwargs, ignored = model.engine_config_kwargs(params, EngineConfig, model.REPO_ROOT)
    EngineConfig(**kwargs)
    assert kwargs["model"] == params["engine_dir"]
    assert not set(ignored) & {"engine_dir", "max_num_seqs", "max_num_batched_tokens", "block_size"}
    kwargs2, _ = model.engine_config_kwargs({**params, "max_num_seqs": "3", "num_kv_blocks": ""}, EngineConfig,
                                            model.REPO_ROOT)
    assert kwargs2["max_num_seqs"] == 3 and "num_kv_blocks" not in kwargs2
    with pytest.raises(ValueError, match="max_num_seqs"):
        model.engine_config_kwargs({"max_num_seqs": "many"}, EngineConfig, model.REPO_ROOT)


@pytest.mark.slow
def test_a_morph_level_served_by_name(built, tmp_path: Path) -> None:
    """``level`` picks a morph level of the engine directory: the server answers with the tokens this engine gives on
    the level's unified checkpoint in-process; a morphing mode on a level fails the model load with the reason."""
    from builder.level_check import greedy
    from serve.model.loader import load_model

    params = {**SERVER_PARAMS, "engine_dir": str(built.path), "level": "int4@34", "speculation": "off"}
    with TritonServer(params=params, log_path=tmp_path / "server.log") as srv:
        srv.wait_ready()
        got = generate_http(PROMPTS[0], url=srv.http_url, max_tokens=8, temperature=0.0, ignore_eos=True)
    loaded = load_model(str(built.path / "hf/levels/int4-34"))
    want = greedy(None, (PROMPTS[0],), 8, model=str(built.path / "hf/levels/int4-34"))[0]
    assert got.text == loaded.tokenizer.decode(want)
    srv = TritonServer(params={**params, "morph_mode": "default"}, log_path=tmp_path / "refused.log")
    srv.start()
    try:
        with pytest.raises(TritonLaunchError, match="morph mode 'default' needs every layer's full-precision weights"):
            srv.wait_ready(timeout=300)
    finally:
        srv.stop()
