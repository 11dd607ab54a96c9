"""A Dynamo cluster of separate hosts on one machine (``make serve-dynamo-hosts``): etcd on one network
namespace, Dynamo's frontend on another, one MorphServe worker on each of the others, each host started
with the multi-machine recipe of docs/dynamo.md (``python -m serve.dynamo.launch --discovery etcd --host
<its address>``), as an operator would run it on real machines.

What crosses hosts, and how (Dynamo 1.6.1, no NATS): discovery and model cards through etcd (a worker's
tokenizer files reach the frontend inside its card: every host has a private tmpfs over the card
directory, so nothing is shared through the file system); requests over the TCP request plane (the
worker listens on its address, the frontend's response-stream server on its own); KV events and load
over the ZMQ event plane (each publisher binds on its host's address and advertises it in etcd; the
frontend's router connects to each). The frontend's OpenAI port and the workers' ``/metrics`` listen on
their host's address so the root namespace (the client machine, the bridge's ``.1``) reaches them.

Recovery settings the recipe needs across hosts, and why:
- ``--etcd-lease-ttl`` (90 s here, Dynamo's default 30 s): a Dynamo process that cannot renew its etcd
  lease before it expires shuts itself down, so with the default a 30 s etcd outage takes down every
  worker and the frontend; a longer lease rides it out (a dead worker is still noticed at once by the
  request plane, and its registration goes when the lease does).
- ``--stream-timeout`` (10 s here, Dynamo's default: none): a stream whose worker went silent (a cut
  link: TCP neither fails nor delivers) moves to another worker after this long instead of hanging.
- a supervisor per host restarts its launcher when it exits (as systemd ``Restart=always`` or a pod's
  restart policy would): a worker that lost its lease, or whose processes were killed, rejoins.

Everything is torn down on exit, even after a failure (context manager, atexit); a run that crashed
before its teardown is cleaned up by the next one (serve/dynamo/netns.py :func:`remove_stale`).
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from serve.config_flags import add_engine_flags
from serve.dynamo.cluster import REPO_ROOT
from serve.dynamo.host_recipe import (
    DEFAULT_WORKER_ARGS,
    ETCD_PORT,
    HTTP_PORT,
    SYSTEM_PORT,
    HostsConfig,
    etcd_argv,
    launcher_argv,
)
from serve.dynamo.http import get_json, get_text, metric_values, post_json
from serve.dynamo.launch import ROUTER_MODES
from serve.dynamo.linkem import LinkEmulator
from serve.dynamo.netns import HostLink, Network, kill_namespace_processes, leftovers
from serve.model.embedded import EMBEDDED_MODEL
from serve.operator_auth import ENV_KEY


@dataclass
class Host:
    name: str
    role: str                              # etcd | frontend | worker
    link: HostLink
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    supervised: bool = False               # restarted when it exits (from the end of the start on)
    in_service: bool = True                # False: a spare host, or one stop_host() stopped
    restarts: list[float] = field(default_factory=list)   # time.monotonic() of each restart

    @property
    def address(self) -> str:
        return self.link.address

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class HostCluster:
    """``with HostCluster(HostsConfig()) as c:`` etcd + frontend + N worker hosts, ready; torn down at exit."""

    def __init__(self, config: HostsConfig) -> None:
        self.config = config
        self.net = Network()
        self.emulator: LinkEmulator | None = None
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.net.tag}-"))
        self.log_dir = Path(config.log_dir) if config.log_dir else self.root / "logs"
        self.private = self.root / "private"   # each host mounts its own tmpfs here (the card lives in it)
        self.hosts: dict[str, Host] = {}
        # the workers' system ports listen on their hosts' addresses, beyond loopback: like any multi-host
        # deployment the cluster sets an operator key (the caller's, or one of its own) so their controls are signed
        self.operator_key = os.environ.get(ENV_KEY) or secrets.token_hex(32)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._closed = False
        self._sigterm = None
        atexit.register(self.close)

    # ---- addresses ---------------------------------------------------------------------------------
    @property
    def etcd_url(self) -> str:
        return f"http://{self.hosts['etcd'].address}:{ETCD_PORT}"

    @property
    def base_url(self) -> str:
        return f"http://{self.hosts['frontend'].address}:{HTTP_PORT}"

    @property
    def workers(self) -> list[Host]:
        return [h for h in self.hosts.values() if h.role == "worker" and h.in_service]

    def metrics_url(self, host: Host) -> str:
        return f"http://{host.address}:{SYSTEM_PORT}/metrics"

    @property
    def frontend_log(self) -> Path:
        return self.log_dir / "frontend" / "frontend.log"

    # ---- bring-up ----------------------------------------------------------------------------------
    def __enter__(self) -> HostCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        c = self.config
        self._exit_on_sigterm()
        if not Path(c.python).exists():
            raise FileNotFoundError(f"no Dynamo interpreter at {c.python} (make install-dynamo)")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.private.mkdir(parents=True, exist_ok=True)
        self.net.create()
        if c.emulated_links:
            self.emulator = LinkEmulator()
        self._add("etcd", "etcd")
        self._add("frontend", "frontend")
        for i in range(1, c.workers + c.spare_workers + 1):
            self._add(f"worker-{i}", "worker", emulated=c.emulated_links).in_service = i <= c.workers
        self._spawn(self.hosts["etcd"])
        self._wait(lambda: self.etcd_healthy(), 60, "etcd")
        for host in self.hosts.values():
            if host.role != "etcd" and host.in_service:
                self._spawn(host)
        self.wait_ready(c.ready_timeout_s)  # unsupervised until ready: a host that cannot start fails the start
        for host in self.hosts.values():
            host.supervised = host.in_service
        self._supervisor = threading.Thread(target=self._supervise, name="hosts-supervisor", daemon=True)
        self._supervisor.start()

    def _add(self, name: str, role: str, emulated: bool = False) -> Host:
        link = self.net.add_host(name, emulator=self.emulator if emulated else None)
        if role == "etcd":
            argv = etcd_argv(self.config, link, self.root / "etcd-data")
        else:
            argv = launcher_argv(self.config, role, link, self.hosts["etcd"].address, self.log_dir / name,
                                 self.private / "card")
        host = Host(name, role, link, argv, self.log_dir / name / "launcher.out")
        host.log.parent.mkdir(parents=True, exist_ok=True)
        self.hosts[name] = host
        return host

    def _spawn(self, host: Host) -> None:
        """Start the host's process inside its namespace, over a private tmpfs (its own card directory)."""
        wrapper = ["ip", "netns", "exec", host.link.ns, "sh", "-c",
                   'mount -t tmpfs -o size=64m,mode=0700 morphserve-host "$0" && exec "$@"', str(self.private)]
        with open(host.log, "ab") as out:
            host.proc = subprocess.Popen([*wrapper, *host.argv], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self._env(), start_new_session=True)

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "ETCD_"))}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        env[ENV_KEY] = self.operator_key
        return env

    def _exit_on_sigterm(self) -> None:
        """SIGTERM's default action skips every ``finally`` and atexit: turn it into SystemExit (main thread,
        when nobody else handles it) so the hosts are torn down; the next run's remove_stale covers SIGKILL."""
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            def on_sigterm(*_: object) -> None:
                raise SystemExit(128 + signal.SIGTERM)
            self._sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    # ---- readiness ---------------------------------------------------------------------------------
    def etcd_healthy(self) -> bool:
        return get_text(f"{self.etcd_url}/health", timeout=1.0) is not None

    def worker_ready(self, host: Host) -> bool:
        body = get_text(self.metrics_url(host), timeout=2.0)
        return body is not None and "dynamo_component_total_blocks" in body

    def metric(self, host: Host, name: str, **labels: str) -> float:
        """Sum of metric ``name`` (the samples carrying ``labels``) on a worker host's /metrics; NaN when
        the host does not answer."""
        body = get_text(self.metrics_url(host), timeout=5.0)
        if body is None:
            return float("nan")
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        lines = [line for line in body.splitlines() if all(w in line for w in wanted)]
        return sum(metric_values("\n".join(lines), name))

    def instance_id(self, host: Host) -> int | None:
        """The Dynamo instance id of the worker running on ``host`` now (the frontend logs it in decimal)."""
        body = get_text(self.metrics_url(host), timeout=5.0) or ""
        m = re.search(r'dynamo_component_requests_total\{[^}]*worker_id="([0-9a-f]+)"', body)
        return int(m.group(1), 16) if m else None

    def serves(self, host: Host, timeout_s: float = 10.0) -> bool:
        """Whether the frontend gets an answer from this worker host now: a one-token request pinned to its
        instance (Dynamo's ``nvext.backend_instance_id``), so the router's choice does not matter."""
        instance = self.instance_id(host)
        if instance is None:
            return False
        body = {"model": "morphserve", "prompt": "ping", "max_tokens": 1, "temperature": 0,
                "nvext": {"backend_instance_id": instance}}
        try:
            answer = post_json(f"{self.base_url}/v1/completions", body, timeout=timeout_s)
        except (OSError, ValueError):
            return False
        return bool(answer.get("choices"))

    def registered_workers(self) -> int:
        """Worker instances registered in etcd (what a frontend that starts now would find)."""
        etcdctl = Path(self.config.python).parent / "etcdctl"
        out = subprocess.run([str(etcdctl), "--endpoints", self.etcd_url, "get", "--prefix", "--keys-only",
                              "v1/instances/dynamo/morphserve/generate/"], capture_output=True, text=True, timeout=10)
        return sum(1 for line in out.stdout.splitlines() if line.strip())

    def frontend_ready(self) -> bool:
        models = get_json(f"{self.base_url}/v1/models", timeout=2.0)
        return bool(models) and any(m.get("id") == "morphserve" for m in models.get("data", []))

    def wait_ready(self, timeout_s: float | None = None, hosts: list[Host] | None = None) -> float:
        """Until etcd answers, every worker (or each of ``hosts``) publishes its capacity, and the frontend lists
        the model; for the whole cluster also until every worker is registered and answers through the frontend."""
        t0 = time.monotonic()
        targets = hosts if hosts is not None else [h for h in self.hosts.values() if h.in_service]

        def ready() -> bool:
            for h in targets:
                if h.role == "worker" and not self.worker_ready(h):
                    return False
                if h.role == "frontend" and not self.frontend_ready():
                    return False
                if h.role == "etcd" and not self.etcd_healthy():
                    return False
            if hosts is not None:
                return True
            # every worker registered, and each answers a request pinned to it through the frontend
            return self.registered_workers() >= len(self.workers) and all(self.serves(w) for w in self.workers)
        self._wait(ready, timeout_s or self.config.ready_timeout_s, "the hosts to be ready")
        return time.monotonic() - t0

    def _wait(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            for h in self.hosts.values():
                if h.proc is not None and not h.alive() and not h.supervised:
                    raise RuntimeError(f"{h.name} exited with {h.proc.returncode}:\n{self.log_tail(h)}")
            time.sleep(0.25)
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}; logs in {self.log_dir}\n"
                           + "\n".join(f"---- {h.name}\n{self.log_tail(h, 15)}" for h in self.hosts.values()))

    def log_tail(self, host: Host, n: int = 40) -> str:
        try:
            return "\n".join(host.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # ---- supervision -------------------------------------------------------------------------------
    def _supervise(self) -> None:
        backoff: dict[str, float] = {}
        while not self._stop.wait(0.25):
            with self._lock:
                for h in self.hosts.values():
                    if not (h.supervised and h.in_service) or h.alive() or self._stop.is_set():
                        continue
                    now = time.monotonic()
                    due = backoff.setdefault(h.name, now + self.config.restart_backoff_s)
                    if now < due:
                        continue
                    kill_namespace_processes(h.link.ns)  # what the dead launcher left (its workers)
                    self._spawn(h)
                    h.restarts.append(now)
                    del backoff[h.name]

    def start_host(self, name: str) -> Host:
        """Start a spare (or stopped) worker host now; it is supervised from here on: if it cannot join
        (etcd unreachable) its launcher exits and is started again until it does."""
        with self._lock:
            host = self.hosts[name]
            host.in_service = host.supervised = True
            if not host.alive():
                self._spawn(host)
            return host

    def stop_host(self, name: str, timeout_s: float = 20.0) -> None:
        """Take a host out of service: SIGTERM its launcher (its worker deregisters), then anything left dies."""
        with self._lock:
            host = self.hosts[name]
            host.in_service = host.supervised = False
            if host.alive():
                os.killpg(host.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
                try:
                    host.proc.wait(timeout=timeout_s)  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:
                    pass
            kill_namespace_processes(host.link.ns)

    # ---- faults ------------------------------------------------------------------------------------
    def kill(self, name: str) -> list[int]:
        """Every process of the host dies at once (SIGKILL); its supervisor restarts the launcher."""
        with self._lock:
            return kill_namespace_processes(self.hosts[name].link.ns)

    def cut(self, name: str) -> None:
        self.net.cut(name)

    def restore(self, name: str) -> None:
        self.net.restore(name)

    def impair(self, name: str, delay_ms: float, loss: float) -> None:
        """Delay and loss on a worker's link (each direction); needs ``emulated_links``."""
        if self.emulator is None or not self.hosts[name].link.emulated:
            raise ValueError(f"{name}'s link is not emulated (HostsConfig(emulated_links=True))")
        self.emulator.impair(self.hosts[name].link.outer, delay_ms, loss)

    # ---- teardown ----------------------------------------------------------------------------------
    def leftovers(self) -> dict[str, list]:
        """Namespaces, links and processes of this cluster still present (empty lists after close)."""
        left = leftovers(self.net.tag)
        left["processes"] += [h.proc.pid for h in self.hosts.values() if h.proc is not None and h.alive()]
        if self.emulator is not None and self.emulator.proc.poll() is None:
            left["processes"].append(self.emulator.proc.pid)
        return left

    def close(self) -> None:
        """Stop every process, delete the namespaces, links and bridge, remove the temporary directory (and
        the logs in it, unless ``log_dir`` put them elsewhere). Idempotent; also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=10)
        with self._lock:
            for h in self.hosts.values():  # launchers stop their processes gracefully on SIGTERM
                if h.alive():
                    os.killpg(h.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
            deadline = time.monotonic() + 15
            for h in self.hosts.values():
                if h.proc is not None:
                    try:
                        h.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
            self.net.destroy()  # SIGKILL for whatever is left in any namespace, then links and namespaces
            for h in self.hosts.values():
                if h.proc is not None and h.proc.poll() is None:
                    h.proc.kill()
                    h.proc.wait(timeout=10)
            if self.emulator is not None:
                self.emulator.close()
        shutil.rmtree(self.root, ignore_errors=True)
        atexit.unregister(self.close)
        if self._sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serve.dynamo.hosts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="worker hosts, one worker each (default: %(default)s)")
    add_engine_flags(p, ("model",), defaults={"model": EMBEDDED_MODEL}, help_suffix=" for every worker")
    p.add_argument("--router-mode", default="kv", choices=ROUTER_MODES,
                   help="the frontend's router (default: %(default)s: KV events cross the hosts)")
    p.add_argument("--stream-timeout", type=float, default=10.0,
                   help="seconds a stream may stay silent before the frontend moves it (default: %(default)s)")
    p.add_argument("--etcd-lease-ttl", type=int, default=90,
                   help="seconds every process's etcd lease lasts without renewal: the longest etcd outage the "
                        "hosts ride out (default: %(default)s; Dynamo's own default is 30)")
    p.add_argument("--emulated-links", action="store_true",
                   help="the workers' links go through the userspace delay/loss emulator (serve/dynamo/linkem.py)")
    p.add_argument("--log-dir", default=None, help="keep the logs here (default: a temporary directory, removed)")
    p.add_argument("worker_args", nargs=argparse.REMAINDER,
                   help="after --: options for every worker (python -m serve.dynamo --help), after the hosts' "
                        "defaults: " + " ".join(DEFAULT_WORKER_ARGS))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    extra = [a for a in args.worker_args if a != "--"]
    config = HostsConfig(workers=args.workers, model=args.model, router_mode=args.router_mode,
                         stream_timeout_s=args.stream_timeout, etcd_lease_ttl_s=args.etcd_lease_ttl,
                         emulated_links=args.emulated_links, worker_args=[*DEFAULT_WORKER_ARGS, *extra],
                         log_dir=Path(args.log_dir) if args.log_dir else None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with HostCluster(config) as cluster:
            hosts = ", ".join(f"{h.name} {h.address}" for h in cluster.hosts.values())
            print(f"morphserve hosts ready: {hosts}; OpenAI API {cluster.base_url}/v1 (router {config.router_mode}); "
                  f"worker metrics on :{SYSTEM_PORT}/metrics; logs {cluster.log_dir}", flush=True)
            stop.wait()
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
