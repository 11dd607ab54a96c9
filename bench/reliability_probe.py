"""The Reliability III probe (docs/hardening.md), rerun row by row: one line per finding (1-11) and per item found held,
each with what was sent, what came back (status, seconds, and the process RSS / threads where the probe measured them)
and ``held`` (the expectation met). docs/hardening.md, "Reliability III", holds a run.

  .venv/bin/python -m bench.reliability_probe [--engine-dir engines/smollm2-135m] [--rows 1,2,deep,...] [--json out]

It starts the server itself, as the issue's probe did: ``python -m serve.triton --engine-dir DIR`` at its defaults on
127.0.0.1 (free ports, the operator port too), then runs the rows in order; ``sigkill`` and ``sigterm`` end that
server, and row 10 starts a second launcher to SIGKILL it. Rows are the finding numbers and ``deep``, ``typed``,
``sampling``, ``grpc-tensors``, ``fuzz``, ``disconnect``, ``timeout``, ``load``, ``sigkill``, ``sigterm``. On a
2-core host the whole probe takes ~6-8 minutes; ``--rows`` splits it. Latencies are those of this host at the
time of the run, not benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bench import reliability_held as held
from bench.reliability_common import (
    COMPILE_WORKER,
    ENGINE_STUB,
    TRITONSERVER,
    Target,
    alive,
    cmdline,
    cpu_s,
    descendants,
    error_of,
    gauge,
    generate,
    post,
    processes,
    rss_mib,
    status_field,
    streams,
    wait_until,
)

REPO = Path(__file__).resolve().parents[1]


# ---- the server ----------------------------------------------------------------------------------------------------

def launch(engine_dir: str, log: Path) -> tuple[subprocess.Popen[str], Target]:
    """``python -m serve.triton --engine-dir DIR`` at its defaults on free ports; returns once it printed ready."""
    proc = subprocess.Popen(  # noqa: S603 - fixed argv
        [sys.executable, "-m", "serve.triton", "--engine-dir", engine_dir, "--http-port", "0", "--grpc-port", "0",
         "--metrics-port", "0", "--operator-port", "0"], cwd=REPO, stdout=subprocess.PIPE, stderr=log.open("w"),
        text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
    except BaseException:  # stopped (SIGTERM) while it loads: stop it too
        proc.terminate()
        raise
    found = re.search(r"http=(\S+) grpc=(\S+) metrics=http://([^/]+)/\S* operator=\S+:(\d+)", line)
    if not found:
        proc.kill()
        raise RuntimeError(f"the launcher did not get ready: {line!r}\n{log.read_text()[-2000:]}")
    http, grpc, metrics, operator = found.groups()
    return proc, Target(http, grpc, metrics, int(operator), proc.pid, log)


# ---- findings 1 and 2: controls ----------------------------------------------------------------------------------

def f1_cancel(t: Target) -> dict[str, Any]:
    started = [threading.Event() for _ in range(4)]
    threads, results = streams(t, 4, 48, started)
    all(e.wait(120) for e in started)
    answers = [generate(t, {"text_input": "x", "morphserve_cancel": rid}) for rid in ("", "bls-" + uuid.uuid4().hex)]
    for th in threads:
        th.join(timeout=300)
    full = sum(r == (48, "length") for r in results.values())
    return {"sent": '{"text_input": "x", "morphserve_cancel": ""} and a made-up "bls-<32 hex>" while 4 streams ran',
            "got": "; ".join(f"{s} {error_of(x)[:60]!r} in {dt * 1e3:.0f} ms" for s, x, dt in answers)
                   + f"; {full}/4 streams finished with all 48 tokens",
            "held": all(s == 400 for s, _, _ in answers) and full == 4}


def f2_memory(t: Target) -> dict[str, Any]:
    from serve.triton.client import GenerationError, GrpcStream, request_inputs
    from serve.triton.operator_port import post_control

    greedy = {"text_input": "The capital of France is", "max_tokens": 8, "temperature": 0.0}
    before = generate(t, greedy)[1]
    answers = [generate(t, {"text_input": "", "morphserve_memory": c}) for c in ("yield 512MiB", "yield " + "9" * 40
                                                                                 + "B", "reclaim")]
    try:
        with GrpcStream(t.grpc, "morphserve") as s:
            s.send(request_inputs("x", max_tokens=2, stream=True), parameters={"morphserve_memory": "yield 512MiB"})
            list(s.responses(timeout=60))
        grpc = "served"
    except GenerationError as e:
        grpc = f"{e.kind.value if e.kind else None}: {str(e)[:50]}"
    time.sleep(3)
    layers, yielded = gauge(t, "morphserve_layers_quantized"), gauge(t, "morphserve_memory_yielded_bytes")
    after = generate(t, greedy)[1]
    state = post_control(t.operator_port, "state")
    return {"sent": '"morphserve_memory": "yield 512MiB" / "yield 9...9B" / "reclaim" over HTTP, "yield 512MiB" '
                    "over gRPC; 3 s later the gauges and a greedy answer",
            "got": f"HTTP {[s for s, _, _ in answers]} ({error_of(answers[0][1])[:50]!r}); gRPC {grpc}; layers "
                   f"quantized {layers:g}, yielded {yielded:g} B; greedy answer unchanged: {before == after}; "
                   f"operator port state: {state.get('status')}",
            "held": all(s == 400 for s, _, _ in answers) and grpc.startswith("invalid_input") and layers == 0
            and yielded == 0 and before == after}


# ---- finding 3: slow guides ----------------------------------------------------------------------------------------

def _slow_regex(i: int) -> str:
    """The issue's 391-byte regex, one spelling per request (no shared compile)."""
    return "(" + "|".join(f"[\\s\\S]{{0,{3000 + 7 * j}}}q0_{j}" for j in range(20)) + f")r{i}"


def _ttft_s(t: Target) -> float:
    body = {"text_input": "Write a short story about a lighthouse keeper.", "max_tokens": 2, "stream": True}
    t0 = time.perf_counter()
    host, port = t.http.split(":")
    import http.client

    c = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        c.request("POST", "/v2/models/morphserve/generate_stream", body=json.dumps(body).encode())
        r = c.getresponse()
        for line in r:
            if line.startswith(b"data:"):
                return time.perf_counter() - t0
    finally:
        c.close()
    return float("nan")


def f3_guides(t: Target, n: int = 3) -> dict[str, Any]:
    unloaded = statistics.median(_ttft_s(t) for _ in range(3))
    results: dict[int, tuple[int, str, float]] = {}
    t0 = time.monotonic()

    def guided(i: int) -> None:
        s, x, _ = generate(t, {"text_input": "hi", "max_tokens": 4, "guided_decoding_guide_type": "regex",
                               "guided_decoding_guide": _slow_regex(i)})
        results[i] = (s, error_of(x)[:70], round(time.monotonic() - t0, 1))

    threads = [threading.Thread(target=guided, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    time.sleep(1.0)
    loaded = statistics.median(_ttft_s(t) for _ in range(3))
    still = len([i for i in range(n) if i not in results])
    for th in threads:
        th.join(timeout=300)
    compiles = [c for w in processes(t, COMPILE_WORKER) for c in descendants(w) if alive(c)]
    cpu_then = sum(cpu_s(c) for c in compiles)
    gone = wait_until(lambda: not any(alive(c) for c in compiles), 60)  # the compile burned on for ~50 s
    unsat = [generate(t, {"text_input": "hi", "max_tokens": 2, "guided_decoding_guide_type": kind,
                          "guided_decoding_guide": guide})[:2] for kind, guide in (("json_schema", '{"$ref": "#"}'),
                                                                                   ("ebnf_grammar", "root ::= root"))]
    return {"sent": f"{n} of the issue's 391-byte regexes at once; an ordinary request's TTFT before and while they "
                    "compile; then the unsatisfiable guides",
            "got": f"TTFT unloaded {unloaded:.2f} s, during {loaded:.2f} s ({still}/{n} guides still compiling "
                   f"then); guides ended (status, words, s) {sorted(results.values(), key=lambda r: r[2])}; compile "
                   f"processes at the last refusal: {len(compiles)} ({cpu_then:.1f} CPU s), all gone {gone} s later; "
                   f"unsatisfiable guides {[s for s, _ in unsat]} ({error_of(unsat[0][1])[:50]!r})",
            "held": loaded <= 2 * unloaded and all(s in (400, 503) for s, _, _ in results.values())
            and gone is not None and gone < 5 and all(s == 400 for s, _ in unsat)}


# ---- findings 4-9 and 11 ----------------------------------------------------------------------------------------

def f4_apis(t: Target) -> dict[str, Any]:
    import tritonclient.grpc as grpcclient

    region = next((p.name for p in Path("/dev/shm").glob("morphserve_*")), "pb")
    register = {"key": f"/{region}", "offset": 0, "byte_size": 64}
    http = [post(t.http, path, body)[:2] for path, body in (
        (f"/v2/systemsharedmemory/region/{region}/register", register), ("/v2/logging", {"log_verbose_level": 1}))]
    client = grpcclient.InferenceServerClient(t.grpc)
    grpc = []
    for call in (lambda: client.register_system_shared_memory("pb", f"/{region}", 64),
                 lambda: client.update_log_settings({"log_verbose_level": 1})):
        try:
            call()
            grpc.append("accepted")
        except Exception as e:  # noqa: BLE001 - the refusal is the row
            grpc.append(str(e)[:40])
    meta = client.get_model_metadata("morphserve").name
    client.close()
    return {"sent": f"register shared memory /{region} (the Python backend's own region) and set logging, HTTP and "
                    "gRPC",
            "got": f"HTTP {[s for s, _ in http]} ({error_of(http[0][1])[:40]!r}); gRPC {grpc}; metadata still "
                   f"served: {meta == 'morphserve'}",
            "held": all(s == 403 for s, _ in http) and not any(g == "accepted" for g in grpc)}


CLIENT_TEXT: list[tuple[str, bytes]] = [
    ("morphserve", b'{"text_input": "hi\\ud800", "max_tokens": 2}'),
    ("morphserve", b'{"text_input": "hi", "max_tokens": 2, "stop": ["a\\udfff"]}'),
    ("morphserve", b'{"text_input": "hi", "max_tokens": 2, "x\\ud800": 1}'),
    ("morphserve", b'{"text_input": "hi", "max_tokens": 2, "x": "\\ud800"}'),
    ("morphserve", b'{"text_input": "hi", "max_tokens": 2, "guided_decoding_guide_type": "regex", '
                   b'"guided_decoding_guide": "a\\ud800"}'),
    ("morphserve", b'{"text_input": "", "morphserve_memory": "yield \\ud800"}'),
    ("morphserve", b'{"text_input": "hi", "max_tokens": ' + b"9" * 5000 + b"}"),
]


def f5_client_errors(t: Target) -> dict[str, Any]:
    corpus = [json.loads(line) for line in (REPO / "tests/triton/fuzz_500_corpus.jsonl").read_text().splitlines()]
    bodies = CLIENT_TEXT + [(c["model"], c["body"].encode()) for c in corpus]
    statuses: dict[int, int] = {}
    for model, body in bodies:
        s = generate(t, body, model)[0]
        statuses[s] = statuses.get(s, 0) + 1
    return {"sent": f"lone surrogates in text_input / stop / a key / a value / a guide / morphserve_memory, a "
                    f"5,000-digit integer, and the {len(corpus)} bodies of tests/triton/fuzz_500_corpus.jsonl",
            "got": f"statuses {statuses}", "held": set(statuses) == {400}}


def f6_aliases(t: Target) -> dict[str, Any]:
    bodies = [{"max_new_tokens": 4294967298}, {"max_new_tokens": -4294967293},
              {"max_tokens": 2, "min_tokens": 2**32 + 1}]
    got = [generate(t, {"text_input": "hi", **b}) for b in bodies]
    return {"sent": "max_new_tokens 4294967298 / -4294967293, min_tokens 2^32+1",
            "got": "; ".join(f"{s} {error_of(x)[:50]!r}" for s, x, _ in got), "held": all(s == 400 for s, _, _ in got)}


def f7_slow_clients(t: Target, slow_head: int = 200, slow_body: int = 100, wait_s: float = 60.0) -> dict[str, Any]:
    host, port = t.http.split(":")
    sel = selectors.DefaultSelector()
    opened = time.monotonic()
    for i in range(slow_head + slow_body):
        s = socket.create_connection((host, int(port)))
        head = b"POST /v2/models/morphserve/generate HTTP/1.1\r\nHost: x\r\n"
        s.sendall(head if i < slow_head else head + b"Content-Length: 1000\r\n\r\n{")
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, "head" if i < slow_head else "body")
    served = [generate(t, {"text_input": f"client {i}", "max_tokens": 2})[0] for i in range(3)]
    closed: dict[str, list[float]] = {"head": [], "body": []}
    answered: dict[str, list[bytes]] = {"head": [], "body": []}
    while sel.get_map() and time.monotonic() - opened < wait_s:
        for key, _ in sel.select(timeout=0.5):
            try:
                data = key.fileobj.recv(4096)  # type: ignore[union-attr]
            except OSError:
                data = b""
            if data:
                answered[key.data].append(data.split(b"\r\n", 1)[0])
                continue
            closed[key.data].append(time.monotonic() - opened)
            sel.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
    left = len(sel.get_map())
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    last = {k: round(max(v), 1) if v else None for k, v in closed.items()}
    return {"sent": f"{slow_head} connections whose head never ends, {slow_body} whose body never comes; 3 ordinary "
                    "requests meanwhile",
            "got": f"closed: {len(closed['head'])}/{slow_head} slow heads (last at {last['head']} s), "
                   f"{len(closed['body'])}/{slow_body} slow bodies (last at {last['body']} s, answered "
                   f"{sorted(set(answered['body']))}); still open after {wait_s:g} s: {left}; ordinary {served}",
            "held": left == 0 and served == [200] * 3}


def f8_cache(t: Target, requests: int = 3000) -> dict[str, Any]:
    import http.client

    before = rss_mib(t.root_pid)
    host, port = t.http.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    statuses: dict[int, int] = {}
    for i in range(requests):
        try:
            c.request("POST", f"/v2/models/morphserve/versions/1.{uuid.uuid4().hex}/generate",
                      body=b'{"text_input": "hi", "max_tokens": 1}')
            r = c.getresponse()
            r.read()
        except (OSError, http.client.HTTPException):
            c.close()
            c = http.client.HTTPConnection(host, int(port), timeout=60)
            continue
        statuses[r.status] = statuses.get(r.status, 0) + 1
    c.close()
    after = rss_mib(t.root_pid)
    return {"sent": f"{requests} requests to /v2/models/morphserve/versions/1.<random>/generate",
            "got": f"statuses {statuses}; launcher RSS {before} -> {after} MiB",
            "held": after - before < 10 and set(statuses) == {400}}


def f9_grpc_big(t: Target) -> dict[str, Any]:
    import numpy as np
    import tritonclient.grpc as grpcclient

    (triton,) = processes(t, TRITONSERVER)
    before = rss_mib(triton)
    client = grpcclient.InferenceServerClient(t.grpc)
    big = grpcclient.InferInput("text_input", [1], "BYTES")
    big.set_data_from_numpy(np.array([b"x" * (100 << 20)], dtype=np.object_))
    t0 = time.perf_counter()
    try:
        client.infer("morphserve", [big])
        got = "accepted"
    except Exception as e:  # noqa: BLE001 - the refusal is the row
        got = str(e)[:90]
    seconds = time.perf_counter() - t0
    client.close()
    after = rss_mib(triton)
    return {"sent": "a 100 MB text_input over gRPC",
            "got": f"{got!r} in {seconds:.2f} s; tritonserver RSS {before} -> {after} MiB",
            "held": "RESOURCE_EXHAUSTED" in got and after - before < 50}


FLOODER = """import http.client, json, sys
host, port = sys.argv[1].split(":")
body = json.dumps({"text_input": "x" * 940_000}).encode()
c = http.client.HTTPConnection(host, int(port), timeout=60)
while True:
    try:
        c.request("POST", "/v2/models/morphserve/generate", body=body, headers={"Content-Type": "application/json"})
        c.getresponse().read()
    except (OSError, http.client.HTTPException):
        c.close()
        c = http.client.HTTPConnection(host, int(port), timeout=60)
"""


def f11_flood(t: Target, samples: int = 20, flood_s: float = 1.0) -> dict[str, Any]:
    """Two flooding clients, each its own process (so they do not share the measuring client's interpreter)."""
    body = {"text_input": "Write one sentence about the sea.", "max_tokens": 1}
    alone = [generate(t, body)[2] for _ in range(samples)]
    floods = [subprocess.Popen([sys.executable, "-c", FLOODER, t.http]) for _ in range(2)]  # noqa: S603
    try:
        time.sleep(flood_s)
        status, text, _ = generate(t, json.dumps({"text_input": "x" * 940_000}).encode())
        flooded = [generate(t, body)[2] for _ in range(samples)]
    finally:
        for f in floods:
            f.kill()
            f.wait()
    a, f = statistics.median(alone), statistics.median(flooded)
    return {"sent": f"two clients (processes) sending 940 KB bodies back to back, each refused ({status} "
                    f"{error_of(text)[:40]!r}), while another sends {samples} one-token requests",
            "got": f"the other client's p50 {a:.3f} -> {f:.3f} s (x{f / a:.2f}), max {max(flooded):.2f} s",
            "held": f <= 2 * a}


# ---- finding 10: a killed launcher -----------------------------------------------------------------------------

def f10_launcher_kill(engine_dir: str, log: Path) -> dict[str, Any]:
    proc, t = launch(engine_dir, log)
    started = [threading.Event() for _ in range(8)]
    streams(t, 8, 200, started)
    all(e.wait(120) for e in started)
    tree = descendants(proc.pid)
    stubs = [p for p in tree if ENGINE_STUB in cmdline(p)]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(20)
    left = [(p, cmdline(p)[:60], rss_mib(p), status_field(p, "Threads")) for p in tree if alive(p)]
    for p, *_ in left:  # the probe leaves nothing behind either way
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"sent": "SIGKILL of the launcher with 8 live streams (a fresh launcher)",
            "got": f"20 s later: {len(left)} of its {len(tree)} processes alive {left} (engine model processes "
                   f"before: {len(stubs)})", "held": not left}


ROWS = ["1", "2", "4", "5", "6", "8", "9", "deep", "typed", "sampling", "grpc-tensors", "timeout", "disconnect", "11",
        "3", "7", "fuzz", "load", "sigkill", "sigterm", "10"]


def run_rows(t: Target, rows: list[str], proc: subprocess.Popen[str] | None, args: argparse.Namespace) -> list[dict]:
    table = {"1": f1_cancel, "2": f2_memory, "3": f3_guides, "4": f4_apis, "5": f5_client_errors, "6": f6_aliases,
             "7": f7_slow_clients, "8": f8_cache, "9": f9_grpc_big, "11": f11_flood, "deep": held.deep,
             "typed": held.typed, "sampling": held.sampling, "grpc-tensors": held.grpc_tensors,
             "fuzz": lambda t: held.fuzz(t, args.fuzz_bodies), "disconnect": held.disconnect,
             "timeout": held.timeout, "load": lambda t: held.load(t, args.load_requests, args.load_max_tokens),
             "sigkill": held.sigkill_tritonserver, "sigterm": lambda t: held.sigterm_drain(t, proc)}
    out = []
    for row in rows:
        t0 = time.monotonic()
        if row == "10":
            result = f10_launcher_kill(args.engine_dir, args.log_dir / "launcher-10.log")
        else:
            result = table[row](t)
        result = {"row": row, **result, "seconds": round(time.monotonic() - t0, 1)}
        print(json.dumps(result), flush=True)
        out.append(result)
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.provenance import provenance

    p = argparse.ArgumentParser(prog="python -m bench.reliability_probe", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--engine-dir", default="engines/smollm2-135m", help="the server's --engine-dir")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows, in this order (default: all)")
    p.add_argument("--fuzz-bodies", type=int, default=3000, help="bodies of the mutation fuzz (the issue's: 3000)")
    p.add_argument("--load-requests", type=int, default=200)
    p.add_argument("--load-max-tokens", type=int, default=192)
    p.add_argument("--log-dir", type=Path, default=Path("."), help="where the launchers' stderr goes")
    p.add_argument("--json", type=Path, default=None, help="also write the rows and provenance here")
    args = p.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    if unknown := set(rows) - set(ROWS):
        p.error(f"unknown rows {sorted(unknown)}; rows: {', '.join(ROWS)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the launcher below is stopped too
    started = time.time()
    served = [r for r in rows if r != "10"]
    out: list[dict] = []
    proc = None
    try:
        if served:
            proc, t = launch(args.engine_dir, args.log_dir / "launcher.log")
            out += run_rows(t, served, proc, args)
        if "10" in rows:
            out += run_rows(Target("", "", "", 0, 0), ["10"], None, args)
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=180)
    if args.json:
        args.json.write_text(json.dumps({**provenance("bench.reliability_probe", argv if argv is not None
                                                      else sys.argv[1:], started, time.time()), "rows": out},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
