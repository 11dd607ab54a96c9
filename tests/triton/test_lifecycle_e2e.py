"""Each error kind gets the same client-visible status over HTTP and gRPC, against a real tritonserver:
invalid input 400, overloaded 503 + Retry-After, deadline exceeded 504, draining 503 + Retry-After (gRPC stream
clients read the kind and Retry-After from the message's tag, serve/triton/errors.py). The engine decides them
(serve/engine/lifecycle.py); and rewording every engine message into another kind's words (a second server whose
model has the words planted) changes no status.

One request runs at a time and one may wait (max_num_seqs 1, max_num_waiting 1), so overload is made exactly:
a long request runs, a second waits, a third is refused."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.e2e
pytest.importorskip("tritonclient.grpc")

from serve.error_kinds import ErrorKind  # noqa: E402
from serve.triton.client import GenerationError, GrpcStream, metric_value, request_inputs, scrape_metrics  # noqa: E402
from serve.triton.operator_port import post_control  # noqa: E402
from serve.triton.server import TritonServer  # noqa: E402
from tests.triton_support import running_server, skip_module_without_triton  # noqa: E402

skip_module_without_triton()

MODEL = "morphserve"
REPO = Path(__file__).resolve().parents[2]
PARAMS: dict[str, Any] = {
    "engine_dir": "smollm2-135m", "morph_mode": "off", "max_model_len": 256, "num_kv_blocks": 64,
    "max_num_seqs": 1, "max_num_waiting": 1, "max_tokens_limit": 256, "num_threads": 1, "poll_interval_s": 0.02,
    "queue_timeout_s": 120,  # the waiting request must not be shed while the test holds it
}
TOO_LONG = "hello " * 300  # more tokens than max_model_len: the engine's validation refuses it

# The planted model's words: each kind says another kind's (what the old word matching would have misread).
LIES = {"overloaded": "request timed out after timeout_s=1 s (3 tokens generated)",
        "deadline_exceeded": "overloaded: no token within queue_timeout_s=30 s; retry later, after 9 s",
        "draining": "text_input is empty",
        "invalid_input": "the server is draining (shutting down) and refuses new requests"}
PLANT = f'''

# ---- planted by tests/triton/test_lifecycle_e2e.py: every engine message in another kind's words ----------
import serve.engine.admission as _admission  # noqa: E402
import serve.engine.lifecycle as _lifecycle  # noqa: E402
import serve.engine.validation as _validation  # noqa: E402
from serve.engine.errors import EngineError as _EngineError  # noqa: E402

_LIES = {LIES!r}


def _reworded(e):
    return type(e)(_LIES[e.kind.value], e.retry_after_s)


def _rewording(original):
    def wrapper(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except _EngineError as e:
            raise _reworded(e) from None
        except ValueError:
            raise ValueError(_LIES["invalid_input"]) from None
    return wrapper


_lifecycle.Lifecycle.admit = _rewording(_lifecycle.Lifecycle.admit)
_admission.Handoff.put = _rewording(_admission.Handoff.put)
_validation.RequestValidator.tokenize = _rewording(_validation.RequestValidator.tokenize)
_expired = _lifecycle.Lifecycle.expired
_lifecycle.Lifecycle.expired = lambda self, seqs, now: [(s, _reworded(e)) for s, e in _expired(self, seqs, now)]
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with running_server(PARAMS, tmp_path_factory.mktemp("lifecycle")) as srv:
        yield srv


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """A server whose model rewords every message of the engine (a copy of the repository, model.py planted)."""
    root = tmp_path_factory.mktemp("planted")
    model = root / "repository" / MODEL
    (model / "1").mkdir(parents=True)
    shutil.copy(REPO / "triton_models" / MODEL / "config.pbtxt", model / "config.pbtxt")
    (model / "1" / "model.py").write_text((REPO / "triton_models" / MODEL / "1" / "model.py").read_text() + PLANT)
    srv = TritonServer(root / "repository", MODEL, params=PARAMS, log_path=root / "tritonserver.log")
    srv.start()
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()


def http(srv: TritonServer, body: dict[str, Any]) -> tuple[int, str, str | None]:
    """(status, the error message or the answer's text, Retry-After) of one generate request."""
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(),
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - loopback
            return r.status, json.loads(r.read())["text_output"], r.headers.get("Retry-After")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"], e.headers.get("Retry-After")


def grpc(srv: TritonServer, text: str, **options: Any) -> GenerationError | int:
    """The error of one streaming gRPC request (its kind, Retry-After and words), or the tokens it got."""
    timeout = options.pop("timeout_s", None)
    arrays = request_inputs(text, stream=True, **options)
    if timeout is not None:
        arrays["timeout_s"] = np.array([timeout], dtype=np.float32)
    try:
        with GrpcStream(srv.grpc_url, MODEL) as s:
            s.send(arrays)
            return sum(1 for item in s.responses(timeout=120) if item.get("text_output"))
    except GenerationError as e:
        return e


def gauge(srv: TritonServer, name: str) -> float:
    return metric_value(scrape_metrics(srv.metrics_url), name, model=MODEL) or 0.0


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def check_every_kind(srv: TritonServer, words: dict[str, str] | None) -> None:
    """Each kind's status over HTTP and its kind over gRPC; with ``words``, the planted messages came back as they
    are (so the statuses above were decided with another kind's words in the message)."""
    def said(kind: ErrorKind, message: str) -> None:
        if words is not None:
            assert message == words[kind.value], (kind, message)

    # invalid input: the engine's validation (a prompt longer than the context)
    status, message, retry = http(srv, {"text_input": TOO_LONG, "max_tokens": 4})
    assert (status, retry) == (400, None), message
    said(ErrorKind.INVALID_INPUT, message)
    err = grpc(srv, TOO_LONG, max_tokens=4)
    assert isinstance(err, GenerationError) and (err.kind, err.retry_after) == (ErrorKind.INVALID_INPUT, None)
    said(ErrorKind.INVALID_INPUT, str(err))

    # deadline exceeded: timeout_s passes while it generates
    status, message, retry = http(srv, {"text_input": "Count: 1, 2,", "max_tokens": 200, "ignore_eos": True,
                                        "timeout_s": 0.3})
    assert (status, retry) == (504, None), message
    said(ErrorKind.DEADLINE_EXCEEDED, message)
    err = grpc(srv, "Count: 1, 2,", max_tokens=200, ignore_eos=True, timeout_s=0.3)
    assert isinstance(err, GenerationError) and (err.kind, err.retry_after) == (ErrorKind.DEADLINE_EXCEEDED, None)
    said(ErrorKind.DEADLINE_EXCEEDED, str(err))

    # overloaded: one runs, one waits, the next is refused with a Retry-After
    first = threading.Event()
    with GrpcStream(srv.grpc_url, MODEL) as running:
        running.send(request_inputs("Count: 1, 2,", max_tokens=240, ignore_eos=True, stream=True))
        items = running.responses(timeout=120)
        next(items)
        first.set()
        waiting: list[Any] = []
        waiter = threading.Thread(target=lambda: waiting.append(http(srv, {"text_input": "Hi", "max_tokens": 2})))
        waiter.start()
        # the engine's own count (the operator's state control), not a gauge that may still show the long one waiting
        wait_for(lambda: post_control(srv.operator_port, "state")["num_waiting"] == 1, "a waiting request")
        status, message, retry = http(srv, {"text_input": "Hi", "max_tokens": 2})
        assert status == 503 and retry is not None and int(retry) >= 1, message
        said(ErrorKind.OVERLOADED, message)
        err = grpc(srv, "Hi", max_tokens=2)
        assert isinstance(err, GenerationError) and err.kind is ErrorKind.OVERLOADED and err.retry_after >= 1
        said(ErrorKind.OVERLOADED, str(err))
        running.cancel()
    waiter.join(timeout=120)
    assert waiting and waiting[0][0] == 200, waiting  # the waiting one was served once the long one left

    # draining: the operator drains the engine; both ports refuse with a Retry-After; resume admits again
    assert post_control(srv.operator_port, "drain")["draining"] is True
    try:
        status, message, retry = http(srv, {"text_input": "Hi", "max_tokens": 2})
        assert (status, retry) == (503, "1"), message
        said(ErrorKind.DRAINING, message)
        err = grpc(srv, "Hi", max_tokens=2)
        assert isinstance(err, GenerationError) and (err.kind, err.retry_after) == (ErrorKind.DRAINING, 1)
        said(ErrorKind.DRAINING, str(err))
    finally:
        assert post_control(srv.operator_port, "resume")["draining"] is False
    assert http(srv, {"text_input": "Hi", "max_tokens": 2})[0] == 200 and grpc(srv, "Hi", max_tokens=2) == 2


def test_each_kind_has_its_status_over_http_and_grpc(server: TritonServer) -> None:
    check_every_kind(server, None)
    wait_for(lambda: gauge(server, "morphserve_kv_blocks_used") == 0, "KV back to 0")


def test_rewording_the_engines_messages_changes_no_status(planted: TritonServer) -> None:
    check_every_kind(planted, LIES)
