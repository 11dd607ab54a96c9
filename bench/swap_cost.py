"""Swap cost and KV capacity gained per swapped layer, measured on this machine.

  .venv/bin/python -m bench.swap_cost [--model engines/smollm2-135m] [--layers 8]

For each precision: the time to copy a layer's variant into a fresh resident copy and install it (what
the engine does off the critical path, in a worker thread), the reverse restore, the bytes freed and the
KV blocks / tokens that one swapped layer adds to the pool.
"""

from __future__ import annotations

import argparse
import statistics
import time

from policy import FULL, MorphDecision
from serve.config import EMBEDDED_MODEL, EngineConfig
from serve.config_flags import add_engine_flags
from serve.morph.runtime import MorphRuntime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.swap_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p, ("model", "num_threads"), aliases={"num_threads": ["--threads"]},
                     defaults={"model": EMBEDDED_MODEL, "num_threads": 2})
    p.add_argument("--layers", type=int, default=8, help="layers swapped per precision (default: %(default)s)")
    args = p.parse_args(argv)
    from serve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, morph_mode="default", morph_precisions="int8,int4",
                                    num_threads=args.num_threads, device_memory="2GiB"))
    m = engine.resource_manager(MorphRuntime)
    assert m is not None
    bpb = engine.bytes_per_block
    print(f"model {engine.model_config.name}: {engine.model_config.num_layers} layers, KV block = "
          f"{engine.config.block_size} tokens = {bpb / 2**10:.0f} KiB, full layer = "
          f"{m.bank.nbytes(0, FULL) / 2**20:.2f} MiB")
    print("| precision | layer MiB | freed MiB | KV blocks added | KV tokens added | swap ms (copy+install) | restore "
          "ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    n = min(args.layers, engine.model_config.num_layers)
    for precision in sorted(m.bank.precisions):
        swap, restore = [], []
        for layer in range(n):
            t0 = time.perf_counter()
            m.apply_now(MorphDecision("quantize", (layer,), precision, "bench"))
            swap.append((time.perf_counter() - t0) * 1e3)
        blocks = m.stack[-1].blocks
        for layer in reversed(range(n)):
            t0 = time.perf_counter()
            m.apply_now(MorphDecision("restore", (layer,), None, "bench"))
            restore.append((time.perf_counter() - t0) * 1e3)
        size = m.bank.nbytes(0, precision)
        print(f"| {precision} | {size / 2**20:.2f} | {(m.bank.nbytes(0, FULL) - size) / 2**20:.2f} | {blocks} | "
              f"{blocks * engine.config.block_size} | {statistics.median(swap):.2f} | {statistics.median(restore):.2f} "
              "|")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
