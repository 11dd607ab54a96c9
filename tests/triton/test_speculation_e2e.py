"""The per-request opt-out of self-speculative decoding over every Triton front end, against a real tritonserver whose
engine drafts on every iteration it can (``speculation`` = always): the morphserve model's input ``speculate`` =
false (a gRPC tensor, an HTTP generate key) and TensorRT-LLM's ``num_draft_tokens`` = 0 on ``ensemble`` and
``tensorrt_llm_bls`` (the tensors tensorrtllm_backend's client script sends). A request that opts out drafts
nothing (the engine's own counter, read on the operator port after the answer, does not move); the same request
without it drafts; every answer equals the engine's own greedy output without speculation."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.e2e
pytest.importorskip("tritonclient.grpc")

from serve.triton.client import generate_grpc, generate_http  # noqa: E402
from serve.triton.operator_port import post_control  # noqa: E402
from serve.triton.server import TritonServer  # noqa: E402
from tests.triton.test_trtllm_e2e import client_inputs, run_client  # noqa: E402
from tests.triton_support import running_server, skip_module_without_triton  # noqa: E402

skip_module_without_triton()

PARAMS: dict[str, Any] = {
    "engine_dir": "smollm2-135m", "morph_mode": "off", "max_model_len": 256, "num_kv_blocks": 128,
    "max_num_seqs": 8, "max_tokens_limit": 240, "poll_interval_s": 0.02, "num_threads": 1, "speculation": "always",
}
PROMPT = "The capital of France is"
TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with running_server(PARAMS, tmp_path_factory.mktemp("speculation")) as srv:
        yield srv


@pytest.fixture(scope="module")
def expected() -> str:
    """The engine's own greedy answer, speculation off (the server's configuration otherwise)."""
    import torch

    from serve.config import EngineConfig
    from serve.engine.engine import LLMEngine
    from serve.engine.sampling_params import SamplingParams

    threads = torch.get_num_threads()
    try:
        engine = LLMEngine(EngineConfig(model="smollm2-135m", morph_mode="off", max_model_len=256, num_kv_blocks=128,
                                        max_num_seqs=8, num_threads=1, speculation="off"))
        return engine.generate([PROMPT], SamplingParams(max_tokens=TOKENS))[0]["text"]
    finally:
        torch.set_num_threads(threads)


def drafts(srv: TritonServer) -> int:
    """Sequence drafts the engine verified so far (its stats, through the operator port: exact after an answer)."""
    answer = post_control(srv.operator_port, "state")
    assert answer["status"] == "ok", answer
    return int(answer["stats"]["spec_decode_num_drafts"])


def _http_generate(srv: TritonServer, model: str, body: dict[str, Any]) -> str:
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{model}/generate", data=json.dumps(body).encode(),
                                 method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - loopback
        return json.loads(r.read())["text_output"]


def _trtllm_grpc(srv: TritonServer, model: str, opt_out: bool) -> str:
    extra = {"num_draft_tokens": np.array([[0]], dtype=np.int32)} if opt_out else {}
    answer = run_client(srv, model, client_inputs(PROMPT, TOKENS, False, exclude_input_in_output=True, **extra), False)
    assert not answer.errors, answer.errors
    return answer.text


# front end -> (send one greedy request of TOKENS tokens, opting out or not) -> the completion's text
FRONT_ENDS: dict[str, Callable[[TritonServer, bool], str]] = {
    "morphserve-grpc-speculate": lambda srv, off: generate_grpc(
        PROMPT, url=srv.grpc_url, max_tokens=TOKENS, **({"speculate": False} if off else {})).text,
    "morphserve-http-speculate": lambda srv, off: generate_http(
        PROMPT, url=srv.http_url, max_tokens=TOKENS, **({"speculate": False} if off else {})).text,
    "ensemble-grpc-num_draft_tokens": lambda srv, off: _trtllm_grpc(srv, "ensemble", off),
    "tensorrt_llm_bls-grpc-num_draft_tokens": lambda srv, off: _trtllm_grpc(srv, "tensorrt_llm_bls", off),
    "tensorrt_llm_bls-http-num_draft_tokens": lambda srv, off: _http_generate(srv, "tensorrt_llm_bls", {
        "text_input": PROMPT, "max_tokens": TOKENS, "exclude_input_in_output": True,
        **({"num_draft_tokens": 0} if off else {})}),
}


@pytest.mark.parametrize("opt_out", [True, False], ids=["opted-out", "default"])
@pytest.mark.parametrize("front_end", sorted(FRONT_ENDS))
def test_opting_out_drafts_nothing_and_the_default_drafts(server: TritonServer, expected: str, front_end: str,
                                                          opt_out: bool) -> None:
    before = drafts(server)
    assert FRONT_ENDS[front_end](server, opt_out) == expected
    after = drafts(server)
    if opt_out:
        assert after == before, f"{front_end}: the opted-out request drafted {after - before} times"
    else:
        assert after > before, f"{front_end}: the request did not draft (speculation = always)"
