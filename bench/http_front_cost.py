"""What the HTTP front end (serve/triton/http_front.py) costs, and how cheap its refusals are.

  .venv/bin/python -m bench.http_front_cost [--requests 100] [--stream-tokens 32] [--json out.json]

One server (launched as ``python -m serve.triton`` in its own process, so the front end has its own
interpreter, as in ``make serve``), two front ends to the same model: the front end on the client port and
tritonserver's own HTTP server on its internal loopback port. Requests alternate between the front ends:

- non-streaming: p50 latency of ``generate`` with max_tokens 1 (front - direct = the added p50);
- streaming: p50 of the inter-token gaps of ``generate_stream`` (ignore_eos) through each front end, and the
  p50 of the end-to-end time divided by the tokens (front - direct = the added cost per streamed token);
- refusals through the front end: p50 client latency of a 78 KB nested body (400), a body over the size limit
  (413, sent whole) and a JSON type error (400) -- the server time of a refusal is at most this;
- a flood: one client sends refused requests (65 stop strings of 4 KB) back to back while another
  measures generate p50; the ratio to the p50 without the flood is what one abusive client costs the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from serve.config import EMBEDDED_MODEL
from serve.triton.server import free_port

MODEL = "morphserve"
PROMPT = "Write one sentence about the sea."


def _conn(port: int) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=300)


def post(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, bytes]:
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, r.read()


def timed_generate(conn: http.client.HTTPConnection, max_tokens: int = 1) -> float:
    body = json.dumps({"text_input": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    t0 = time.perf_counter()
    status, data = post(conn, f"/v2/models/{MODEL}/generate", body)
    dt = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"generate: {status} {data[:200]!r}")
    return dt


def timed_stream(port: int, tokens: int) -> tuple[float, list[float], int]:
    """(end-to-end seconds, inter-event gaps, events) of one generate_stream request."""
    conn = _conn(port)
    body = json.dumps({"text_input": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": True}).encode()
    t0 = time.perf_counter()
    conn.request("POST", f"/v2/models/{MODEL}/generate_stream", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"generate_stream: {r.status} {r.read()[:200]!r}")
    times = []
    for raw in r:
        if raw.startswith(b"data:"):
            times.append(time.perf_counter())
    conn.close()
    return times[-1] - t0, [b - a for a, b in zip(times, times[1:], strict=False)], len(times)


def grpc_generate(port: int) -> Callable[[], float]:
    """A timed one-token request over a plain gRPC stream straight to tritonserver (no front end): the
    transport's own share of the front end's cost. One stream per request, as the front end opens one."""
    import grpc  # noqa: PLC0415
    from tritonclient.grpc import service_pb2_grpc  # noqa: PLC0415

    from serve.triton.http_tensors import build_request, is_final, spec_from_config  # noqa: PLC0415

    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    from google.protobuf.json_format import MessageToDict  # noqa: PLC0415
    from tritonclient.grpc import service_pb2  # noqa: PLC0415

    config = MessageToDict(stub.ModelConfig(service_pb2.ModelConfigRequest(name=MODEL)).config,
                           preserving_proto_field_name=True)
    spec = dataclasses.replace(spec_from_config(config), name=MODEL)

    def one() -> float:
        t0 = time.perf_counter()
        req = build_request(spec, "", {"text_input": PROMPT, "max_tokens": 1, "ignore_eos": True})
        for msg in stub.ModelStreamInfer(iter([req])):
            if msg.error_message:
                raise RuntimeError(msg.error_message)
            if is_final(msg.infer_response):
                break
        return time.perf_counter() - t0
    return one


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], int, int]:
    http, grpc, metrics, internal = free_port(), free_port(), free_port(), free_port()
    code = (
        "import sys, threading; from serve.triton.server import TritonServer\n"
        f"srv = TritonServer(params={{'engine_dir': {args.engine_dir!r}, 'morph_mode': 'off', 'num_threads': 1,"
        f" 'max_model_len': 512, 'queue_timeout_s': 0}}, http_port={http}, grpc_port={grpc}, metrics_port={metrics},"
        f" triton_http_port={internal})\n"
        "srv.start(); srv.wait_ready(600); print('ready', srv.front_ends.triton_grpc_port, flush=True)\n"
        "try:\n    sys.stdin.read()\nfinally:\n    srv.stop()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],  # noqa: S603
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = "x"
    while line and "ready" not in line:  # the launcher may print before it is ready; EOF means it died
        line = p.stdout.readline() if p.stdout else ""
    if "ready" not in line:
        p.kill()
        raise RuntimeError("server did not start")
    return p, http, internal, int(line.split()[1])  # tritonserver's own gRPC port, behind the gRPC front end


def run(args: argparse.Namespace) -> dict[str, Any]:
    proc, front, direct, grpc_port = start_server(args)
    try:
        return measure(args, front, direct, grpc_port)
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=120)


def measure(args: argparse.Namespace, front: int, direct: int, grpc_port: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": args.requests, "stream_tokens": args.stream_tokens}
    cf, cd = _conn(front), _conn(direct)
    front_ends: dict[str, Callable[[], float]] = {"front": lambda: timed_generate(cf),
                                                  "direct": lambda: timed_generate(cd)}
    if grpc_port is not None:
        front_ends["grpc_direct"] = grpc_generate(grpc_port)
    for _ in range(5):  # warm-up (model spec cache, connections, engine)
        for front_end in front_ends.values():
            front_end()
    lat: dict[str, list[float]] = {k: [] for k in front_ends}
    for _ in range(args.requests):
        for name, front_end in front_ends.items():
            lat[name].append(front_end())
    out["generate_p50_ms"] = {k: round(p50(v) * 1e3, 3) for k, v in lat.items()}
    out["generate_added_p50_ms"] = round((p50(lat["front"]) - p50(lat["direct"])) * 1e3, 3)
    if "grpc_direct" in lat:  # what a plain gRPC stream to tritonserver costs over its HTTP, without the front end
        out["grpc_direct_added_p50_ms"] = round((p50(lat["grpc_direct"]) - p50(lat["direct"])) * 1e3, 3)

    gaps: dict[str, list[float]] = {"front": [], "direct": []}
    per_token: dict[str, list[float]] = {"front": [], "direct": []}
    for _ in range(args.stream_requests):
        for name, port in (("front", front), ("direct", direct)):
            e2e, g, n = timed_stream(port, args.stream_tokens)
            gaps[name] += g
            per_token[name].append(e2e / max(n, 1))
    out["stream_itl_p50_ms"] = {k: round(p50(v) * 1e3, 3) for k, v in gaps.items()}
    out["stream_added_itl_p50_ms"] = round((p50(gaps["front"]) - p50(gaps["direct"])) * 1e3, 3)
    out["stream_added_per_token_p50_ms"] = round((p50(per_token["front"]) - p50(per_token["direct"])) * 1e3, 3)

    deep = b'{"text_input": ' + b"[" * 39000 + b'"x"' + b"]" * 39000 + b"}"
    big = json.dumps({"text_input": "x" * (2 << 20)}).encode()
    typed = b'{"text_input": "hi", "max_tokens": "4"}'
    flood_body = json.dumps({"text_input": "hi", "max_tokens": 1, "stop": ["s" * 4096] * 65}).encode()
    refusals: dict[str, list[float]] = {"deep_78KB_400": [], "over_limit_413": [], "type_error_400": [],
                                        "65_stops_of_4KB": []}
    path = f"/v2/models/{MODEL}/generate"
    for _ in range(args.requests // 2):
        for name, body in zip(refusals, (deep, big, typed, flood_body), strict=True):
            c = _conn(front)  # a 413 closes the connection: a fresh one each time
            t0 = time.perf_counter()
            status, _ = post(c, path, body)
            refusals[name].append(time.perf_counter() - t0)
            c.close()
            if status < 400:
                raise RuntimeError(f"{name} was not refused: {status}")
    out["refusal_p50_ms"] = {k: round(p50(v) * 1e3, 3) for k, v in refusals.items()}

    base = [timed_generate(cf) for _ in range(args.requests)]
    stop = threading.Event()
    flooded: list[int] = []

    def flood() -> None:
        c = _conn(front)
        while not stop.is_set():
            post(c, path, flood_body)
            flooded.append(1)

    th = threading.Thread(target=flood, daemon=True)
    th.start()
    time.sleep(0.5)
    under = [timed_generate(cf) for _ in range(args.requests)]
    stop.set()
    th.join(timeout=60)
    out["flood"] = {"p50_ms_alone": round(p50(base) * 1e3, 3), "p50_ms_flooded": round(p50(under) * 1e3, 3),
                    "ratio": round(p50(under) / p50(base), 3), "refused_requests_sent": len(flooded)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http_front_cost", description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", default=EMBEDDED_MODEL,
                   help="the server's engine directory or model (default: %(default)s)")
    p.add_argument("--requests", type=int, default=100, help="non-streaming requests per front end")
    p.add_argument("--stream-requests", type=int, default=6, help="streaming requests per front end")
    p.add_argument("--stream-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
