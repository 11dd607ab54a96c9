"""Perplexity with the quantized layers' activations rounded to int8 vs kept fp32 (MORPHSERVE_QACTIVATIONS).

  .venv/bin/python -m bench.qactivations_quality [--model smollm2-135m] [--tokens 8192] [--window 32]

Why a window of 32: int8 activations apply only where the quantized layers run as GEMVs (up to
serve.model.quantized_linear.SMALL_BATCH rows: decode steps and small prefill chunks). A 512-token window
(``make quality``) goes through the dequantize-and-GEMM path and never sees them. Each activation row is
rounded on its own (blocks of 32 along K), so a 32-token window's rows are rounded exactly as decode rows
are; the window only shortens the context, which raises perplexity equally on both sides of the A/B.

One engine (workload.quality.QualityEvaluator: the layer bank holds the int8 and int4 variants of every
layer) evaluates the same held-out text in full precision, all layers int8 and all layers int4, once per
activation setting, and prints perplexity and the relative change int8 vs fp32 activations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from unittest import mock

from serve.config import EMBEDDED_MODEL
from serve.config_flags import add_engine_flags
from serve.model import kernels
from serve.model.quantized_linear import SMALL_BATCH
from workload.quality import QualityEvaluator

SETTINGS = ("fp32", "int8")


def measure(ev: QualityEvaluator, signatures: dict[str, str]) -> dict[str, dict[str, float]]:
    """Perplexity per signature name under each activation setting (the environment restored afterwards)."""
    out: dict[str, dict[str, float]] = {s: {} for s in SETTINGS}
    with mock.patch.dict(os.environ):
        for setting in SETTINGS:
            os.environ["MORPHSERVE_QACTIVATIONS"] = setting
            ev.forget()  # memoized per signature; the activation setting is not part of the signature
            for name, sig in signatures.items():
                out[setting][name] = ev.perplexity(sig)
    return out


def to_markdown(result: dict) -> str:
    lines = ["| layers | perplexity, fp32 activations | int8 activations | change |", "|---|---:|---:|---:|"]
    for name in result["ppl"]["fp32"]:
        a, b = result["ppl"]["fp32"][name], result["ppl"]["int8"][name]
        lines.append(f"| {name} | {a:.3f} | {b:.3f} | {100 * (b / a - 1):+.2f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.qactivations_quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p, ("model", "num_threads"), aliases={"num_threads": ["--threads"]},
                     defaults={"model": EMBEDDED_MODEL, "num_threads": 2})
    p.add_argument("--text", type=Path, default=None, help="held-out text (default: Botchan, as workload.quality)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the text evaluated")
    p.add_argument("--window", type=int, default=SMALL_BATCH,
                   help=f"tokens per window (<= {SMALL_BATCH}, so the int8-activation GEMVs run)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not 2 <= args.window <= SMALL_BATCH:
        p.error(f"--window must be 2..{SMALL_BATCH}: above it the quantized layers take the GEMM path")
    if kernels.ops() is None:
        print("the CPU kernels are unavailable here: int8 activations never run", file=sys.stderr)
        return 2
    ev = QualityEvaluator(args.model, args.text, num_tokens=args.tokens, window=args.window,
                          num_threads=args.num_threads)
    try:
        n = ev.num_layers
        sigs = {"full precision": "f" * n, "all int8": "8" * n, "all int4": "4" * n}
        result = {"model": args.model, "text": str(ev.text_path), "tokens": ev.num_eval_tokens, "window": args.window,
                  "ppl": measure(ev, sigs)}
    finally:
        ev.shutdown()
    print(f"{result['tokens']} predicted tokens of {result['text']}, {args.window}-token windows\n")
    print(to_markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
