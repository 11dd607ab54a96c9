"""Decode tok/s at long context with full-precision vs 8-bit KV, interleaved in one process.

``python -m bench.kv_decode [--context 2048] [--batch 1,8] [--tokens 32] [--repeats 3] [--threads 2] [--json OUT]``

Per batch size B and KV format (``auto``, then ``int8``; ``--kv-cache-dtypes``): B requests of ``--context``
prompt tokens are prefilled (not timed), then ``--tokens`` decode steps are timed; each (B, format) runs
``--repeats`` times, the formats alternating, and the report gives the median [min-max] tok/s and int8 / auto.
At 2k context decode attention reads the whole KV cache each step: int8 blocks are ~1/3.75 of fp32's bytes, read
in place by attention_q8_avx2.cpp. Timing numbers: run on a quiet machine (workload/repeats.py's medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.provenance import provenance
from serve.config import EMBEDDED_MODEL, EngineConfig
from serve.config_flags import add_engine_flags
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from workload.repeats import cell


def decode_tok_s(engine: LLMEngine, batch: int, context: int, tokens: int, seed: int) -> float:
    """Decode tokens per second of ``batch`` sequences after their ``context``-token prompts."""
    prompts = [[(seed * 7919 + 31 * b + j) % 30000 + 100 for j in range(context)] for b in range(batch)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    while any(s.num_computed_tokens < context for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and the first token)
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_decode", description=__doc__.split("\n\n")[0])
    add_engine_flags(p, ("model", "num_threads"), aliases={"num_threads": ["--threads"]},
                     defaults={"model": EMBEDDED_MODEL, "num_threads": 2})
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--tokens", type=int, default=32, help="timed decode steps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-dtypes", default="auto,int8")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    started = time.time()
    torch.set_num_threads(args.num_threads)
    batches = [int(b) for b in args.batch.split(",")]
    formats = [k.strip() for k in args.kv_cache_dtypes.split(",") if k.strip()]
    blocks = max(batches) * -(-(args.context + args.tokens + 2) // 16)
    engines = {kv: LLMEngine(EngineConfig(model=args.model, num_kv_blocks=blocks, kv_cache_dtype=kv,
                                          max_num_seqs=max(batches), max_num_batched_tokens=2048,
                                          max_model_len=args.context + args.tokens + 2, num_threads=args.num_threads))
               for kv in formats}
    runs: dict[str, dict[str, list[float]]] = {str(b): {kv: [] for kv in formats} for b in batches}
    for r in range(args.repeats):
        for b in batches:
            for kv in formats:
                runs[str(b)][kv].append(decode_tok_s(engines[kv], b, args.context, args.tokens, r))
    result = {"model": args.model, "context": args.context, "tokens": args.tokens, "threads": args.num_threads,
              "runs": runs, "median": {}}
    for b, per in runs.items():
        med = {kv: statistics.median(v) for kv, v in per.items()}
        result["median"][b] = med
        line = ", ".join(f"{kv} {cell(per[kv])}" for kv in formats)
        ratio = f" (int8 / auto {med['int8'] / med['auto']:.2f}x)" if {"auto", "int8"} <= med.keys() else ""
        print(f"batch {b}, context {args.context}: decode tok/s {line}{ratio}")
    for e in engines.values():
        e.shutdown()
    result.update(provenance("bench.kv_decode", sys.argv[1:] if argv is None else argv, started, time.time()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
