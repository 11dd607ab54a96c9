"""N MorphServe workers behind Dynamo's frontend on one machine (``make serve-dynamo``), or the workers of
one machine of many (``--discovery etcd``, no frontend with ``--replicas N --no-frontend``).

Processes: ``python -m dynamo.frontend`` (OpenAI API on 127.0.0.1) and N ``python -m serve.dynamo`` workers,
all with file discovery in a private directory (or etcd), the TCP request plane and the ZMQ event plane,
every address pinned to 127.0.0.1 (Dynamo otherwise advertises the first non-loopback address). Each
worker gets its own system port (``/metrics``, ``/health``, ``/engine/control/morph_state``). One line
is printed when everything is ready; Ctrl-C / SIGTERM stops all processes (SIGTERM, then SIGKILL).

No Dynamo import here: this module only starts processes, so tests drive it from the project's own venv
and the processes run under the Dynamo venv's interpreter (``--python``).
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from serve.dynamo.http import get_json, get_text
from serve.model.embedded import EMBEDDED_MODEL

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"


def free_port(low: int = 0, high: int = 0) -> int:
    """A free TCP port on 127.0.0.1: any (the OS picks), or one in [low, high)."""
    if not low:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK, 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


def free_system_port() -> int:
    """Dynamo 1.6.1 reads DYN_SYSTEM_PORT as a signed 16-bit integer, so it must stay below 32768
    (the OS hands out ephemeral ports above that)."""
    return free_port(20000, 32768)


def dynamo_env(discovery: str, store_dir: Path | None, etcd_endpoints: str | None = None,
               grace_s: float = 0.0, host: str = LOOPBACK) -> dict[str, str]:
    """Environment shared by the frontend and the workers. ``host`` is the address this machine's
    processes listen on and advertise to the others (loopback on one machine; the machine's own address
    in a multi-machine deployment). Metrics/control ports and the OpenAI port stay on loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    env.update({
        "DYN_DISCOVERY_BACKEND": discovery, "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": host, "DYN_TCP_RESPONSE_STREAM_HOST": host, "DYN_EVENT_PLANE_HOST": host,
        "DYN_SYSTEM_HOST": LOOPBACK, "DYN_HTTP_HOST": LOOPBACK,
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": f"{grace_s:g}",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]),
        "PYTHONUNBUFFERED": "1",
    })
    if discovery == "file":
        assert store_dir is not None
        env["DYN_FILE_KV"] = str(store_dir)
    elif discovery == "etcd":
        env["ETCD_ENDPOINTS"] = etcd_endpoints or f"http://{LOOPBACK}:2379"
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    port: int  # HTTP port (frontend) or system port (worker)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class ClusterConfig:
    replicas: int = 2
    model: str = EMBEDDED_MODEL
    http_port: int = 8080
    system_port_base: int = 8180          # worker i listens on base + i (0 = free ports; all < 32768)
    router_mode: str = "least-loaded"
    migration_limit: int = 3
    worker_args: list[str] = field(default_factory=list)   # extra `python -m serve.dynamo` options
    frontend_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    discovery: str = "file"
    etcd_endpoints: str | None = None
    frontend: bool = True
    log_dir: Path | None = None
    served_model_name: str = "morphserve"
    grace_s: float = 0.0
    host: str = LOOPBACK                  # address other machines reach this one's workers/frontend on
    http_host: str = LOOPBACK             # the frontend's OpenAI port listens here (clients on other machines)
    system_host: str = LOOPBACK           # the workers' /metrics and /engine/control listen here
    stream_timeout_s: float | None = None  # frontend: a stream silent this long moves to another worker
    etcd_lease_ttl_s: int | None = None    # etcd discovery: how long a process rides out an etcd outage


class Cluster:
    """Start, inspect and stop the processes; every wait is bounded."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self._tmp = tempfile.TemporaryDirectory(prefix="morphserve-dynamo-")
        self.root = Path(self._tmp.name)
        self.log_dir = Path(config.log_dir) if config.log_dir else self.root / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dynamo_env(config.discovery, self.root / "discovery", config.etcd_endpoints, config.grace_s,
                              config.host)
        self.env["DYN_SYSTEM_HOST"] = config.system_host
        self.env["DYN_HTTP_HOST"] = config.http_host
        if config.etcd_lease_ttl_s is not None:
            self.env["ETCD_LEASE_TTL"] = str(config.etcd_lease_ttl_s)
        self.frontend: Proc | None = None
        self.workers: list[Proc] = []
        self._started = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.config.http_host}:{self.config.http_port}"

    def _spawn(self, name: str, argv: list[str], port: int, extra_env: dict[str, str] | None = None) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed with it
        env = {**self.env, **(extra_env or {})}
        popen = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        return Proc(name, popen, log_path, port)

    def start_frontend(self) -> Proc:
        c = self.config
        argv = [c.python, "-m", "dynamo.frontend", "--http-host", c.http_host, "--http-port", str(c.http_port),
                "--router-mode", c.router_mode, "--discovery-backend", c.discovery,
                "--migration-limit", str(c.migration_limit), *c.frontend_args]
        timeout = "DYN_HTTP_BACKEND_STREAM_TIMEOUT_SECS"
        extra = {} if c.stream_timeout_s is None else {timeout: f"{c.stream_timeout_s:g}"}
        self.frontend = self._spawn("frontend", argv, c.http_port, extra)
        return self.frontend

    def add_worker(self, extra_args: list[str] | None = None) -> Proc:
        """Start one more worker (it joins the running frontend through discovery)."""
        c = self.config
        index = self._started
        self._started += 1
        port = c.system_port_base + index if c.system_port_base else free_system_port()
        argv = [c.python, "-m", "serve.dynamo", "--model", c.model, "--served-model-name", c.served_model_name,
                "--discovery-backend", c.discovery, "--model-card-dir", str(self.root / "card"),
                *c.worker_args, *(extra_args or [])]
        proc = self._spawn(f"worker-{index}", argv, port, {"DYN_SYSTEM_PORT": str(port)})
        self.workers.append(proc)
        return proc

    def start(self) -> None:
        if self.config.frontend:
            self.start_frontend()
        for _ in range(self.config.replicas):
            self.add_worker()

    # ---- readiness ---------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        for p in [self.frontend, *self.workers]:
            if p is not None and not p.alive() and not getattr(p, "expected_exit", False):
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}; log {p.log_path}:\n{p.log_tail()}")

    def check_frontend_accepted_all(self) -> None:
        """The frontend refuses a worker whose model card differs from the first one's (other path, other
        KV size or context): that worker would sit idle, so say so instead of reporting ready."""
        if self.frontend is None:
            return
        for line in self.frontend.log_tail(10_000).splitlines():
            if "Rejected incompatible workers" in line:
                raise RuntimeError("the frontend rejected a worker whose registration differs from the first one's "
                                   "(every worker of a model needs the same --model-card-dir and engine options): "
                                   + _strip_ansi(line)[-400:])

    def worker_ready(self, proc: Proc) -> bool:
        body = get_text(f"http://{self.config.system_host}:{proc.port}/metrics", timeout=2.0)
        return body is not None and "dynamo_component_total_blocks" in body

    def wait_ready(self, timeout_s: float = 300.0, workers: list[Proc] | None = None) -> float:
        """Until every live worker publishes its KV capacity and the frontend lists the model."""
        t0 = time.monotonic()
        pending = list(workers if workers is not None else [w for w in self.workers if w.alive()])
        while time.monotonic() - t0 < timeout_s:
            self._check_alive()
            pending = [w for w in pending if not self.worker_ready(w)]
            if not pending and (self.frontend is None or self.model_listed()):
                time.sleep(0.5)  # the frontend may still be comparing the last worker's registration
                self.check_frontend_accepted_all()
                return time.monotonic() - t0
            time.sleep(0.25)
        raise TimeoutError(f"not ready after {timeout_s:.0f} s; waiting for {[w.name for w in pending]} "
                           f"(logs in {self.log_dir})")

    def model_listed(self) -> bool:
        models = get_json(f"{self.base_url}/v1/models", timeout=2.0)
        return bool(models) and any(m.get("id") == self.config.served_model_name for m in models.get("data", []))

    # ---- stopping ----------------------------------------------------------------------------------
    def kill_worker(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        proc.expected_exit = True  # type: ignore[attr-defined]
        _signal_group(proc, sig)
        proc.popen.wait(timeout=30)

    def stop(self, timeout_s: float = 20.0) -> None:
        procs = [p for p in [*self.workers, self.frontend] if p is not None]
        for p in procs:
            p.expected_exit = True  # type: ignore[attr-defined]
            if p.alive():
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.popen.wait(timeout=10)

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _signal_group(proc: Proc, sig: int) -> None:
    """The process and whatever it started (each process leads its own session)."""
    try:
        os.killpg(proc.popen.pid, sig)
    except ProcessLookupError:
        pass
