"""The HTTP front end's checks against a running server's client HTTP port (``make serve`` defaults).

  .venv/bin/python -m serve.triton --engine-dir smollm2-135m --log-level info 2> launcher.log &
  .venv/bin/python -m bench.http_door_checks --url 127.0.0.1:8000 --metrics 127.0.0.1:8002 \
      --launcher-log launcher.log [--skip-load]

Prints one JSON object:
- ``deep``: 8 deeply nested bodies (78 KB and ~1 MB, arrays and objects) sent while 4 ordinary requests
  are in flight: each status and message, the 4 answers, and whether the launcher logged
  ``tritonserver_died``;
- ``typed``: JSON type errors and out-of-range integers, each status;
- ``disconnect``: 6 non-streaming requests of 1000 tokens (ignore_eos) whose clients leave after 3 s:
  seconds until running + waiting are back to 0;
- ``timeout``: the status of a request past its ``timeout_s``;
- ``load`` (unless --skip-load): 200 concurrent streaming requests (~150 prompt tokens, 192 output
  tokens, ignore_eos): how each ended, and the percentiles of the time to the first event (token or error).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import random
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from serve.triton.client import metric_value, scrape_metrics
from workload.latency import percentiles

MODEL = "morphserve"


def post(url: str, path: str, body: bytes, timeout: float = 600) -> tuple[int, str, dict[str, str]]:
    host, port = url.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", errors="replace"), dict(r.headers)
    finally:
        c.close()


def gauge(metrics: str, name: str) -> float:
    return metric_value(scrape_metrics(f"http://{metrics}/metrics"), name, model=MODEL) or 0.0


def deep_bodies(url: str, log: Path | None) -> dict[str, Any]:
    def deep(levels: int, kind: str) -> bytes:
        o, c = (b"[", b"]") if kind == "array" else (b'{"a":', b"}")
        return b'{"text_input": ' + o * levels + b'"x"' + c * levels + b"}"

    answers: list[Any] = []

    def ordinary(i: int) -> None:
        body = json.dumps({"text_input": f"Request {i}: tell me about the sea.", "max_tokens": 32,
                           "ignore_eos": True}).encode()
        status, text, _ = post(url, f"/v2/models/{MODEL}/generate", body)
        answers.append(json.loads(text).get("num_output_tokens") if status == 200 else f"{status}: {text[:100]}")

    died_before = (log.read_text().count('"tritonserver_died"') if log else None)
    threads = [threading.Thread(target=ordinary, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    refused = []
    for body in [deep(39000, "array"), deep(15600, "object"), deep(500000, "array"), deep(200000, "object")] * 2:
        t0 = time.perf_counter()
        status, text, _ = post(url, f"/v2/models/{MODEL}/generate", body)
        refused.append({"bytes": len(body), "status": status, "error": json.loads(text).get("error", "")[:70],
                        "ms": round((time.perf_counter() - t0) * 1e3, 2)})
    for t in threads:
        t.join()
    died_after = (log.read_text().count('"tritonserver_died"') if log else None)
    return {"refused": refused, "all_4xx": all(400 <= r["status"] < 500 for r in refused),
            "ordinary_answers": answers, "tritonserver_died_events": None if log else "no log given",
            "tritonserver_died_during_check": None if log is None else died_after - died_before}


TYPED = [{"max_tokens": "4"}, {"max_tokens": 4.5}, {"max_tokens": 4294971392}, {"seed": -1}, {"text_input": 5}]


def typed(url: str) -> list[dict[str, Any]]:
    out = []
    for extra in TYPED:
        body = {"text_input": "hi", "max_tokens": 4, **extra}
        status, text, _ = post(url, f"/v2/models/{MODEL}/generate", json.dumps(body).encode())
        out.append({"body": extra, "status": status, "error": json.loads(text).get("error", "")[:90]})
    return out


def disconnect(url: str, metrics: str) -> dict[str, Any]:
    host, port = url.split(":")
    body = json.dumps({"text_input": "Count from one to a thousand:", "max_tokens": 1000, "ignore_eos": True}).encode()
    head = (f"POST /v2/models/{MODEL}/generate HTTP/1.1\r\nHost: {url}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    socks = []
    for _ in range(6):
        s = socket.create_connection((host, int(port)))
        s.sendall(head + body)
        socks.append(s)
    time.sleep(3)
    busy = gauge(metrics, "morphserve_num_requests_running") + gauge(metrics, "morphserve_num_requests_waiting")
    for s in socks:
        s.close()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        left = gauge(metrics, "morphserve_num_requests_running") + gauge(metrics, "morphserve_num_requests_waiting")
        if left == 0:
            return {"running_plus_waiting_at_3s": busy, "back_to_0_after_s": round(time.monotonic() - t0, 2)}
        time.sleep(0.1)
    return {"running_plus_waiting_at_3s": busy, "back_to_0_after_s": None}


def timeout(url: str) -> dict[str, Any]:
    body = {"text_input": "Count: 1, 2, 3,", "max_tokens": 200, "ignore_eos": True, "timeout_s": 0.5}
    status, text, _ = post(url, f"/v2/models/{MODEL}/generate", json.dumps(body).encode())
    return {"status": status, "error": json.loads(text).get("error", "")[:90]}


def load(url: str, n: int, prompt_words: int, max_tokens: int, arrival_rate: float = 0.0,
         seed: int = 0) -> dict[str, Any]:
    """``n`` streaming requests at once (``arrival_rate`` 0) or as Poisson arrivals at ``arrival_rate``/s."""
    words = "the sea is wide and deep and blue under a grey sky while".split()
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    start = threading.Barrier(n)
    rng = random.Random(seed)
    offsets = list(itertools.accumulate(rng.expovariate(arrival_rate) for _ in range(n))) if arrival_rate > 0 \
        else [0.0] * n

    def one(i: int) -> None:
        prompt = f"Story {i}: " + " ".join(words[j % len(words)] for j in range(prompt_words))
        body = json.dumps({"text_input": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}).encode()
        host, port = url.split(":")
        c = http.client.HTTPConnection(host, int(port), timeout=1800)
        start.wait()
        time.sleep(offsets[i])
        t0 = time.perf_counter()
        try:
            c.request("POST", f"/v2/models/{MODEL}/generate_stream", body=body,
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                results[i] = {"first_event_s": time.perf_counter() - t0, "outcome": f"http {r.status}",
                              "retry_after": r.getheader("Retry-After")}
                r.read()
                return
            first = None
            events = 0
            last: dict[str, Any] = {}
            for raw in r:
                if raw.startswith(b"data:"):
                    if first is None:
                        first = time.perf_counter() - t0
                    events += 1
                    last = json.loads(raw[5:])
            outcome = "error: " + last["error"][:40] if "error" in last else (
                "answer" if last.get("num_output_tokens") == max_tokens else f"short {last.get('num_output_tokens')}")
            results[i] = {"first_event_s": first, "outcome": outcome}
        except Exception as e:  # noqa: BLE001 - a hang or reset is a finding
            results[i] = {"first_event_s": None, "outcome": f"exception {type(e).__name__}"}
        finally:
            c.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    firsts = sorted(r["first_event_s"] for r in results if r.get("first_event_s") is not None)
    outcomes: dict[str, int] = {}
    for r in results:
        key = r["outcome"].split(":")[0] if r["outcome"].startswith("error") else r["outcome"]
        outcomes[key] = outcomes.get(key, 0) + 1
    p50_s, p95_s = percentiles(firsts, (50, 95)) or (float("nan"), float("nan"))
    refused = sorted(r["first_event_s"] for r in results if r["outcome"] == "http 503")
    answered = sorted(r["first_event_s"] for r in results if r["outcome"] == "answer")
    return {"requests": n, "arrival_rate": arrival_rate or "all at once", "seed": seed, "outcomes": outcomes,
            "with_first_event": len(firsts),
            "refused_503_p50_s": round(statistics.median(refused), 3) if refused else None,
            "answered_ttft_p50_s": round(statistics.median(answered), 2) if answered else None,
            "first_event_p50_s": round(p50_s, 2), "first_event_p95_s": round(p95_s, 2),
            "first_event_max_s": round(max(firsts), 2) if firsts else None,
            "wall_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http_door_checks", description=__doc__.split("\n")[0])
    p.add_argument("--url", default="127.0.0.1:8000", help="the client HTTP port (host:port)")
    p.add_argument("--metrics", default="127.0.0.1:8002", help="the metrics port (host:port)")
    p.add_argument("--launcher-log", type=Path, default=None, help="the launcher's stderr (JSON events)")
    p.add_argument("--skip-load", action="store_true", help="skip the 200-stream load (minutes on 2 cores)")
    p.add_argument("--load-requests", type=int, default=200)
    p.add_argument("--load-prompt-words", type=int, default=140, help="~150 prompt tokens")
    p.add_argument("--load-max-tokens", type=int, default=192)
    p.add_argument("--load-arrival-rate", type=float, default=0.0,
                   help="Poisson arrivals per second (0: all requests at once, the issue's check)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--load-only", action="store_true", help="run only the load check")
    args = p.parse_args(argv)
    out: dict[str, Any] = {}
    if not args.load_only:
        out = {"deep": deep_bodies(args.url, args.launcher_log), "typed": typed(args.url)}
        out["disconnect"] = disconnect(args.url, args.metrics)
        out["timeout"] = timeout(args.url)
    if not args.skip_load:
        out["load"] = load(args.url, args.load_requests, args.load_prompt_words, args.load_max_tokens,
                           args.load_arrival_rate, args.seed)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
