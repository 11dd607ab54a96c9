"""Startup-to-ready time and per-request overhead of the Triton path vs calling the engine directly.

  .venv/bin/python -m bench.triton_overhead [--engine-dir engines/smollm2-135m] [--requests 20]

Both sides run the same engine configuration (morph off, one torch thread), the same prompts, greedy,
sequentially, in one run: the difference of medians is the cost of tritonserver + the Python backend +
gRPC streaming per request. A third path sends TensorRT-LLM's tensors ([1, 1], min_length = max_tokens)
to the `ensemble` model, a thin BLS model in front of `morphserve`: its extra cost is the BLS hop.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

from serve.config import EMBEDDED_MODEL, EngineConfig
from serve.engine.sampling_params import SamplingParams
from serve.triton.client import GrpcStream
from serve.triton.server import TritonServer

PROMPT = "Write one sentence about the sea."


def engine_direct(engine, max_tokens: int) -> tuple[float, float]:
    """(TTFT, end-to-end) seconds for one request through the engine's background loop."""
    done = threading.Event()
    first: list[float] = []
    t0 = time.perf_counter()

    def cb(out) -> None:
        if out.new_token_ids and not first:
            first.append(time.perf_counter())
        if out.finished:
            done.set()
    engine.add_request(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True), callback=cb)
    done.wait(60)
    return first[0] - t0, time.perf_counter() - t0


def via_triton(stream: GrpcStream, max_tokens: int) -> tuple[float, float]:
    c = stream.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True, stream=True)
    return c.ttft_s, c.e2e_s


def via_ensemble(stream: GrpcStream, max_tokens: int) -> tuple[float, float]:
    """The same request in TensorRT-LLM's form, to the `ensemble` model (BLS in front of morphserve)."""
    n = np.array([[max_tokens]], dtype=np.int32)
    arrays = {"text_input": np.array([[PROMPT.encode()]], dtype=np.object_), "max_tokens": n, "min_length": n,
              "stream": np.array([[True]]), "exclude_input_in_output": np.array([[True]])}
    t0 = time.perf_counter()
    stream.send(arrays)
    first = None
    for item in stream.responses(timeout=60):
        if first is None and item.get("text_output"):
            first = time.perf_counter()
    return (first or time.perf_counter()) - t0, time.perf_counter() - t0


PATHS = ("engine (in-process)", "triton gRPC stream", "ensemble (BLS) gRPC stream")


def measure(grpc_url: str, engine, requests: int, max_tokens: int) -> dict[str, list[tuple[float, float]]]:
    """(TTFT, end-to-end) seconds of ``requests`` sequential requests per path, interleaved (so drift on a noisy
    machine hits all): ``engine`` in-process (its background loop started), the server's morphserve model and its
    ``ensemble`` (BLS) model over gRPC streams; each path warmed with one 2-token request first."""
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in PATHS}
    with GrpcStream(grpc_url) as stream, GrpcStream(grpc_url, model="ensemble") as ens:
        via_triton(stream, 2)
        via_ensemble(ens, 2)
        engine_direct(engine, 2)
        for _ in range(requests):
            rows[PATHS[0]].append(engine_direct(engine, max_tokens))
            rows[PATHS[1]].append(via_triton(stream, max_tokens))
            rows[PATHS[2]].append(via_ensemble(ens, max_tokens))
    return rows


def to_markdown(rows: dict[str, list[tuple[float, float]]]) -> str:
    """Medians per path in ms and the two differences: the Triton path's cost and the BLS hop's."""
    med = {name: (statistics.median(v[0] for v in vals) * 1e3, statistics.median(v[1] for v in vals) * 1e3)
           for name, vals in rows.items()}
    lines = ["| path | TTFT ms | end-to-end ms |", "|---|---:|---:|"]
    lines += [f"| {name} | {ttft:.1f} | {e2e:.1f} |" for name, (ttft, e2e) in med.items()]
    a, b, c = (med[name] for name in PATHS)
    lines.append(f"| overhead of the Triton path | {b[0] - a[0]:+.1f} | {b[1] - a[1]:+.1f} |")
    lines.append(f"| overhead of the BLS hop (ensemble vs morphserve) | {c[0] - b[0]:+.1f} | {c[1] - b[1]:+.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.triton_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", default=EMBEDDED_MODEL, help="engine directory or model (default: %(default)s)")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    from serve.engine.engine import LLMEngine  # noqa: PLC0415

    params = {"engine_dir": args.engine_dir, "morph_mode": "off", "num_threads": 1}
    t0 = time.perf_counter()
    with TritonServer(params=params) as server:
        server.wait_ready()
        startup = time.perf_counter() - t0
        t1 = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=args.engine_dir, num_threads=1))
        engine_load = time.perf_counter() - t1
        engine.start_background()
        try:
            rows = measure(server.grpc_url, engine, args.requests, args.max_tokens)
        finally:
            engine.shutdown()
    print(f"startup to ready: tritonserver + model {startup:.2f} s (engine alone loads in {engine_load:.2f} s)")
    print(f"{args.requests} sequential requests, {args.max_tokens} tokens each, medians:")
    print(to_markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
