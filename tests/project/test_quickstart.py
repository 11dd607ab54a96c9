"""The README's quickstart, run as a new user would: the launcher `make serve` runs, the README's own curl body for
one generate, and the stop it documents (SIGTERM to the launcher: drains, exits 0). Ports are free loopback
ports instead of 8000-8002, and the embedded model stands in for engines/smollm2-135m (same weights)."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.triton_support import skip_module_without_triton

skip_module_without_triton()

from serve.triton.server import free_port  # noqa: E402

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def quickstart() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## Quickstart")
    return text[start:text.index("\n## ", start + 1)]


def readme_generate_request() -> tuple[str, dict]:
    """(path, JSON body) of the quickstart's first non-streaming curl generate."""
    for line in quickstart().replace("\\\n", " ").splitlines():
        if "curl" in line and "/generate " in line + " " and "generate_stream" not in line:
            words = shlex.split(line)
            url = next(w for w in words if "/v2/models/" in w)
            body = json.loads(words[words.index("-d") + 1])
            return url[url.index("/v2/"):], body
    raise AssertionError("the README's quickstart has no curl generate")


def test_the_quickstart_documents_make_serve_and_the_stop_it_uses() -> None:
    q = quickstart()
    assert "make serve" in q and "SIGTERM" in q
    make_serve = re.search(r"^serve:[^\n]*\n\t([^\n]+)", (REPO / "Makefile").read_text(), re.M)
    assert make_serve and "-m serve.triton --engine-dir" in make_serve.group(1)  # what the test below starts
    path, body = readme_generate_request()
    # the first request is Triton's LLM guide's: TensorRT-LLM's LLM-API model under its upstream name
    assert path == "/v2/models/tensorrt_llm/generate" and body["text_input"] and body["sampling_param_max_tokens"] > 0


def test_quickstart_start_one_generate_stop() -> None:
    path, body = readme_generate_request()
    http, grpc, metrics = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "serve.triton", "--engine-dir", "smollm2-135m", "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--operator-port", "0"]  # 0: a free one
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # noqa: S603
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(p.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(300)
        assert line and "morphserve ready" in line[0], f"no ready line: {line} {p.poll()}"
        req = urllib.request.Request(f"http://127.0.0.1:{http}{path}", data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310 - loopback
            answer = json.loads(resp.read())
        assert resp.status == 200 and isinstance(answer["text_output"], str) and answer["text_output"]
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
