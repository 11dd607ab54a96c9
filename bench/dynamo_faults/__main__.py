"""Faults of a real cluster, on one machine: ``make bench-dynamo-faults`` (root).

  .venv/bin/python -m bench.dynamo_faults --out docs/benchmarks/dynamo_faults.json
  .venv/bin/python -m bench.dynamo_faults --faults kill-worker,cut-link --repeats 1 --out /tmp/faults.json

A cluster of hosts (serve/dynamo/hosts.py: etcd, the frontend and two worker hosts in network namespaces,
KV routing, --migration-limit 3, stream timeout 10 s, etcd lease 90 s; the workers' links through the
delay/loss emulator; one spare worker host for the etcd fault) serves a steady load of streamed greedy chat
requests (bench/dynamo_faults/load.py) while each fault happens in turn (faults.py: kill-worker, cut-link,
netem, etcd-outage, restart-frontend). Per fault: requests answered / migrated / retried by the client /
failed with an explicit error / lost (must be 0), how long until the cluster is whole again, the longest
time without an answer, P95 TTFT and throughput before / during / after, and whether the KV router then
routes to prefixes its worker really holds (probe.py). ``--repeats N`` brings up a fresh cluster per repeat
and reports every repeat and the median (lost and failed also summed). Timings are only meaningful on a
quiet machine; exit status 1 when a request was lost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench.dynamo_faults.faults import FAULTS, settle
from bench.dynamo_faults.load import Load
from bench.dynamo_faults.probe import kv_probe
from bench.dynamo_faults.report import median_of, summarize
from serve.dynamo.frontend_log import read_attempts
from serve.dynamo.hosts import HostCluster, HostsConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.dynamo_faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default=",".join(FAULTS),
                   help="comma-separated, run in this order (default: all: %(default)s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="fresh clusters, each running every fault (default: %(default)s)")
    p.add_argument("--before", type=float, default=20.0,
                   help="seconds of load before each fault (default: %(default)s)")
    p.add_argument("--after", type=float, default=20.0, help="seconds of load after recovery (default: %(default)s)")
    p.add_argument("--cut-s", type=float, default=20.0, help="how long the link stays cut (default: %(default)s)")
    p.add_argument("--etcd-s", type=float, default=30.0, help="how long etcd is unreachable (default: %(default)s)")
    p.add_argument("--netem-s", type=float, default=30.0,
                   help="how long 50 ms + 1 %% loss lasts (default: %(default)s)")
    p.add_argument("--etcd-lease-ttl", type=int, default=90,
                   help="every process's etcd lease in seconds (Dynamo's default is 30) (default: %(default)s)")
    p.add_argument("--stream-timeout", type=float, default=10.0,
                   help="the frontend moves a stream silent this long (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=2, help="client threads (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default: %(default)s)")
    p.add_argument("--deadline", type=float, default=90.0, help="client retries until this (s) (default: %(default)s)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="a read that waits longer counts the request as lost (hung) (default: %(default)s)")
    p.add_argument("--out", default=None, help="write the JSON report here (default: stdout only)")
    p.add_argument("--log-dir", default=None, help="keep the hosts' logs here (one folder per repeat)")
    return p


DURATION = {"cut-link": "cut_s", "etcd-outage": "etcd_s", "netem": "netem_s"}


def run_repeat(args: argparse.Namespace, names: list[str], repeat: int) -> dict[str, dict]:
    log_dir = Path(args.log_dir) / f"repeat-{repeat}" if args.log_dir else None
    config = HostsConfig(workers=2, spare_workers=1 if "etcd-outage" in names else 0,
                         emulated_links="netem" in names, log_dir=log_dir, etcd_lease_ttl_s=args.etcd_lease_ttl,
                         stream_timeout_s=args.stream_timeout)
    results = {}
    with HostCluster(config) as cluster:
        load = Load(cluster.base_url, args.concurrency, args.max_tokens, args.read_timeout, args.deadline)
        load.learn_expected()
        for name in names:
            print(f"repeat {repeat}: {name} ...", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            load.start()
            time.sleep(args.before)
            window = FAULTS[name].inject(cluster, getattr(args, DURATION.get(name, "cut_s")))
            time.sleep(args.after)
            window.clean = settle(cluster)  # the after phase lasts until a dead worker's registration is gone
            load.stop()
            t_end = time.monotonic()
            probe = kv_probe(cluster)
            results[name] = summarize(load.records, window, t0, t_end, read_attempts(cluster.frontend_log), probe,
                                      load.expected)
            results[name]["probe_routes"] = probe["routes"]
            if window.after_load is not None:
                window.after_load()
            print(f"repeat {repeat}: {name}: " + json.dumps({k: results[name][k] for k in
                  ("answered", "migrated", "retried", "failed", "lost", "outage_s")}), file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        print(f"error: unknown fault(s) {unknown}; known: {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("error: the hosts are network namespaces: run as root", file=sys.stderr)
        return 2
    repeats = [run_repeat(args, names, r) for r in range(1, args.repeats + 1)]
    report = {
        "bench": "dynamo_faults", "command": "python -m bench.dynamo_faults " + " ".join(argv or sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir")},
        "faults": {n: {"expectation": FAULTS[n].expectation, "median": median_of([r[n] for r in repeats]),
                       "repeats": [r[n] for r in repeats]} for n in names},
    }
    report["lost_total"] = sum(f["median"]["lost_total"] for f in report["faults"].values())
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 1 if report["lost_total"] else 0


if __name__ == "__main__":
    sys.exit(main())
