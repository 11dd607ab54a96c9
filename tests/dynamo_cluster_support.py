"""Shared by the Dynamo end-to-end tests: find the Dynamo interpreter, start a bounded cluster on free
loopback ports, scrape worker metrics, and compute the engine's own greedy output in-process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from serve.dynamo.cluster import Cluster, ClusterConfig, Proc, free_port
from serve.dynamo.http import get_text, metric_values
from tests.ci_skip_policy import skip_outside_ci

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
# Small context and pool keep the workers and the in-process reference light; one torch thread per
# process because the 2 cores are shared (OpenMP spinning made multi-thread engines far slower here).
BASE_WORKER_ARGS = ["--morph-mode", "off", "--max-model-len", "256", "--num-kv-blocks", "64",
                    "--max-num-seqs", "8", "--num-threads", "1"]
READY_TIMEOUT_S = 240.0


def require_root() -> None:
    """Network namespaces need root. CI runs as root, so there a non-root run is a failure, not a skip."""
    if os.geteuid() != 0:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("this test needs root (network namespaces) and CI runs as root")
        pytest.skip("needs root: network namespaces (CI runs these as root)")


def dynamo_python() -> str:
    """The interpreter with ai-dynamo (make install-dynamo); the tests skip where it is missing or broken (and fail
    under CI=true, whose `make install` installs it)."""
    py = os.environ.get("MORPHSERVE_DYNAMO_PYTHON") or str(REPO_ROOT / ".venv-dynamo" / "bin" / "python")
    if not Path(py).exists():
        skip_outside_ci(f"no Dynamo interpreter at {py} (make install-dynamo)")
    probe = subprocess.run([py, "-c", "import dynamo.frontend, dynamo.common.backend"], capture_output=True,
                           timeout=120)
    if probe.returncode != 0:
        skip_outside_ci(f"{py} cannot import dynamo: {probe.stderr.decode()[-400:]}")
    return py


@contextlib.contextmanager
def running_cluster(replicas: int, worker_args: list[str] | None = None, base_args: list[str] | None = None,
                    **config: Any) -> Iterator[Cluster]:
    base = BASE_WORKER_ARGS if base_args is None else base_args
    cfg = ClusterConfig(replicas=replicas, model=MODEL, http_port=free_port(), system_port_base=0,
                        worker_args=[*base, *(worker_args or [])], python=dynamo_python(), **config)
    cluster = Cluster(cfg)
    try:
        cluster.start()
        cluster.wait_ready(READY_TIMEOUT_S)
        yield cluster
    except BaseException:
        for p in [cluster.frontend, *cluster.workers]:
            if p is not None:
                print(f"---- {p.name} ({p.log_path})\n{p.log_tail(40)}")
        raise
    finally:
        cluster.close()


def worker_metric(proc: Proc, name: str) -> float:
    """Sum of metric ``name`` on one worker's /metrics (NaN when the worker does not answer)."""
    text = get_text(f"http://127.0.0.1:{proc.port}/metrics", timeout=5.0)
    if text is None:
        return float("nan")
    return sum(metric_values(text, name))


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def openai_client(cluster: Cluster):
    import openai  # the dev extra's client (pyproject.toml)

    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", timeout=120.0, max_retries=0)


class ReferenceEngine:
    """The engine in-process with the workers' configuration: its greedy output is what Dynamo must return."""

    def __init__(self) -> None:
        import torch

        from serve.config import EngineConfig
        from serve.engine import LLMEngine

        threads = torch.get_num_threads()  # the engine sets torch's process-wide thread count; restore it
        try:
            self.engine = LLMEngine(EngineConfig(model=MODEL, morph_mode="off", max_model_len=256, num_kv_blocks=64,
                                                 max_num_seqs=8, num_threads=1))
        finally:
            torch.set_num_threads(threads)

    def greedy(self, prompt: str | list[int], max_tokens: int, **params: Any) -> dict:
        from serve.engine import SamplingParams

        return self.engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))[0]

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return self.engine.tokenizer.apply_chat_template(messages)
