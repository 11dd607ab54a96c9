"""The fuzz run: hypothesis over the input parser and the HTTP and gRPC front ends of a real server, bounded (a
few hundred examples, derandomized so CI sees the same ones), asserting zero 5xx for client-caused errors; the
bodies that once answered 500 (the Reliability III probe's and this fuzz's own) are kept in
fuzz_500_corpus.jsonl and replayed first.

A client-caused error is anything the client sent: every body here is answered 200 or 4xx (503 / 504 only as load
shedding, which the small server here never meets). ``MORPHSERVE_FUZZ_RECORD=path`` appends every body answered 5xx
to ``path`` (how the corpus was gathered against the old code)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.e2e
pytest.importorskip("tritonclient.grpc")

from serve.triton.client import GenerationError, GrpcStream  # noqa: E402
from serve.triton.http_body import FrontError, load_json  # noqa: E402
from serve.triton.http_tensors import InputSpec, ModelSpec, RequestLimits, build_request  # noqa: E402
from serve.triton.request_inputs import InputError, parse_request  # noqa: E402
from serve.triton.server import TritonServer  # noqa: E402
from serve.triton.trtllm import MORPHSERVE_INPUTS, PARAMETER_ALIASES  # noqa: E402
from tests.triton_support import running_server, skip_module_without_triton  # noqa: E402

skip_module_without_triton()

CORPUS = Path(__file__).with_name("fuzz_500_corpus.jsonl")
RECORD = os.environ.get("MORPHSERVE_FUZZ_RECORD")
PARAMS: dict[str, Any] = {"engine_dir": "smollm2-135m", "morph_mode": "off", "max_model_len": 128,
                          "num_kv_blocks": 64, "num_threads": 1, "max_tokens_limit": 4, "max_num_seqs": 4,
                          "queue_timeout_s": 0, "guided_compile_timeout_s": 2}
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

# ---- what a client may send ---------------------------------------------------------------------------------

NAMES = sorted(MORPHSERVE_INPUTS) + sorted(PARAMETER_ALIASES) + ["morphserve_memory", "morphserve_cancel",
                                                                    "morphserve_arrival_s", "triton_x", "x"]
texts = st.one_of(st.text(max_size=12), st.sampled_from(["\ud800", "a\udfff", "\x00", "é" * 3, "", " ", "{}",
                                                         '{"$ref": "#"}', "root ::= root", "([a-z", "json", "regex",
                                                         "yield 512MiB", "bls-" + "0" * 32]))
ints = st.one_of(st.integers(-3, 10), st.sampled_from([2**31, 2**32 + 1, 4294967298, -4294967293, 2**63, 2**64,
                                                       -(2**63) - 1, 10**30]))
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=64), st.sampled_from([1e39, -0.0, 1e-40]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(texts, inner, max_size=2)), max_leaves=6)
keys = st.one_of(st.sampled_from(NAMES), texts)
_TYPED = {"str": texts, "strs": st.lists(texts, max_size=3), "int": ints, "uint": ints, "float": floats,
          "bool": st.booleans(), "tensor": values}


def _entry(name: str) -> st.SearchStrategy[tuple[str, Any]]:
    """A value of the input's own type (so that a body goes past the type checks) or anything."""
    kind = MORPHSERVE_INPUTS.get(PARAMETER_ALIASES.get(name, name), "str")
    return st.tuples(st.just(name), st.one_of(_TYPED[kind], values))


entries = st.one_of(st.sampled_from(NAMES).flatmap(_entry), st.tuples(texts, scalars))
bodies = st.tuples(texts, st.lists(entries, max_size=2)).map(lambda t: {"text_input": t[0], **dict(t[1])})


def _raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()  # json.dumps keeps lone surrogates as \ud800 escapes, as a client would send


# ---- the parser, without a server ----------------------------------------------------------------------------

_DT = {"str": ("BYTES", (1,)), "strs": ("BYTES", (-1,)), "int": ("INT32", (1,)), "uint": ("UINT64", (1,)),
       "float": ("FP32", (1,)), "bool": ("BOOL", (1,)), "tensor": ("FP16", (-1, -1))}
SPEC = ModelSpec("morphserve", "", 0, {n: InputSpec(n, *_DT[k]) for n, k in MORPHSERVE_INPUTS.items()},
                 RequestLimits(4096, 8, 4096, 4))


@FUZZ
@given(bodies)
def test_the_front_end_parses_any_body_into_a_request_or_a_400(body: dict[str, Any]) -> None:
    """The HTTP front end's checks (JSON, types, ranges, text, limits): a gRPC request or FrontError(400), nothing
    else."""
    try:
        build_request(SPEC, "", load_json(_raw(body), 32, check_text=False))
    except FrontError as e:
        assert e.status == 400, e.message


@FUZZ
@given(st.dictionaries(keys, values, max_size=5))
def test_the_model_parses_any_parameters_into_a_request_or_an_input_error(parameters: dict[str, Any]) -> None:
    """The model's parser (gRPC parameters, what BLS models and the front end forward): ParsedRequest or InputError."""
    text = np.array([b"hi"], dtype=np.object_)
    try:
        parse_request(lambda name: text if name == "text_input" else None, 4, 4, parameters=json.dumps(parameters))
    except InputError:
        pass


# ---- a real server -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with running_server(PARAMS, tmp_path_factory.mktemp("fuzz")) as srv:
        yield srv


def post(srv: TritonServer, model: str, raw: bytes) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{model}/generate", data=raw, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - loopback
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def check(srv: TritonServer, model: str, raw: bytes) -> None:
    status, text = post(srv, model, raw)
    if status >= 500 and RECORD:
        with open(RECORD, "a", encoding="utf-8") as f:
            f.write(json.dumps({"model": model, "body": raw.decode("utf-8", "surrogatepass"), "status": status}) + "\n")
    assert status < 500, (model, raw[:300], status, text[:300])


def corpus() -> list[tuple[str, bytes]]:
    return [(item["model"], item["body"].encode("utf-8", "surrogatepass"))
            for item in map(json.loads, CORPUS.read_text().splitlines()) if item]


@pytest.mark.parametrize("model, raw", corpus(), ids=lambda v: v if isinstance(v, str) else None)
def test_bodies_that_answered_500_before_are_4xx_now(server: TritonServer, model: str, raw: bytes) -> None:
    check(server, model, raw)


@FUZZ
@given(model=st.sampled_from(["morphserve", "ensemble", "tensorrt_llm_bls"]), body=bodies)
def test_no_generate_body_is_answered_5xx(server: TritonServer, model: str, body: dict[str, Any]) -> None:
    check(server, model, _raw(body))


@settings(FUZZ, max_examples=100)
@given(raw=st.binary(max_size=64).map(lambda b: b'{"text_input": "hi", ' + b + b"}"))
def test_no_malformed_body_is_answered_5xx(server: TritonServer, raw: bytes) -> None:
    check(server, "morphserve", raw)


grpc_values = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), floats, st.text(max_size=12))


@settings(FUZZ, max_examples=100)
@given(parameters=st.dictionaries(st.one_of(st.sampled_from(NAMES), st.text(min_size=1, max_size=8)), grpc_values,
                                  max_size=4))
def test_no_grpc_parameters_are_answered_internal(server: TritonServer, parameters: dict[str, Any]) -> None:
    """Over gRPC (straight to the model through the gRPC front end): an error is the client's, never INTERNAL."""
    from serve.error_kinds import ErrorKind
    from serve.triton.client import request_inputs

    with GrpcStream(server.grpc_url, "morphserve") as s:
        try:
            s.send(request_inputs("hi", max_tokens=2, stream=True), parameters=parameters)
            list(s.responses(timeout=120))
        except GenerationError as e:
            assert e.kind is not ErrorKind.INTERNAL, (parameters, str(e))
        except Exception as e:  # noqa: BLE001 - tritonclient refusing a parameter type client-side is fine
            assert "GenerationError" not in type(e).__name__, e
