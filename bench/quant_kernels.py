"""Per-decoder-layer linear time by kernel and batch size, SmolLM2-135M shapes (random weights, RTN codes).

  .venv/bin/python -m bench.quant_kernels [--rows 1,8,32,64,512] [--threads 2] [--repeats 3] [--head | --streamed]

Columns (microseconds for the layer's four fused projections: qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536; int4 group 64 for K=576, 128 for K=1536): fp32 ``F.linear`` (MKL) and our fp32 kernel
(``fp32_linear``, what plain-layout fp32 linears use up to ``fp32_kernel_max_rows`` rows, serve/model/crossovers.py),
oneDNN on the plain weights (what they use above it); ``--streamed`` adds the blocked layout the decoder layers
store (our ``fp32_blocked_linear``, oneDNN on a view of the blocked bytes, and the engine's choice); torch's int8 /
int4 weight-only
kernels (bf16 activations); ours as GEMV (``int8_linear`` / ``int4_linear``), the same with int8 activations
(``int8_linear_q8`` / ``int4_linear_q8``, what quantized layers run by default up to ``SMALL_BATCH`` rows) and ours as
dequantize + fp32 GEMM (what the layers do above ``SMALL_BATCH`` rows). Each cell is the median over ``--repeats``
rounds of the median of 50 calls; the rounds interleave the kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from serve.model import kernels
from serve.model.embedded import EMBEDDED_MODEL
from serve.model.linear import DenseLinear, onednn_available, onednn_linear
from serve.model.quantized_linear import pack_int4_blocked
from serve.model.rtn import quantize_int4_rtn, quantize_int8_rtn
from workload.repeats import median_call_us, span

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _spread(samples: dict[str, list[float]]) -> dict[str, tuple[float, float, float]]:
    """(median, min, max) of each kernel's samples."""
    return {name: (statistics.median(v), min(v), max(v)) for name, v in samples.items()}


def _candidates(m: int, ops) -> dict[str, list]:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, list] = {"fp32": [], "oneDNN fp32": [], "ours fp32": [], "torch int8": [], "torch int4": [],
                            "ours int8": [], "ours int4": [],
                            "ours int8 q8": [], "ours int4 q8": [], "ours int4 dequant+GEMM": []}
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.05
        x = torch.randn(m, k, generator=gen)
        xb = x.bfloat16()
        g = 64 if k % 128 else 128
        q8, q4 = quantize_int8_rtn(w), quantize_int4_rtn(w, g)
        packed = pack_int4_blocked(q4.codes())
        tpacked = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.codes(), 1)
        sz = q4.scale_and_zero
        out["fp32"].append(lambda x=x, w=w: F.linear(x, w))
        if onednn_available():
            out["oneDNN fp32"].append(lambda x=x, w=w: onednn_linear(x, w))
        out["torch int8"].append(lambda xb=xb, q=q8: torch.ops.aten._weight_int8pack_mm(xb, q.weight, q.scales))
        out["torch int4"].append(lambda xb=xb, p=tpacked, g=g, sz=sz:
                                 torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, g, sz))
        if ops is not None:
            out["ours fp32"].append(lambda x=x, w=w: ops.fp32_linear(x, w))
            out["ours int8"].append(lambda x=x, q=q8: ops.int8_linear(x, q.weight, q.scales))
            out["ours int4"].append(lambda x=x, p=packed, g=g, sz=sz: ops.int4_linear(x, p, sz, g))
            out["ours int8 q8"].append(lambda x=x, q=q8: ops.int8_linear_q8(x, q.weight, q.scales))
            out["ours int4 q8"].append(lambda x=x, p=packed, g=g, sz=sz: ops.int4_linear_q8(x, p, sz, g))
            out["ours int4 dequant+GEMM"].append(
                lambda x=x, p=packed, g=g, sz=sz: F.linear(x, ops.int4_dequantize(p, sz, g)))
    return {name: fns for name, fns in out.items() if fns}


def run(rows: list[int], threads: int, repeats: int) -> dict[int, dict[str, tuple[float, float, float]]]:
    torch.set_num_threads(threads)
    ops = kernels.ops()
    result: dict[int, dict[str, tuple[float, float, float]]] = {}
    for m in rows:
        cands = _candidates(m, ops)
        samples: dict[str, list[float]] = {name: [] for name in cands}
        for _ in range(repeats):
            for name, fns in cands.items():
                samples[name].append(sum(median_call_us(f) for f in fns))
        result[m] = _spread(samples)
    return result


def head_rows(rows: list[int], threads: int, repeats: int) -> dict[int, dict[str, tuple[float, float, float]]]:
    """The embedded model's LM head (49152 x 576): our fp32 kernel on the plain weight, the engine's fp32 head (the
    weight in oneDNN's blocked layout, ``DenseLinear.blocked``) and the head's exact int8 blocks
    (serve/model/lm_head.py)."""
    from serve.model.lm_head import int8_blocks  # noqa: PLC0415
    from serve.model.loader import load_model  # noqa: PLC0415

    torch.set_num_threads(threads)
    ops = kernels.ops()
    if ops is None:
        raise SystemExit(f"--head needs our kernels: {kernels.describe()}")
    w = load_model(EMBEDDED_MODEL).weights["model.embed_tokens.weight"]
    blocks = int8_blocks(w)
    if blocks is None:
        raise SystemExit("the embedded model's head is not int8 blocks")
    blocked = DenseLinear(w).blocked()
    result: dict[int, dict[str, tuple[float, float, float]]] = {}
    for m in rows:
        x = torch.randn(m, w.shape[1])
        cands = {"head fp32 plain (ours)": lambda x=x: ops.fp32_linear(x, w),
                 "head int8 blocks": lambda x=x: ops.int8_block_linear(x, *blocks)}
        if blocked.layout is not None:
            cands["head fp32 blocked"] = lambda x=x: blocked(x)
        samples: dict[str, list[float]] = {name: [] for name in cands}
        for _ in range(repeats):
            for name, fn in cands.items():
                samples[name].append(median_call_us(fn, calls=20))
        result[m] = _spread(samples)
    return result


def streamed_rows(rows: list[int], threads: int, repeats: int,
                  layers: int = 30) -> dict[int, dict[str, tuple[float, float, float]]]:
    """fp32 projections of ``layers`` decoder layers with distinct weights (420 MB at 30: far beyond any cache),
    run one layer after the other as a forward step does, so every weight comes from memory: per-layer time
    of our kernel, oneDNN and MKL on the plain weights, and of our blocked-layout kernel, oneDNN on the blocked
    bytes and the engine's choice between them (``DenseLinear.blocked``) on the same weights in oneDNN's
    blocked layout (the cache-hot table above favours whichever kernel reuses cache best)."""
    torch.set_num_threads(threads)
    ops = kernels.ops()
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen) * 0.05 for n, k in SHAPES] for _ in range(layers)]
    fns = {"MKL fp32": F.linear}
    if onednn_available():
        fns["oneDNN fp32"] = onednn_linear
    if ops is not None:
        fns["ours fp32"] = lambda x, w: ops.fp32_linear(x, w)
    # the same weights in oneDNN's blocked layout, as the engine stores them (a second set, 420 MB at 30 layers)
    blocked = [[DenseLinear(w).blocked() for w in layer] for layer in weights]
    blocked_fns = {}
    if all(op.layout is not None for layer in blocked for op in layer):
        blocked_fns = {
            "ours blocked fp32": lambda x, op: ops.fp32_blocked_linear(x, op.weight, op.layout.n, op.layout.block),
            "oneDNN blocked view": lambda x, op: onednn_linear(x, op.layout.onednn_view(op.weight)),
            "engine (DenseLinear)": lambda x, op: op(x),
        }
    result: dict[int, dict[str, tuple[float, float, float]]] = {}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for _, k in SHAPES}
        samples: dict[str, list[float]] = {name: [] for name in (*fns, *blocked_fns)}
        for _ in range(repeats + 1):  # the first round warms up
            for name, fn in (*fns.items(), *blocked_fns.items()):
                t0 = time.perf_counter()
                for layer in (blocked if name in blocked_fns else weights):
                    for (_, k), w in zip(SHAPES, layer):
                        fn(xs[k], w)
                samples[name].append((time.perf_counter() - t0) / layers * 1e6)
        result[m] = _spread({name: v[1:] for name, v in samples.items()})
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quant_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,64,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--head", action="store_true",
                   help="time the embedded model's LM head (fp32 plain and blocked vs its int8 blocks) instead of a "
                        "decoder layer")
    p.add_argument("--streamed", action="store_true",
                   help="fp32 only, 30 layers of distinct weights run in turn so every weight is read from memory "
                        "(as in a forward step) instead of the cache-hot single layer")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.head:
        result = head_rows(rows, args.threads, args.repeats)
    elif args.streamed:
        result = streamed_rows(rows, args.threads, args.repeats)
    else:
        result = run(rows, args.threads, args.repeats)
    names = list(next(iter(result.values())))
    print("| rows | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for m, cells in result.items():
        print(f"| {m} | " + " | ".join(span(*cells[n], 0) for n in names) + " |")
    print(f"\nmicroseconds per {'LM head' if args.head else 'decoder layer'}, median [min-max] of {args.repeats}; "
          f"{args.threads} threads; "
          f"{kernels.describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
