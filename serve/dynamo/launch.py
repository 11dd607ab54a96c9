"""``python -m serve.dynamo.launch`` (``make serve-dynamo``): Dynamo's frontend + N MorphServe workers.

  .venv-dynamo/bin/python -m serve.dynamo.launch --replicas 2 --http-port 8080 --model engines/smollm2-135m
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

from serve.config_flags import add_engine_flags
from serve.dynamo.cluster import Cluster, ClusterConfig
from serve.model.embedded import EMBEDDED_MODEL

ROUTER_MODES = ("least-loaded", "kv", "round-robin", "random", "power-of-two")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serve.dynamo.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="workers on this machine (default: %(default)s)")
    add_engine_flags(p, ("model",), defaults={"model": EMBEDDED_MODEL}, help_suffix=" for every worker")
    p.add_argument("--http-port", type=int, default=8080, help="frontend port on --http-host (default: %(default)s)")
    p.add_argument("--system-port-base", type=int, default=8180,
                   help="worker i's /metrics and /engine/control port is BASE+i (default: %(default)s)")
    p.add_argument("--router-mode", default="least-loaded", choices=ROUTER_MODES,
                   help="how the frontend picks a worker (default: %(default)s; see README)")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times a request may move to another worker when its worker dies (default: %(default)s)")
    p.add_argument("--stream-timeout", type=float, default=None, metavar="S",
                   help="the frontend moves a stream that has sent nothing for S seconds to another worker (counts "
                        "against --migration-limit; Dynamo's DYN_HTTP_BACKEND_STREAM_TIMEOUT_SECS; default: never)")
    p.add_argument("--etcd-lease-ttl", type=int, default=None, metavar="S",
                   help="with --discovery etcd: a process that cannot renew its etcd lease for S seconds shuts "
                        "itself down (Dynamo's ETCD_LEASE_TTL; default: Dynamo's, 30 s in 1.6.1)")
    p.add_argument("--discovery", default="file", choices=["file", "etcd"],
                   help="file: one machine; etcd: many machines (ETCD_ENDPOINTS)")
    p.add_argument("--etcd-endpoints", default=None, help="with --discovery etcd (default: http://127.0.0.1:2379)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address this machine's workers/frontend advertise to the other machines (default: "
                        "%(default)s, one machine); the OpenAI and metrics ports follow --http-host / --system-host")
    p.add_argument("--http-host", default="127.0.0.1",
                   help="address the frontend's OpenAI port listens on (default: %(default)s; the address clients "
                        "on other machines reach when the frontend has a machine of its own)")
    p.add_argument("--system-host", default="127.0.0.1",
                   help="address the workers' /metrics and /engine/control ports listen on (default: %(default)s)")
    p.add_argument("--no-frontend", action="store_true", help="workers only (a worker machine of a cluster)")
    p.add_argument("--python", default=sys.executable, help="interpreter with ai-dynamo installed")
    p.add_argument("--log-dir", default=None, help="process logs (default: a new temporary directory)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("worker_args", nargs=argparse.REMAINDER,
                   help="after --: options for every worker (python -m serve.dynamo --help)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    worker_args = [a for a in args.worker_args if a != "--"]
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="morphserve-dynamo-logs-"))
    cluster = Cluster(ClusterConfig(
        replicas=args.replicas, model=args.model, http_port=args.http_port, system_port_base=args.system_port_base,
        router_mode=args.router_mode, migration_limit=args.migration_limit, worker_args=worker_args,
        python=args.python, discovery=args.discovery, etcd_endpoints=args.etcd_endpoints,
        frontend=not args.no_frontend, log_dir=log_dir, host=args.host,
        http_host=args.http_host, system_host=args.system_host, stream_timeout_s=args.stream_timeout,
        etcd_lease_ttl_s=args.etcd_lease_ttl))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start()
        elapsed = cluster.wait_ready(args.ready_timeout)
        print(ready_line(cluster, elapsed), flush=True)
        reported: set[str] = set()
        while not stop.wait(1.0):
            if watch(cluster, reported):
                return 1
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        print(f"stopped; logs in {log_dir}", file=sys.stderr)
    return 0


def watch(cluster: Cluster, reported: set[str]) -> bool:
    """Say once when a worker exits (the others keep serving; the frontend migrates its requests);
    True when nothing can serve any more (the frontend or every worker is gone)."""
    for w in cluster.workers:
        if not w.alive() and w.name not in reported:
            reported.add(w.name)
            left = sum(x.alive() for x in cluster.workers)
            print(f"{w.name} exited with code {w.popen.returncode} ({left} worker(s) left); log {w.log_path}",
                  file=sys.stderr, flush=True)
    if cluster.frontend is not None and not cluster.frontend.alive():
        print(f"the frontend exited with code {cluster.frontend.popen.returncode}; log {cluster.frontend.log_path}",
              file=sys.stderr)
        return True
    return bool(cluster.workers) and not any(w.alive() for w in cluster.workers)


def ready_line(cluster: Cluster, elapsed_s: float) -> str:
    c = cluster.config
    ports = ",".join(str(w.port) for w in cluster.workers)
    if not c.frontend:
        return (f"morphserve dynamo workers ready in {elapsed_s:.1f} s: {c.replicas} worker(s), metrics on "
                f"{c.system_host}:{ports}")
    return (f"morphserve ready in {elapsed_s:.1f} s: {c.replicas} worker(s) behind Dynamo's frontend "
            f"{cluster.base_url} (router {c.router_mode}; worker metrics on {c.system_host}:{ports}; logs "
            f"{cluster.log_dir}); try: "
            f"curl -s {cluster.base_url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{{\"model\": \"{c.served_model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": "
            f"\"Hello!\"}}], "
            f"\"max_tokens\": 32}}'")


if __name__ == "__main__":
    sys.exit(main())
