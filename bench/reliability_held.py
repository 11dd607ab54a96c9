"""The rows of the Reliability III probe (docs/hardening.md) that held, rerun by ``bench.reliability_probe``: deep JSON,
JSON type errors, sampling extremes, malformed gRPC tensors, a mutation fuzz, disconnects, ``timeout_s``, 200
streams at the defaults, and (destructive, so last) SIGKILL of tritonserver and SIGTERM of the launcher. Each
function returns one row: what was sent, what came back, and ``held`` (the expectation met)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from typing import Any

import numpy as np

from bench import http_door_checks as checks
from bench.reliability_common import (
    ENGINE_STUB,
    TRITONSERVER,
    Target,
    alive,
    descendants,
    error_of,
    gauge,
    generate,
    processes,
    ready,
    streams,
    wait_until,
)

# 21 JSON type errors: (body additions, the field the 400 must name)
TYPE_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"text_input": 5}, "text_input"), ({"text_input": True}, "text_input"), ({"text_input": None}, "text_input"),
    ({"text_input": [["x"]]}, "text_input"), ({"text_input": {"a": 1}}, "text_input"),
    ({"max_tokens": "4"}, "max_tokens"), ({"max_tokens": 4.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": [4, 5]}, "max_tokens"), ({"max_tokens": {"n": 4}}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": [0.5, 1]}, "temperature"), ({"top_p": "all"}, "top_p"),
    ({"top_k": 1.5}, "top_k"), ({"seed": -1}, "seed"), ({"seed": "1"}, "seed"), ({"stream": "yes"}, "stream"),
    ({"ignore_eos": "no"}, "ignore_eos"), ({"stop": 5}, "stop"), ({"stop": [5]}, "stop"), ({"timeout_s": "soon"},
                                                                                            "timeout_s"),
]
# sampling extremes, each must be 400: NaN / Infinity are JSON extensions Python's encoder writes
EXTREMES: list[dict[str, Any]] = [
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": -1.0}, {"top_p": float("nan")},
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.1}, {"top_k": -2}, {"top_k": 2**40}, {"max_tokens": 0},
    {"max_tokens": -1}, {"max_tokens": 10**6}, {"timeout_s": float("nan")}, {"timeout_s": -1.0},
    {"seed": 2**64}, {"repetition_penalty": float("inf")},
]


def deep(t: Target) -> dict[str, Any]:
    out = checks.deep_bodies(t.http, t.log)
    return {"sent": "8 bodies nested 15,600-500,000 levels (78 KB - 1.2 MB) while 4 ordinary requests ran",
            "got": f"statuses {sorted(r['status'] for r in out['refused'])}, max "
                   f"{max(r['ms'] for r in out['refused'])} ms; ordinary answers {out['ordinary_answers']}",
            "held": out["all_4xx"] and out["ordinary_answers"] == [32] * 4, "detail": out}


def typed(t: Target) -> dict[str, Any]:
    got = []
    for extra, field in TYPE_ERRORS:
        status, text, _ = generate(t, {"text_input": "hi", "max_tokens": 2, **extra})
        got.append({"body": extra, "status": status, "names_field": field in error_of(text)})
    named = sum(g["status"] == 400 and g["names_field"] for g in got)
    return {"sent": f"{len(got)} JSON type errors", "got": f"{named}/{len(got)} answered 400 naming the field",
            "held": named == len(got), "detail": got}


def sampling(t: Target) -> dict[str, Any]:
    got = []
    for extra in EXTREMES:
        status, text, _ = generate(t, json.dumps({"text_input": "hi", "max_tokens": 2, **extra}).encode())
        got.append({"body": json.dumps(extra), "status": status, "error": error_of(text)[:80]})
    refused = sum(g["status"] == 400 for g in got)
    return {"sent": f"{len(got)} sampling extremes (NaN, Infinity, out-of-range top_p / top_k / max_tokens, ...)",
            "got": f"{refused}/{len(got)} answered 400", "held": refused == len(got), "detail": got}


def _malformed_tensors() -> list[tuple[str, dict[str, np.ndarray]]]:
    text = np.array([b"hi"], dtype=np.object_)
    ok = {"text_input": text, "max_tokens": np.array([2], dtype=np.int32)}
    cases: list[tuple[str, dict[str, np.ndarray]]] = [
        ("no text_input", {"max_tokens": np.array([2], dtype=np.int32)}),
        ("text_input INT32", {"text_input": np.array([1], dtype=np.int32)}),
        ("text_input FP32", {"text_input": np.array([1.0], dtype=np.float32)}),
        ("text_input two elements", {"text_input": np.array([b"a", b"b"], dtype=np.object_)}),
        ("text_input empty shape [0]", {"text_input": np.array([], dtype=np.object_)}),
        ("text_input shape [1,1,1]", {"text_input": np.array([[[b"hi"]]], dtype=np.object_)}),
        ("text_input undecodable bytes", {"text_input": np.array([b"\xff\xfe\x80"], dtype=np.object_)}),
        ("text_input lone surrogate (CESU bytes)", {"text_input": np.array([b"\xed\xa0\x80"], dtype=np.object_)}),
        ("unknown input", {**ok, "no_such_input": np.array([1], dtype=np.int32)}),
    ]
    for name, good in (("max_tokens", np.int32), ("top_k", np.int32), ("seed", np.uint64),
                       ("temperature", np.float32), ("top_p", np.float32), ("timeout_s", np.float32)):
        cases.append((f"{name} BYTES", {**ok, name: np.array([b"4"], dtype=np.object_)}))
        cases.append((f"{name} two elements", {**ok, name: np.array([1, 2], dtype=good)}))
    cases += [("max_tokens FP32", {**ok, "max_tokens": np.array([2.0], dtype=np.float32)}),
              ("max_tokens -5", {**ok, "max_tokens": np.array([-5], dtype=np.int32)}),
              ("temperature NaN", {**ok, "temperature": np.array([np.nan], dtype=np.float32)}),
              ("stream INT32", {**ok, "stream": np.array([3], dtype=np.int32)})]
    return cases


def grpc_tensors(t: Target) -> dict[str, Any]:
    from serve.triton.client import GenerationError, GrpcStream

    got = []
    for name, arrays in _malformed_tensors():
        try:
            with GrpcStream(t.grpc, "morphserve") as s:
                s.send(arrays)
                list(s.responses(timeout=60))
            got.append({"case": name, "answer": "served"})
        except GenerationError as e:
            got.append({"case": name, "answer": f"{e.kind.value if e.kind else None}: {str(e)[:80]}"})
        except Exception as e:  # noqa: BLE001 - tritonclient's own refusals
            got.append({"case": name, "answer": f"{type(e).__name__}: {str(e)[:80]}"})
    refused = [g for g in got if g["answer"] != "served" and not g["answer"].startswith("internal")]
    return {"sent": f"{len(got)} malformed gRPC tensors (wrong type, shape, bytes)",
            "got": f"{len(refused)}/{len(got)} refused with a clear error, not internal",
            "held": len(refused) == len(got), "detail": got}


def _mutate(rng: random.Random, body: bytes) -> bytes:
    b = bytearray(body)
    for _ in range(rng.randint(1, 4)):
        op, i = rng.randrange(4), rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] = rng.randrange(256)
        elif op == 1:
            b[i:i] = rng.choice([b"\\ud800", b"9" * 30, b"[", b"{", b'"', b",", b"-", b"\xff", b"NaN", b"1e400"])
        elif op == 2 and b:
            del b[i:i + rng.randint(1, 8)]
        else:
            b[i:i] = b[rng.randrange(len(b)):][:8]
    return bytes(b)


def fuzz(t: Target, bodies: int = 3000, seed: int = 0) -> dict[str, Any]:
    """A mutation fuzz of generate bodies (byte flips, inserts of surrogates / long digits / brackets, deletes,
    copies): statuses, and whether tritonserver was restarted meanwhile."""
    rng = random.Random(seed)
    bases = [json.dumps(b).encode() for b in (
        {"text_input": "hi", "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "stop": ["x"]},
        {"text_input": "hi", "max_tokens": 2, "guided_decoding_guide_type": "regex", "guided_decoding_guide": "[a-c]+"},
        {"text_input": "hi", "max_new_tokens": 2, "min_tokens": 1, "seed": 7, "timeout_s": 5})]
    before = processes(t, TRITONSERVER)
    statuses: dict[int, int] = {}
    five: list[str] = []
    t0 = time.monotonic()
    for i in range(bodies):
        body = _mutate(rng, bases[i % len(bases)])
        status = generate(t, body)[0]
        statuses[status] = statuses.get(status, 0) + 1
        if status >= 500 and len(five) < 10:
            five.append(body.decode("utf-8", errors="replace")[:200])
    restarted = processes(t, TRITONSERVER) != before
    return {"sent": f"{bodies} mutated generate bodies (seed {seed})",
            "got": f"statuses {dict(sorted(statuses.items()))} in {time.monotonic() - t0:.0f} s; tritonserver "
                   f"{'restarted' if restarted else 'not restarted'}",
            "held": not restarted and not any(s >= 500 for s in statuses), "fivexx_bodies": five}


def disconnect(t: Target, n: int = 6) -> dict[str, Any]:
    """``n`` non-streaming requests of 1000 tokens; once the engine runs (or queues) them all, their clients leave."""
    host, port = t.http.split(":")
    body = json.dumps({"text_input": "Count from one to a thousand:", "max_tokens": 1000, "ignore_eos": True}).encode()
    head = (f"POST /v2/models/morphserve/generate HTTP/1.1\r\nHost: {t.http}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    socks = [socket.create_connection((host, int(port))) for _ in range(n)]
    for s in socks:
        s.sendall(head + body)

    def busy() -> float:
        return gauge(t, "morphserve_num_requests_running") + gauge(t, "morphserve_num_requests_waiting")

    seen = wait_until(lambda: busy() >= n, 60)
    time.sleep(1.0)
    for s in socks:
        s.close()
    back = wait_until(lambda: busy() == 0, 60)
    return {"sent": f"{n} requests of 1000 tokens whose clients leave once the engine has them all",
            "got": f"all {n} in the engine after {seen} s; their clients left 1 s later; running + waiting back to 0 "
                   f"{back} s after that", "held": seen is not None and back is not None and back < 5}


def timeout(t: Target) -> dict[str, Any]:
    out = checks.timeout(t.http)
    return {"sent": "200 tokens with timeout_s 0.5", "got": f"{out['status']} {out['error'][:60]}",
            "held": out["status"] == 504}


def load(t: Target, n: int = 200, max_tokens: int = 192) -> dict[str, Any]:
    out = checks.load(t.http, n, 140, max_tokens)
    back = wait_until(lambda: gauge(t, "morphserve_kv_blocks_used") == 0, 60, 0.5)
    answered, refused = out["outcomes"].get("answer", 0), out["outcomes"].get("http 503", 0)
    return {"sent": f"{n} streams at once (~150 prompt tokens, {max_tokens} tokens, ignore_eos)",
            "got": f"outcomes {out['outcomes']}; first event p50 {out['first_event_p50_s']} s, p95 "
                   f"{out['first_event_p95_s']} s; KV blocks back to 0 after {back} s; {out['wall_s']} s wall",
            "held": answered + refused == n and back is not None, "detail": out}


def sigkill_tritonserver(t: Target) -> dict[str, Any]:
    """SIGKILL of tritonserver with 4 streams in flight: restart time, how each stream ended, model processes."""
    started = [threading.Event() for _ in range(4)]
    threads, results = streams(t, 4, 400, started)
    all(e.wait(120) for e in started)
    (old,) = processes(t, TRITONSERVER)
    stubs_before = processes(t, ENGINE_STUB)
    t0 = time.monotonic()
    os.kill(old, signal.SIGKILL)
    back = wait_until(lambda: ready(t) and any(p != old for p in processes(t, TRITONSERVER)), 300, 0.1)
    for th in threads:
        th.join(timeout=60)
    stubs = [p for p in processes(t, ENGINE_STUB) if alive(p)]
    return {"sent": "SIGKILL of tritonserver with 4 streams in flight",
            "got": f"ready again after {back} s; streams ended: {sorted(str(r)[:60] for r in results.values())}; "
                   f"engine model processes after: {len(stubs)} (old one alive: "
                   f"{any(alive(p) for p in stubs_before)})",
            "held": back is not None and len(stubs) == 1 and all(isinstance(r, str) for r in results.values()),
            "restart_s": back, "wall_s": round(time.monotonic() - t0, 1)}


def sigterm_drain(t: Target, launcher: subprocess.Popen[str]) -> dict[str, Any]:
    """SIGTERM of the launcher with 8 streams in flight: each finishes in full, the launcher exits, no process left."""
    started = [threading.Event() for _ in range(8)]
    threads, results = streams(t, 8, 48, started)
    all(e.wait(120) for e in started)
    tree = descendants(launcher.pid)
    t0 = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    for th in threads:
        th.join(timeout=120)
    code = launcher.wait(timeout=120)
    full = sum(r == (48, "length") for r in results.values())
    left = [p for p in tree if alive(p)]
    return {"sent": "SIGTERM of the launcher with 8 streams of 48 tokens in flight",
            "got": f"{full}/8 streams finished in full; launcher exit {code} after {time.monotonic() - t0:.1f} s; "
                   f"processes of it left: {len(left)}",
            "held": full == 8 and code == 0 and not left, "detail": {str(k): v for k, v in results.items()}}
