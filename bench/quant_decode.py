"""Engine decode / prefill speed per morph mode (off, static-int8, static-int4), interleaved in one process.

  .venv/bin/python -m bench.quant_decode [--modes off,static-int8,static-int4] [--repeats 3] [--json PATH]

Each mode gets its own engine (static modes quantize every layer at start, plain RTN variants when the
model is not an engine directory). Decode tok/s at batch B = B * (N - 1) / (time(N new tokens) - time(1
new token)), so prefill is excluded; prefill tok/s = one 512-token prompt, one new token. Every metric is
measured ``--repeats`` times with the modes interleaved (this VM is noisy); the median and the min..max
spread are reported (``median [min-max]``), and each mode's ratio against ``off`` from the medians. The kernel each
quantized mode ran on (serve.model.kernels) is printed with the results.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from bench.engine_throughput import make_prompts, ours_generate
from serve.config import EMBEDDED_MODEL, EngineConfig
from serve.config_flags import add_engine_flags
from serve.engine.engine import LLMEngine
from serve.model import kernels
from workload.repeats import span


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _engine(mode: str, threads: int, model: str) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model, morph_mode=mode, max_num_seqs=64, max_num_batched_tokens=512,
                                    num_threads=threads))
    ours_generate(engine, [[100, 200, 300]], 2)  # static modes swap every layer before serving starts
    precisions = {layer.precision for layer in engine.model.layers}
    print(f"# {mode}: layer precisions {sorted(precisions)}", flush=True)
    return engine


def _decode(engine: LLMEngine, prompts: list[list[int]], new: int) -> float:
    t_full = _timed(lambda: ours_generate(engine, prompts, new))
    t_one = _timed(lambda: ours_generate(engine, prompts, 1))
    return len(prompts) * (new - 1) / max(t_full - t_one, 1e-9)


def run(modes: list[str], batches: list[int], new: int, repeats: int, threads: int, model: str = EMBEDDED_MODEL,
        prefill_tokens: int = 512) -> dict:
    torch.set_num_threads(threads)
    engines = {m: _engine(m, threads, model) for m in modes}
    vocab = next(iter(engines.values())).model_config.vocab_size
    rng = random.Random(0)
    work = {f"decode tok/s, batch {b}": (make_prompts(rng, b, 32, vocab), new) for b in batches}
    work[f"prefill tok/s, {prefill_tokens}-token prompt"] = (make_prompts(rng, 1, prefill_tokens, vocab), None)
    samples: dict[str, dict[str, list[float]]] = {k: {m: [] for m in modes} for k in work}
    for _ in range(repeats):
        for metric, (prompts, n) in work.items():
            for m, engine in engines.items():
                if n is None:
                    value = prefill_tokens / _timed(lambda: ours_generate(engine, prompts, 1))
                else:
                    value = _decode(engine, prompts, n)
                samples[metric][m].append(value)
    rows = []
    for metric, by_mode in samples.items():
        med = {m: statistics.median(v) for m, v in by_mode.items()}
        rows.append({"metric": metric, "median": med,
                     "spread": {m: (min(v), max(v)) for m, v in by_mode.items()},
                     "vs_off": {m: med[m] / med["off"] for m in modes} if "off" in med else {}})
    for engine in engines.values():
        engine.stop()
    return {"threads": threads, "repeats": repeats, "new_tokens": new, "kernels": kernels.describe(),
            "rows": rows}


def to_markdown(result: dict) -> str:
    modes = list(result["rows"][0]["median"])
    head = "| metric | " + " | ".join(modes) + " |"
    lines = [head, "|---|" + "---:|" * len(modes)]
    for r in result["rows"]:
        cells = []
        for m in modes:
            ratio = f", {r['vs_off'][m]:.2f}x" if r["vs_off"] and m != "off" else ""
            cells.append(span(r["median"][m], *r["spread"][m]) + ratio)
        lines.append(f"| {r['metric']} | " + " | ".join(cells) + " |")
    lines.append(f"\nmedian [min-max] of {result['repeats']} interleaved runs (x: against off), {result['threads']} "
                 "threads; "
                 f"quantized kernels: {result['kernels']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quant_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="off,static-int8,static-int4")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-tokens", type=int, default=512,
                   help="prompt length of the prefill row (default: %(default)s)")
    add_engine_flags(p, ("model", "num_threads"), aliases={"num_threads": ["--threads"]},
                     defaults={"model": EMBEDDED_MODEL, "num_threads": 2})
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = run(args.modes.split(","), [int(b) for b in args.batches.split(",") if b], args.new_tokens,
                 args.repeats, args.num_threads, args.model, args.prefill_tokens)
    if args.json:  # written first: the table below is derived from it
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
