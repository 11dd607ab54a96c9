"""The HTTP front (serve/triton/http_front.py) without a tritonserver: bounded bodies, typed inputs,
status codes by error kind (never by the words of a message), Triton's JSON and SSE formats, cancellation of a
request whose client left, the front end's arrival passed to the engine, draining, and the forwarding of the other
KServe v2 paths. A fake gRPC backend stands in for tritonserver."""

from __future__ import annotations

import asyncio
import gzip
import json
import struct
import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("tritonclient.grpc")

from aiohttp import ClientTimeout, web  # noqa: E402
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402
from tritonclient.grpc import service_pb2  # noqa: E402

from serve.error_kinds import ErrorKind  # noqa: E402
from serve.triton.controls import ARRIVAL_PARAMETER  # noqa: E402
from serve.triton.errors import HTTP_STATUS, http_answer, read_tag, tagged  # noqa: E402
from serve.triton.http_body import FrontError, check_json_part, load_json  # noqa: E402
from serve.triton.http_front import FrontApp, FrontOptions  # noqa: E402
from serve.triton.http_tensors import (  # noqa: E402
    InputSpec,
    ModelSpec,
    RequestLimits,
    build_request,
    encode_tensor,
    spec_from_config,
)
from serve.triton.trtllm import MORPHSERVE_INPUTS  # noqa: E402

_DT = {"str": ("BYTES", (1,)), "strs": ("BYTES", (-1,)), "int": ("INT32", (1,)), "uint": ("UINT64", (1,)),
       "float": ("FP32", (1,)), "bool": ("BOOL", (1,)), "tensor": ("FP16", (-1, -1))}
MORPHSERVE = ModelSpec("morphserve", "", 0, {n: InputSpec(n, *_DT[k]) for n, k in MORPHSERVE_INPUTS.items()})
BATCHED = ModelSpec("ensemble", "", 64, dict(MORPHSERVE.inputs))


# ---- bounded JSON ------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    b'{"text_input": ' + b"[" * 39000 + b'"x"' + b"]" * 39000 + b"}",      # 78 KB of arrays
    b'{"text_input": ' + b'{"a":' * 200000 + b"1" + b"}" * 200000 + b"}",   # ~1 MB of objects
    b"[" * 33 + b"]" * 33,
])
def test_deep_json_is_refused_naming_the_limit(body: bytes) -> None:
    with pytest.raises(FrontError, match="max_json_depth") as e:
        load_json(body, 32)
    assert e.value.status == 400


def test_forwarded_bodies_are_depth_checked_even_when_malformed() -> None:
    import time

    check_json_part(b'{"inputs": [1, 2', 32)  # shallow and malformed: Triton's parser answers it
    check_json_part(b'"x' + b"[" * 50, 32)  # brackets inside an unterminated string do not nest
    for body in (b'{"a": ' + b"[" * 50 + b"1", b"[" * 20 + b'"\\\\"' + b"[" * 20):
        with pytest.raises(FrontError, match="max_json_depth"):
            check_json_part(body, 32)
    t0 = time.perf_counter()
    with pytest.raises(FrontError):
        check_json_part(b'["\\' * 300000 + b"[" * 40, 32)  # ~1 MB of escapes and brackets: linear, not quadratic
    assert time.perf_counter() - t0 < 2.0


def test_shallow_json_parses_and_nan_is_refused() -> None:
    assert load_json(b'{"a": [[1]]}', 3) == {"a": [[1]]}
    with pytest.raises(FrontError, match="NaN"):
        load_json(b'{"temperature": NaN}', 32)
    with pytest.raises(FrontError, match="not valid JSON"):
        load_json(b'{"a": ', 32)


# ---- typed inputs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    ({"text_input": 5}, "text_input"), ({"text_input": None}, "text_input"), ({"text_input": {"a": 1}}, "text_input"),
    ({"text_input": [["x"]]}, "text_input"), ({"text_input": "hi", "max_tokens": "4"}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 4.5}, "max_tokens"), ({"text_input": "hi", "max_tokens": True}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 4294971392}, "max_tokens"), ({"text_input": "hi", "seed": -1}, "seed"),
    ({"text_input": "hi", "seed": 1 << 64}, "seed"), ({"text_input": "hi", "temperature": 1e39}, "temperature"),
    ({"text_input": "hi", "stream": 1}, "stream"), ({"text_input": "hi", "stop": ["a", 3]}, "stop"),
    ({"text_input": ["a", "b"]}, "text_input"), ({"text_input": "hi", "frobnicate": [1]}, "frobnicate"),
])
def test_type_and_range_errors_are_400_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(FrontError) as e:
        build_request(MORPHSERVE, "", body)
    assert e.value.status == 400 and field in e.value.message, e.value.message


def test_request_tensors_follow_the_model_config() -> None:
    req = build_request(MORPHSERVE, "", {"text_input": "héllo", "max_tokens": 4, "stop": ["a", "bc"],
                                         "temperature": 0.5, "seed": (1 << 64) - 1, "min_tokens": 2})
    shapes = {i.name: (i.datatype, list(i.shape)) for i in req.inputs}
    assert shapes == {"text_input": ("BYTES", [1]), "max_tokens": ("INT32", [1]), "stop": ("BYTES", [2]),
                      "temperature": ("FP32", [1]), "seed": ("UINT64", [1])}
    raw = dict(zip([i.name for i in req.inputs], req.raw_input_contents, strict=True))
    assert raw["text_input"] == struct.pack("<I", 6) + "héllo".encode()
    assert np.frombuffer(raw["seed"], "<u8")[0] == (1 << 64) - 1
    assert req.parameters["min_tokens"].int64_param == 2  # not an input: a request parameter, as Triton's generate
    assert req.parameters["triton_enable_empty_final_response"].bool_param
    batched = build_request(BATCHED, "", {"text_input": "x", "stop_words": ["a", "b"]})
    assert [list(i.shape) for i in batched.inputs] == [[1, 1], [1, 2]]
    shape, _ = encode_tensor(InputSpec("x", "INT32", (1,)), [7], batched=False)
    assert shape == [1]


def test_reserved_triton_parameters_are_400_at_the_front_end() -> None:
    """tritonserver refuses every triton_* request parameter but one, and answered that refusal 500 through the front
    end (found by test_fuzz_e2e: {"text_input": "", "triton_x": ""}); the front end refuses them 400 itself."""
    with pytest.raises(FrontError, match="'triton_x'.*reserved") as e:
        build_request(MORPHSERVE, "", {"text_input": "x", "triton_x": ""})
    assert e.value.status == 400
    req = build_request(MORPHSERVE, "", {"text_input": "x", "triton_enable_empty_final_response": False})
    assert req.parameters["triton_enable_empty_final_response"].bool_param  # the front end streams with it on


def test_the_models_own_limits_are_checked_at_the_front_end() -> None:
    spec = spec_from_config({"name": "morphserve", "input": [
        {"name": "text_input", "data_type": "TYPE_STRING", "dims": ["1"]},
        {"name": "stop", "data_type": "TYPE_STRING", "dims": ["-1"]},
        {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": ["1"]}],
        "parameters": {"engine_dir": {"string_value": "x"}, "max_prompt_bytes": {"string_value": "10"},
                       "max_list_items": {"string_value": "2"}, "max_tokens_limit": {"string_value": ""}}})
    assert spec.limits is not None and spec.limits.max_tokens_limit == 4096  # "" = the model's default
    for body, match in [({"text_input": "x" * 11}, "max_prompt_bytes"), ({"text_input": "x", "stop": ["a"] * 3},
                        "at most 2 items"), ({"text_input": "x", "stop": ["a" * 4097]}, "4096 bytes"),
                        ({"text_input": "x", "max_tokens": 4097}, "max_tokens_limit=4096")]:
        with pytest.raises(FrontError, match=match):
            build_request(spec, "", body)
    build_request(spec, "", {"text_input": "x" * 10, "stop": ["a", "b"], "max_tokens": 4096})
    bls = spec_from_config({"name": "ensemble", "parameters": {"morphserve_model_name": {"string_value": "m"}}})
    assert bls.limits is None


def test_spec_from_triton_config_json() -> None:
    spec = spec_from_config({"name": "m", "max_batch_size": 64, "input": [
        {"name": "text_input", "data_type": "TYPE_STRING", "dims": ["1"]},
        {"name": "stop", "data_type": "TYPE_STRING", "dims": ["-1"]},
        {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": ["1"]}]})
    assert spec.max_batch_size == 64 and spec.inputs["stop"] == InputSpec("stop", "BYTES", (-1,))
    assert spec.inputs["max_tokens"].datatype == "INT32"


@pytest.mark.parametrize("kind, retry, status, retry_after", [
    (ErrorKind.INVALID_INPUT, None, 400, None),
    (ErrorKind.OVERLOADED, 10, 503, 10),
    (ErrorKind.OVERLOADED, None, 503, 1),
    (ErrorKind.DEADLINE_EXCEEDED, None, 504, None),
    (ErrorKind.DRAINING, None, 503, 1),
    (ErrorKind.UNAVAILABLE, None, 503, 1),
    (ErrorKind.CANCELLED, None, 499, None),
    (ErrorKind.INTERNAL, None, 500, None),
])
@pytest.mark.parametrize("words", [
    "overloaded: 4 requests already waiting (max_num_waiting=4); retry later",
    "request timed out after timeout_s=0.3 s (2 tokens generated)",
    "the server is draining; it refuses new requests",
    "text_input is empty",
    "something else entirely",
])
def test_status_codes_come_from_the_kind_never_from_the_words(kind, retry, status, retry_after, words) -> None:
    """Every kind with every engine message: the words (even another kind's) change nothing but the body."""
    assert http_answer(tagged(kind, words, retry)) == (status, words, retry_after)
    assert HTTP_STATUS[kind] == status


@pytest.mark.parametrize("message", [
    "overloaded: retry later, after 10 s",                       # the old phrases, untagged: internal now
    "request timed out after timeout_s=1 s",
    "unknown request parameter(s) ['[overloaded retry_after=3] x']",  # a client's text echoed: not a tag
    "[nosuchkind] something",
    "Stub process 'morphserve_0_0' is not healthy.",
])
def test_untagged_messages_are_internal(message: str) -> None:
    assert http_answer(message) == (500, message, None) and read_tag(message).kind is None


# ---- the application with a fake backend -------------------------------------------------------------------------

def _response(text: str, final: bool, n: int = 1) -> Any:
    ir = service_pb2.ModelInferResponse(model_name="morphserve", model_version="1")
    ir.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    ir.raw_output_contents.append(struct.pack("<I", len(text.encode())) + text.encode())
    ir.outputs.add(name="num_output_tokens", datatype="INT32", shape=[1])
    ir.raw_output_contents.append(np.array([n], "<i4").tobytes())
    ir.parameters["triton_final_response"].bool_param = final
    return service_pb2.ModelStreamInferResponse(infer_response=ir)


def _error(message: str) -> Any:
    return service_pb2.ModelStreamInferResponse(error_message=message)


class FakeCall:
    def __init__(self, messages: list[Any]) -> None:
        self.messages = list(messages)
        self.written: list[Any] = []
        self.cancelled = False
        self.done = False

    async def write(self, req: Any) -> None:
        self.written.append(req)

    async def read(self) -> Any:
        if self.messages:
            await asyncio.sleep(0)
            return self.messages.pop(0)
        await asyncio.Event().wait()  # a request that runs until cancelled

    async def done_writing(self) -> None:
        self.done = True

    def cancel(self) -> None:
        self.cancelled = True


class FakeBackend:
    def __init__(self) -> None:
        self.script: list[list[Any]] = []
        self.calls: list[FakeCall] = []

    async def model_spec(self, model: str, version: str) -> ModelSpec:
        if model != "morphserve":
            raise FrontError(404, f"Request for unknown model: '{model}' is not found")
        return MORPHSERVE

    def open_stream(self) -> FakeCall:
        call = FakeCall(self.script.pop(0) if self.script else [])
        self.calls.append(call)
        return call

    async def close(self) -> None:
        pass


async def _fake_triton_http() -> TestServer:
    async def ready(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def config(request: web.Request) -> web.Response:
        return web.json_response({"name": request.match_info["m"], "max_batch_size": 0})

    async def infer(request: web.Request) -> web.Response:
        return web.json_response({"echo": len(await request.read())}, status=400)

    app = web.Application()
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_get("/v2/models/{m}/config", config)
    app.router.add_post("/v2/models/{m}/infer", infer)
    server = TestServer(app)
    await server.start_server()
    return server


def _run(scenario: Any, options: FrontOptions | None = None) -> None:
    async def main() -> None:
        triton = await _fake_triton_http()
        backend = FakeBackend()
        front = FrontApp(backend, str(triton.make_url("/")), options)
        client = TestClient(TestServer(front.make_app()))
        await client.start_server()
        try:
            await scenario(client, backend, front)
        finally:
            await client.close()
            await triton.close()

    asyncio.run(main())


def test_generate_and_generate_stream_keep_tritons_formats() -> None:
    async def scenario(client: TestClient, backend: FakeBackend, front: FrontApp) -> None:
        backend.script = [[_response("Paris", True, 1)], [_response("Pa", False, 1), _response("ris", False, 2),
                                                          service_pb2.ModelStreamInferResponse(
                                                              infer_response=_final_empty())]]
        r = await client.post("/v2/models/morphserve/generate", data=b'{"text_input": "x", "max_tokens": 2}')
        assert r.status == 200 and await r.json() == {"model_name": "morphserve", "model_version": "1",
                                                      "text_output": "Paris", "num_output_tokens": 1}
        r = await client.post("/v2/models/morphserve/generate_stream", data=b'{"text_input": "x", "stream": true}')
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in (await r.text()).splitlines() if line.startswith("data:")]
        assert [e["text_output"] for e in events] == ["Pa", "ris"]
        assert all(c.done and not c.cancelled for c in backend.calls)

    _run(scenario)


def _final_empty() -> Any:
    ir = service_pb2.ModelInferResponse(model_name="morphserve", model_version="1")
    ir.parameters["triton_final_response"].bool_param = True
    return ir


def test_errors_map_to_status_codes_with_retry_after() -> None:
    async def scenario(client: TestClient, backend: FakeBackend, front: FrontApp) -> None:
        overloaded = "overloaded: no token within queue_timeout_s=30 s of arrival; retry later, after 10 s"
        backend.script = [[_error(tagged(ErrorKind.OVERLOADED, overloaded, 10))],
                          [_error(tagged(ErrorKind.DEADLINE_EXCEEDED, "request timed out after timeout_s=0.3 s"))],
                          [_error(tagged(ErrorKind.INVALID_INPUT, "text_input is empty"))],
                          [_error(tagged(ErrorKind.INTERNAL, "generation failed: boom"))],
                          [_response("a", False), _error(tagged(ErrorKind.DEADLINE_EXCEEDED, "request timed out"))]]
        r = await client.post("/v2/models/morphserve/generate", data=b'{"text_input": "x"}')
        assert r.status == 503 and r.headers["Retry-After"] == "10" and (await r.json())["error"] == overloaded
        r = await client.post("/v2/models/morphserve/generate_stream", data=b'{"text_input": "x"}')
        text = await r.text()  # Triton's format on generate_stream: the error as one event
        assert r.status == 504 and text.startswith("data: ") and "timed out" in json.loads(text[6:])["error"]
        assert "Retry-After" not in r.headers
        r = await client.post("/v2/models/morphserve/generate", data=b'{"text_input": ""}')
        assert r.status == 400
        r = await client.post("/v2/models/morphserve/generate", data=b'{"text_input": "x"}')
        assert r.status == 500
        r = await client.post("/v2/models/morphserve/generate_stream", data=b'{"text_input": "x"}')
        lines = [line for line in (await r.text()).splitlines() if line.startswith("data:")]
        assert r.status == 200 and "timed out" in json.loads(lines[-1][5:])["error"]  # mid-stream: the last event
        r = await client.post("/v2/models/nosuch/generate", data=b'{"text_input": "x"}')
        assert r.status == 404

    _run(scenario)


async def _error_of(r: Any) -> str:
    """The error message of a response in Triton's format: JSON, or one SSE event on generate_stream."""
    text = await r.text()
    return json.loads(text.removeprefix("data: "))["error"]


def test_bodies_are_bounded_before_the_backend_sees_them() -> None:
    async def scenario(client: TestClient, backend: FakeBackend, front: FrontApp) -> None:
        deep = b'{"text_input": ' + b"[" * 39000 + b'"x"' + b"]" * 39000 + b"}"
        for path in ("/v2/models/morphserve/generate", "/v2/models/morphserve/generate_stream",
                     "/v2/models/morphserve/infer"):
            r = await client.post(path, data=deep)
            assert r.status == 400 and "max_json_depth" in await _error_of(r), path
        r = await client.post("/v2/models/morphserve/generate", data=b"x" * 300_000)
        assert r.status == 413 and "max_body_bytes" in (await r.json())["error"]
        r = await client.post("/v2/models/morphserve/generate", data=gzip.compress(b'{"text_input": "x"}'),
                              headers={"Content-Encoding": "gzip"})
        assert r.status == 415
        r = await client.post("/v2/models/morphserve/generate", data=b'{"text_input": 5}')
        assert r.status == 400 and "text_input" in (await r.json())["error"]
        assert backend.calls == []
        r = await client.post("/v2/models/morphserve/infer", data=b'{"inputs": []}')
        assert r.status == 400 and (await r.json()) == {"echo": 14}  # forwarded: Triton's own answer

    _run(scenario, FrontOptions(max_body_bytes=200_000))


def test_a_client_that_leaves_cancels_its_request() -> None:
    async def scenario(client: TestClient, backend: FakeBackend, front: FrontApp) -> None:
        for path in ("generate", "generate_stream"):
            backend.script = [[_response("a", False)]]  # then nothing: the request runs until cancelled
            with pytest.raises(asyncio.TimeoutError):
                r = await client.post(f"/v2/models/morphserve/{path}", data=b'{"text_input": "x"}',
                                      timeout=ClientTimeout(total=0.3))
                await r.read()
            for _ in range(100):
                if backend.calls[-1].cancelled:
                    break
                await asyncio.sleep(0.02)
            assert backend.calls[-1].cancelled, path
        assert front.inflight == 0

    _run(scenario)


def test_the_front_end_passes_its_arrival_to_the_engine_model() -> None:
    """The engine's queue deadline counts from the client's arrival at the front end: the request carries it (a
    client's own value is overwritten); the front end itself keeps no deadline (the engine decides)."""
    limited = ModelSpec("morphserve", "", 0, dict(MORPHSERVE.inputs), RequestLimits(1 << 20, 64, 4096, 4096))

    async def scenario(client: TestClient, backend: FakeBackend, front: FrontApp) -> None:
        async def spec(model: str, version: str) -> ModelSpec:
            return limited

        backend.model_spec = spec  # type: ignore[method-assign]
        backend.script = [[_response("a", True)]]
        before = time.monotonic()
        r = await client.post("/v2/models/morphserve/generate", data=json.dumps(
            {"text_input": "x", ARRIVAL_PARAMETER: before + 1000}).encode())
        assert r.status == 200
        (req,) = backend.calls[0].written
        assert before <= req.parameters[ARRIVAL_PARAMETER].double_param <= time.monotonic()
        backend.model_spec = FakeBackend().model_spec  # type: ignore[method-assign]  # a BLS model: no limits
        backend.script = [[_response("a", True)]]
        r = await client.post("/v2/models/morphserve/generate", data=b'{"text_input": "x"}')
        assert r.status == 200 and ARRIVAL_PARAMETER not in backend.calls[1].written[0].parameters

    _run(scenario)


def test_draining_refuses_new_requests_and_reports_not_ready() -> None:
    async def scenario(client: TestClient, backend: FakeBackend, front: FrontApp) -> None:
        r = await client.get("/v2/health/ready")
        assert r.status == 200
        r = await client.get("/v2/models/morphserve/config")
        assert r.status == 200 and (await r.json())["name"] == "morphserve"
        front.draining = True
        r = await client.get("/v2/health/ready")
        assert r.status == 503
        r = await client.post("/v2/models/morphserve/generate", data=b'{"text_input": "x"}')
        assert r.status == 503 and r.headers["Retry-After"] and "draining" in (await r.json())["error"]
        assert backend.calls == []

    _run(scenario)


def test_tritonserver_down_is_503_not_a_refused_connection() -> None:
    async def main() -> None:
        front = FrontApp(FakeBackend(), "http://127.0.0.1:9")  # nothing listens on the discard port
        client = TestClient(TestServer(front.make_app()))
        await client.start_server()
        try:
            r = await client.get("/v2/health/live")
            assert r.status == 503 and r.headers["Retry-After"]
        finally:
            await client.close()

    asyncio.run(main())


# ---- Reliability III: closed APIs, bounded connections, cheap refusals
# ------------------------------------------------

def test_apis_closed_to_clients_are_refused_before_tritonserver_sees_them() -> None:
    """Finding 4: shared memory, logging, trace and the repository answer 403 at the front end, unknown paths 404; the
    open ones (health, metadata, config, infer) are forwarded."""
    async def scenario(client: TestClient, backend: FakeBackend, front: FrontApp) -> None:
        for path, says in (("/v2/systemsharedmemory/region/pb/register", "shared-memory"),
                           ("/v2/cudasharedmemory/status", "shared-memory"), ("/v2/logging", "logging"),
                           ("/v2/trace/setting", "trace"), ("/v2/models/morphserve/trace/setting", "trace"),
                           ("/v2/repository/index", "model-repository")):
            r = await client.post(path, data=b"{}")
            assert r.status == 403 and f"the {says} API is not open to clients" in (await r.json())["error"], path
        r = await client.post("/v2/nosuch", data=b"{}")
        assert r.status == 404
        assert (await client.get("/v2/health/ready")).status == 200
        assert (await client.get("/v2/models/morphserve/config")).status == 200
        opened = FrontOptions(open_apis=front.options.open_apis | {"logging"})
        front.options = opened
        r = await client.post("/v2/logging", data=b"{}")
        assert r.status == 404 and "no such endpoint" not in await r.text()  # forwarded: the fake Triton's own 404

    _run(scenario)


def test_connections_over_the_limit_get_503_at_once() -> None:
    """Finding 7: the number of open connections is bounded; one more is answered 503 + Retry-After and closed."""
    import socket

    from serve.triton.http_front import HttpFront
    from serve.triton.server import free_port

    front = HttpFront("127.0.0.1", free_port(), "127.0.0.1:1", "http://127.0.0.1:1", FrontOptions(max_connections=3))
    front.start()
    try:
        held = [socket.create_connection(("127.0.0.1", front.port)) for _ in range(3)]
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", front.port))
        extra.settimeout(5)
        reply = extra.recv(4096)
        assert (reply.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in reply
                and b"too many open connections" in reply)
        assert extra.recv(4096) == b""  # and closed
        for s in [*held, extra]:
            s.close()
    finally:
        front.stop()


def test_a_body_over_the_models_limits_is_refused_by_its_size_first() -> None:
    """Finding 11 (a flood of refused 940 KB bodies slowed other clients 5x): the front end checks a field's size before
    its type and text, so such a body costs one parse and a length, not an encode and a walk of every character."""
    limits = RequestLimits(262144, 64, 4096, 4096)
    spec = ModelSpec("morphserve", "", 0, dict(MORPHSERVE.inputs), limits)
    body = load_json(json.dumps({"text_input": "\ud800" + "é" * 470_000, "stop": 5}).encode(), 32, check_text=False)
    with pytest.raises(FrontError, match="max_prompt_bytes"):
        build_request(spec, "", body)
    with pytest.raises(FrontError, match="lone UTF-16 surrogate"):  # the same text within the limit: its text checked
        build_request(spec, "", {"text_input": "\ud800" + "é" * 10})


@pytest.mark.parametrize("body", [{}, {"min_tokens": 1}, {"max_new_tokens": 2, "x": 1}, {"max_tokens": 2}])
def test_a_body_without_a_required_input_is_400_at_the_front_end(body: dict[str, Any]) -> None:
    """A body of parameters only sent tritonserver a request of no inputs, which it answered 500 ("expected number of
    inputs between 1 and 43 but got 0"; bench.reliability_probe's fuzz, 2026-12-04). Inputs the model's config does
    not mark optional are checked at the front end, whatever else the body holds."""
    spec = spec_from_config({"name": "morphserve", "input": [
        {"name": "text_input", "data_type": "TYPE_STRING", "dims": ["1"]},
        {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": ["1"], "optional": True}]})
    assert spec.required == {"text_input"}
    with pytest.raises(FrontError, match="missing required input 'text_input' .* of model 'morphserve'") as info:
        build_request(spec, "", body)
    assert info.value.status == 400
    build_request(spec, "", {"text_input": "x", **body})


def test_a_body_slower_than_the_body_timeout_is_answered_408_and_closed() -> None:
    """Finding 7: a client whose body does not come within body_timeout_s is told so (408) and cut. The 408 used to
    be lost: the connection was closed before the answer was written (bench.reliability_probe, 2026-12-04)."""
    import socket

    from serve.triton.http_front import HttpFront
    from serve.triton.server import free_port

    front = HttpFront("127.0.0.1", free_port(), "127.0.0.1:1", "http://127.0.0.1:1",
                      FrontOptions(header_timeout_s=5.0, body_timeout_s=0.5))
    front.start()
    try:
        s = socket.create_connection(("127.0.0.1", front.port))
        s.sendall(b"POST /v2/models/morphserve/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        s.settimeout(30)
        reply = b""
        while chunk := s.recv(4096):  # until the server closes
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"request body not received within 0.5 s" in reply, reply
        s.close()
    finally:
        front.stop()
