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

from serve.config import EngineConfig
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.triton_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    from serve.engine.engine import LLMEngine

    params = {"engine_dir": args.engine_dir, "morph_mode": "off", "num_threads": 1}
    t0 = time.perf_counter()
    with TritonServer(params=params) as server:
        server.wait_ready()
        startup = time.perf_counter() - t0
        t1 = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=args.engine_dir, num_threads=1))
        engine_load = time.perf_counter() - t1
        engine.start_background()
        rows = {"engine (in-process)": [], "triton gRPC stream": [], "ensemble (BLS) gRPC stream": []}
        with GrpcStream(server.grpc_url) as stream, GrpcStream(server.grpc_url, model="ensemble") as ens:
            via_triton(stream, 2)
            via_ensemble(ens, 2)
            engine_direct(engine, 2)  # warm all
            for _ in range(args.requests):  # interleaved, so drift on this noisy VM hits all
                rows["engine (in-process)"].append(engine_direct(engine, args.max_tokens))
                rows["triton gRPC stream"].append(via_triton(stream, args.max_tokens))
                rows["ensemble (BLS) gRPC stream"].append(via_ensemble(ens, args.max_tokens))
        engine.shutdown()
    print(f"startup to ready: tritonserver + model {startup:.2f} s (engine alone loads in {engine_load:.2f} s)")
    print(f"{args.requests} sequential requests, {args.max_tokens} tokens each, medians:")
    print("| path | TTFT ms | end-to-end ms |")
    print("|---|---:|---:|")
    med = {}
    for name, vals in rows.items():
        med[name] = (statistics.median(v[0] for v in vals) * 1e3, statistics.median(v[1] for v in vals) * 1e3)
        print(f"| {name} | {med[name][0]:.1f} | {med[name][1]:.1f} |")
    a, b, c = med["engine (in-process)"], med["triton gRPC stream"], med["ensemble (BLS) gRPC stream"]
    print(f"| overhead of the Triton path | {b[0] - a[0]:+.1f} | {b[1] - a[1]:+.1f} |")
    print(f"| overhead of the BLS hop (ensemble vs morphserve) | {c[0] - b[0]:+.1f} | {c[1] - b[1]:+.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
