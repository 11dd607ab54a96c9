"""Soak test (``make soak``, not part of the test suite): mixed load against a real tritonserver for a
configurable time, with cancellations, clients that disconnect mid-stream and bad inputs.

  .venv/bin/python -m bench.soak --duration-s 600 [--workers 8] [--morph-mode default] [--device-memory 600MiB]

Prints one JSON object (with what it ran on: the command, commit, CPU and UTC span, bench/provenance.py):
requests by outcome (full answers, cancelled, overloaded, rejected bad input,
other errors, hangs), peak resident memory of the server's process group, and the idle state after
the load (KV blocks used, waiting requests, quantized layers, engine health), which must return to 0 /
0 / 0 / 1.

Resident memory over time: the process group's RSS is sampled every ``--rss-every-s`` seconds
during the load (``rss_samples``, [seconds, MiB]); ``rss_second_half`` gives the growth over the run's second
half (the last sample minus the one at the midpoint) and the spread (max - min) there, and ``flat`` says
whether that growth is within ``--rss-flat-mib`` (the pass mark, 16 MiB): after warm-up a server under steady
load must not keep growing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.provenance import provenance
from serve.config import EMBEDDED_MODEL
from serve.config_flags import add_engine_flags, engine_kwargs
from serve.triton.client import GenerationError, GrpcStream, generate_http, metric_value, request_inputs, scrape_metrics
from serve.triton.server import TritonServer

SERVER_FIELDS = ("morph_mode", "device_memory", "num_threads", "max_num_waiting")
"""The EngineConfig fields the soak sets on its server (config.pbtxt parameters of the same names)."""

MODEL = "morphserve"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Tell me about the sea.",
           "List three colors:", "In 1969, humans"]
RSS_FLAT_MIB = 16.0
"""Pass mark: resident memory may grow at most this much over the second half of a soak."""
BAD_BODIES = [b'{"text_input": 5}', b'{"text_input": ""}', b'{"text_input": "hi", "max_tokens": 0}',
              b'{"text_input": "hi", "top_p": 2}', b'{"text_input": "hi", "stop": ["' + b"s" * 400 + b'"]}',
              b'{"text_input": "hi", "timeout_s": -1}', b'{"max_tokens": 4}']


def group_rss_bytes(pgid: int) -> int:
    """Resident memory of every process in the process group (server + Python-backend stubs)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # field 5 (pgrp) of /proc/PID/stat
                continue
            for line in (stat.parent / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            continue
    return total


def second_half_growth(samples: list[tuple[float, float]], duration_s: float,
                       limit_mib: float = RSS_FLAT_MIB) -> dict[str, Any]:
    """Growth of resident memory over the second half of a run from ``samples`` ([seconds since the load
    started, MiB], in time order): the last sample minus the first one at or after ``duration_s / 2``, the
    spread (max - min) of the samples from there on, and whether the growth is within ``limit_mib``."""
    half = [(t, mib) for t, mib in samples if t >= duration_s / 2]
    if len(half) < 2:
        return {"from_s": None, "growth_mib": None, "max_minus_min_mib": None, "limit_mib": limit_mib,
                "flat": None, "note": "fewer than two samples in the second half"}
    values = [mib for _, mib in half]
    growth = values[-1] - values[0]
    return {"from_s": round(half[0][0], 1), "to_s": round(half[-1][0], 1), "growth_mib": round(growth, 1),
            "max_minus_min_mib": round(max(values) - min(values), 1), "limit_mib": limit_mib,
            "flat": growth <= limit_mib}


def one_request(srv: TritonServer, rng: random.Random) -> str:
    """One client action; returns its outcome kind."""
    action = rng.random()
    if action < 0.1:
        req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{MODEL}/generate",
                                     data=rng.choice(BAD_BODIES), method="POST")
        try:
            urllib.request.urlopen(req, timeout=60).read()  # noqa: S310 - loopback
            return "bad_input_accepted"
        except urllib.error.HTTPError as e:
            return f"bad_input_http_{e.code}"
    if action < 0.2:
        try:
            c = generate_http(rng.choice(PROMPTS), url=srv.http_url, max_tokens=rng.randint(1, 32))
            return "full" if c.finish_reason in ("length", "stop") else f"odd:{c.finish_reason}"
        except GenerationError as e:
            return "overloaded" if "retry later" in str(e) else "error"
    cancel_after = rng.randint(1, 6) if action < 0.35 else None
    try:
        with GrpcStream(srv.grpc_url, MODEL) as s:
            s.send(request_inputs(rng.choice(PROMPTS), max_tokens=rng.randint(4, 64), stream=True,
                                  temperature=rng.choice([0.0, 0.7, 1e-40])))
            n = 0
            for item in s.responses(timeout=600):
                n += bool(item.get("text_output"))
                if cancel_after is not None and n >= cancel_after and not item["final"]:
                    (s.cancel if rng.random() < 0.5 else s.close)()  # cancel, or just disconnect
                    return "cancelled"
                if item["final"]:
                    return "full"
    except GenerationError as e:
        return "overloaded" if "retry later" in str(e) else "error"
    except TimeoutError:
        return "hang"
    return "no_final"


def run(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {"engine_dir": args.engine_dir, **engine_kwargs(args, SERVER_FIELDS)}
    outcomes: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    with TritonServer(params=params) as srv:
        ready_s = srv.wait_ready(timeout=600)
        assert srv.proc is not None
        pgid = os.getpgid(srv.proc.pid)
        idle_rss = peak = group_rss_bytes(pgid)
        start = time.monotonic()
        deadline = start + args.duration_s
        stop = threading.Event()
        samples: list[tuple[float, float]] = [(0.0, round(idle_rss / 2**20, 1))]

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                kind = one_request(srv, rng)
                with lock:
                    outcomes[kind] += 1

        def sampler() -> None:
            nonlocal peak
            next_sample = start + args.rss_every_s
            while not stop.wait(1.0):
                rss = group_rss_bytes(pgid)
                peak = max(peak, rss)
                now = time.monotonic()
                if now >= next_sample and now <= deadline:
                    samples.append((round(now - start, 1), round(rss / 2**20, 1)))
                    next_sample += args.rss_every_s

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.workers)]
        mon = threading.Thread(target=sampler, daemon=True)
        mon.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        samples.append((round(time.monotonic() - start, 1), round(group_rss_bytes(pgid) / 2**20, 1)))
        idle = wait_idle(srv, args.idle_timeout_s)
        stop.set()
        return {"duration_s": args.duration_s, "workers": args.workers, "ready_s": round(ready_s, 1),
                "requests": sum(outcomes.values()), "outcomes": dict(sorted(outcomes.items())),
                "rss_idle_mib": round(idle_rss / 2**20, 1), "rss_peak_mib": round(peak / 2**20, 1),
                "rss_after_mib": round(group_rss_bytes(pgid) / 2**20, 1),
                "rss_second_half": second_half_growth(samples, args.duration_s, args.rss_flat_mib),
                "rss_samples": [[t, mib] for t, mib in samples], "after": idle,
                "server_alive": srv.proc.poll() is None, "params": params}


def wait_idle(srv: TritonServer, timeout_s: float) -> dict[str, Any]:
    """Poll the gauges until KV, queue and quantized layers are back to 0 (or the timeout passes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(srv.metrics_url)
        layers = sum(v for labels, v in m.get("morphserve_layers_quantized", []))
        state = {"kv_blocks_used": metric_value(m, "morphserve_kv_blocks_used", model=MODEL),
                 "num_waiting": metric_value(m, "morphserve_num_requests_waiting", model=MODEL),
                 "num_running": metric_value(m, "morphserve_num_requests_running", model=MODEL),
                 "layers_quantized": layers, "healthy": metric_value(m, "morphserve_engine_healthy", model=MODEL),
                 "swaps_total": metric_value(m, "morphserve_swaps_total", model=MODEL),
                 "restores_total": metric_value(m, "morphserve_restores_total", model=MODEL)}
        if (state["kv_blocks_used"], state["num_waiting"], state["num_running"], layers) == (0, 0, 0, 0) \
                or time.monotonic() > deadline:
            state["seconds_to_idle_or_timeout"] = round(timeout_s - max(0.0, deadline - time.monotonic()), 1)
            return state
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--engine-dir", default=EMBEDDED_MODEL,
                   help="the server's engine directory or model (default: %(default)s)")
    add_engine_flags(p, SERVER_FIELDS, defaults={"morph_mode": "default", "num_threads": 2, "max_num_waiting": 16},
                     help_suffix=" (the server's parameter {field})")
    p.add_argument("--idle-timeout-s", type=float, default=300.0)
    p.add_argument("--rss-every-s", type=float, default=10.0,
                   help="sample the server process group's resident memory this often (default: %(default)s)")
    p.add_argument("--rss-flat-mib", type=float, default=RSS_FLAT_MIB,
                   help="pass mark: most growth over the run's second half, MiB (default: %(default)s)")
    argv = sys.argv[1:] if argv is None else argv
    started = time.time()
    result = run(p.parse_args(argv))
    result.update(provenance("bench.soak", argv, started, time.time()))
    print(json.dumps(result, indent=2))
    h = result["rss_second_half"]
    if h["flat"] is not None:
        print(f"resident memory over the second half ({h['from_s']}-{h['to_s']} s): {h['growth_mib']:+.1f} MiB "
              f"(max-min {h['max_minus_min_mib']} MiB), {'PASS' if h['flat'] else 'FAIL'} "
              f"(<= {h['limit_mib']} MiB)", file=sys.stderr)


if __name__ == "__main__":
    main()
