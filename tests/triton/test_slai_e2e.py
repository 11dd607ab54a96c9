"""slai through the real tritonserver: a tier-0 request with a tight TBT target keeps it while a burst of
relaxed requests arrives, and invalid SLO inputs are rejected with clear errors."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

pytest.importorskip("tritonclient.grpc")

from tests.triton_support import running_server, skip_module_without_triton  # noqa: E402

from serve.triton.client import GenerationError, GrpcStream, request_inputs  # noqa: E402
from serve.triton.server import TritonServer  # noqa: E402

skip_module_without_triton()

MODEL = "morphserve"
TIGHT_TBT_S = 2.0   # generous for a shared 2-core machine; relaxed requests get 30 s
PARAMS: dict[str, Any] = {
    "engine_dir": "smollm2-135m", "morph_mode": "off", "scheduler": "slai", "max_model_len": 512,
    "num_kv_blocks": 256, "max_num_seqs": 16, "max_num_batched_tokens": 64, "max_tokens_limit": 64,
    "poll_interval_s": 0.02, "num_threads": 1, "slo_tbt_s": 30.0,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with running_server(PARAMS, tmp_path_factory.mktemp("triton-slai")) as srv:
        yield srv


def stream_token_times(srv: TritonServer, arrays: dict[str, np.ndarray], times: list[float], errors: list[str]) -> None:
    try:
        with GrpcStream(srv.grpc_url, MODEL) as s:
            s.send(arrays)
            seen = 0
            for item in s.responses(timeout=300):
                n = item.get("num_output_tokens") or 0
                if n > seen:
                    times.extend([time.monotonic()] * (n - seen))
                    seen = n
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(f"{type(exc).__name__}: {exc}")


def test_tight_tier0_request_keeps_its_tbt_during_a_relaxed_burst(server: TritonServer) -> None:
    tight: list[float] = []
    errors: list[str] = []
    t = threading.Thread(target=stream_token_times, args=(server, request_inputs(
        "Tell me a long story about a cat.", max_tokens=48, stream=True, ignore_eos=True,
        tbt_slo_s=TIGHT_TBT_S, priority=0), tight, errors))
    t.start()
    deadline = time.monotonic() + 120
    while len(tight) < 4 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(tight) >= 4, f"tight request did not start streaming: {errors}"
    burst_start = time.monotonic()
    relaxed = [[] for _ in range(6)]
    burst = [threading.Thread(target=stream_token_times, args=(server, request_inputs(
        f"Story {i}: " + "the quick brown fox jumps over the lazy dog " * 18, max_tokens=16, stream=True,
        ignore_eos=True), relaxed[i], errors)) for i in range(6)]
    for b in burst:
        b.start()
    for th in [t, *burst]:
        th.join(timeout=300)
    assert not errors, errors
    assert len(tight) == 48 and all(len(r) == 16 for r in relaxed)
    assert relaxed[0][0] > burst_start  # the burst really overlapped the tight request's decoding
    gaps = sorted(b - a for a, b in zip(tight, tight[1:]) if b > burst_start)
    assert len(gaps) >= 10, "the tight request finished before the burst"
    # Generous bounds for a shared machine: 90 % of the gaps within 1.5x the target, no stall over 5x.
    p90 = gaps[int(0.9 * (len(gaps) - 1))]
    assert p90 <= 1.5 * TIGHT_TBT_S and gaps[-1] <= 5 * TIGHT_TBT_S, f"tight request's gaps during the burst: {gaps}"
    # No comparison with the relaxed requests' gaps: slai spends a decode's slack on prefills by design (a decode
    # turns critical only near last token + TBT - theta x mean batch), so on a fast machine the tight request's
    # longest gap approaches its 2 s target while a short burst's relaxed decodes never wait that long (seen:
    # tight 1.82 s vs relaxed 1.70 s, at this commit and before it). The order itself (critical decodes first,
    # in LST order, then prefills, then relaxed decodes) is checked exactly in tests/engine/test_slai.py.


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"tbt_slo_s": 0.0}, "tbt_slo_s must be a finite number of seconds > 0"),
    ({"tbt_slo_s": float("nan")}, "tbt_slo_s"),
    ({"ttft_slo_s": -1.0}, "ttft_slo_s must be a finite number of seconds > 0"),
    ({"priority": 10}, "priority must be an integer tier in [0, 9]"),
    ({"priority": -1}, "priority must be an integer tier"),
], ids=["tbt-zero", "tbt-nan", "ttft-negative", "priority-high", "priority-negative"])
def test_invalid_slo_inputs_rejected(server: TritonServer, kwargs: dict, expected: str) -> None:
    with GrpcStream(server.grpc_url, MODEL) as s:
        s.send(request_inputs("hi", max_tokens=2, **kwargs))
        with pytest.raises(GenerationError) as info:
            for _ in s.responses(timeout=60):
                pass
    assert expected.lower() in str(info.value).lower(), str(info.value)


def test_slo_inputs_wrong_type_and_over_http(server: TritonServer) -> None:
    arrays = request_inputs("hi", max_tokens=2)
    arrays["tbt_slo_s"] = np.array([1], dtype=np.int32)
    with GrpcStream(server.grpc_url, MODEL) as s:
        with pytest.raises(Exception, match="tbt_slo_s"):
            s.send(arrays)
            for _ in s.responses(timeout=60):
                pass
    body = json.dumps({"text_input": "hi", "max_tokens": 2, "priority": 12}).encode()
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/generate", data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    assert "priority" in info.value.read().decode()
    ok = json.dumps({"text_input": "hi", "max_tokens": 2, "tbt_slo_s": 0.5, "ttft_slo_s": 1.0, "priority": 0}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/generate",
                                                       data=ok, method="POST"), timeout=120) as r:
        assert json.loads(r.read())["num_output_tokens"] == 2
