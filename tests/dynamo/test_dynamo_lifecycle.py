"""The request lifecycle through NVIDIA Dynamo: the worker's engine decides deadlines, shedding and
draining from the same EngineConfig fields as the Triton model, and each error kind reaches the client of Dynamo's
OpenAI frontend as its status: an OpenAI-style error object with code 400 invalid input, 503 overloaded, 504
deadline exceeded, 503 draining (as the HTTP status, or in the error event of a stream, whose status line is
already 200). Dynamo 1.6.1's frontend answers a worker's 503 with its own message and no Retry-After (measured;
docs/dynamo.md). And under 4x overload a worker sheds instead of queueing for minutes: the first event (a token or
the refusal) of every request comes within its queue deadline + 10 % (p95). Real processes on loopback."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from serve.dynamo.http import get_text, post_json
from tests.dynamo_cluster_support import running_cluster, wait_for, worker_metric

pytestmark = [pytest.mark.dynamo, pytest.mark.slow, pytest.mark.timeout(900)]

REQUEST_TIMEOUT_S = 4.0  # every request's deadline on the kinds worker: the long ones end at it
KIND_ARGS = ["--max-num-seqs", "1", "--max-num-waiting", "1", "--queue-timeout-s", "120",
             "--request-timeout-s", str(REQUEST_TIMEOUT_S)]


def completion(base: str, stream: bool, timeout: float = 120.0, **body: Any) -> tuple[int, list[dict[str, Any]]]:
    """(HTTP status, the JSON objects of the answer: one, or a stream's events) of /v1/completions."""
    payload = {"model": "morphserve", "prompt": "Count: 1, 2,", "temperature": 0, "stream": stream, **body}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, [json.loads(e.read())]
    if not stream:
        return status, [json.loads(raw)]
    events = [line[5:].strip() for line in raw.splitlines() if line.startswith("data:")]
    return status, [json.loads(e) for e in events if e != "[DONE]"]


def open_stream(base: str, **body: Any) -> Any:
    """A streaming completion whose first event has arrived (the caller closes it)."""
    payload = {"model": "morphserve", "prompt": "Count: 1, 2,", "temperature": 0, "stream": True, **body}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=120)  # noqa: S310 - loopback
    while not r.readline().startswith(b"data:"):
        pass
    return r


def error_code(status: int, answer: list[dict[str, Any]]) -> int:
    """The client-visible status: the HTTP status, or a stream's error event's code."""
    errors = [a["error"] for a in answer if "error" in a]
    if status != 200 or not errors:
        return status
    return int(errors[-1]["code"])


def finished(worker, reason: str) -> float:
    """The worker's count of requests finished with ``reason``."""
    text = get_text(f"http://127.0.0.1:{worker.port}/metrics") or ""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("morphserve_requests_finished_total{") and f'finish_reason="{reason}"' in line)


def test_each_kind_reaches_the_openai_client_as_its_status() -> None:
    with running_cluster(replicas=1, worker_args=KIND_ARGS) as cluster:
        base, worker = cluster.base_url, cluster.workers[0]
        control = f"http://127.0.0.1:{worker.port}/engine/control"
        for stream in (False, True):
            # invalid input: 400 with the engine's message
            status, answer = completion(base, stream, max_tokens=400)
            assert error_code(status, answer) == 400 and "context length" in json.dumps(answer), answer

            # deadline exceeded: 504, once, though the frontend migrates the request (each retry refused at once)
            timeouts = finished(worker, "timeout")
            status, answer = completion(base, stream, max_tokens=200, ignore_eos=True)
            assert error_code(status, answer) == 504, answer
            assert finished(worker, "timeout") == timeouts + 1

            # overloaded: one runs, one waits, the next is refused 503 (Dynamo 1.6.1 sends no Retry-After on)
            running = open_stream(base, max_tokens=200, ignore_eos=True)
            waiting: list[Any] = []
            waiter = threading.Thread(target=lambda: waiting.append(completion(base, False, max_tokens=2)))
            waiter.start()
            wait_for(lambda: post_json(f"{control}/state", {})["num_waiting"] == 1, 60, 0.05, "one waiting")
            status, answer = completion(base, stream, max_tokens=2)
            assert error_code(status, answer) == 503, answer
            running.close()  # its client leaves: the waiting one runs
            waiter.join(timeout=120)
            assert waiting[0][0] == 200, waiting

            # draining: the operator drains the worker on its system port; 503; resume admits again
            assert post_json(f"{control}/drain", {})["draining"] is True
            try:
                status, answer = completion(base, stream, max_tokens=2)
                assert error_code(status, answer) == 503, answer
            finally:
                assert post_json(f"{control}/resume", {})["draining"] is False
            status, answer = completion(base, stream, max_tokens=2)
            assert status == 200 and error_code(status, answer) == 200, answer
        wait_for(lambda: worker_metric(worker, "morphserve_kv_blocks_used") == 0, 60, what="KV back to 0")


QUEUE_TIMEOUT_S = 5.0  # the overshoot past it (one engine step, the frontend's hops) is absolute: 10 % of 5 s covers it
SHED_ARGS = ["--max-num-seqs", "2", "--queue-timeout-s", str(QUEUE_TIMEOUT_S)]
TOKENS = 16


def first_event_s(base: str, out: list[tuple[float, int]]) -> None:
    """One streaming request: seconds to its first event (a token or the refusal), and its status."""
    payload = {"model": "morphserve", "prompt": "Tell me about rivers.", "max_tokens": TOKENS, "ignore_eos": True,
               "temperature": 0, "stream": True}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:  # noqa: S310 - loopback
            first, code = None, 200
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                first = first if first is not None else time.perf_counter() - t0
                event = json.loads(line[5:])
                if "error" in event:
                    code = int(event["error"]["code"])
            out.append((first if first is not None else math.inf, code))
    except urllib.error.HTTPError as e:
        out.append((time.perf_counter() - t0, e.code))


def test_a_worker_under_4x_overload_sheds_instead_of_queueing() -> None:
    with running_cluster(replicas=1, worker_args=SHED_ARGS) as cluster:
        base = cluster.base_url
        # the worker's capacity, measured: rounds of 2 concurrent requests (its max_num_seqs)
        t0, done = time.perf_counter(), []
        for _ in range(3):
            pair = [threading.Thread(target=first_event_s, args=(base, done)) for _ in range(2)]
            for th in pair:
                th.start()
            for th in pair:
                th.join(timeout=300)
        capacity = len(done) / (time.perf_counter() - t0)  # requests per second
        assert all(code == 200 for _, code in done), done

        # 4x that, open loop, for 3 queue deadlines
        rate, duration = 4 * capacity, 3 * QUEUE_TIMEOUT_S
        results: list[tuple[float, int]] = []
        threads = []
        start = time.perf_counter()
        for i in range(math.ceil(rate * duration)):
            time.sleep(max(0.0, start + i / rate - time.perf_counter()))
            threads.append(threading.Thread(target=first_event_s, args=(base, results)))
            threads[-1].start()
        for th in threads:
            th.join(timeout=600)
        assert len(results) == len(threads)
        firsts = sorted(t for t, _ in results)
        p95 = firsts[min(len(firsts) - 1, math.ceil(0.95 * len(firsts)) - 1)]
        codes = {c: sum(1 for _, x in results if x == c) for c in {x for _, x in results}}
        print(f"capacity {capacity:.2f} req/s, offered {rate:.2f} req/s for {duration:.0f} s: {len(results)} requests, "
              f"statuses {codes}, first-event p95 {p95:.2f} s (queue deadline {QUEUE_TIMEOUT_S:g} s)")
        assert set(codes) <= {200, 503} and codes.get(503, 0) > 0 and codes.get(200, 0) > 0, codes
        assert p95 <= QUEUE_TIMEOUT_S * 1.1, (p95, codes)
