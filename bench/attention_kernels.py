"""Prompt attention, torch's SDPA against our kernel, SmolLM2-135M's heads (9 query, 3 kv, head_dim 64); or paged
decode attention against plain reads of the same bytes (``--decode``).

  .venv/bin/python -m bench.attention_kernels [--lengths 64,128,192,256,512,1024] [--cached 0] [--threads 2]
  .venv/bin/python -m bench.attention_kernels --decode 1x200,32x96,32x160,64x128,8x512 [--repeats 5]

For each prompt length n: q/k/v are strided views of one fused qkv activation [n, 960] (as the engine's
projection leaves them), and each side computes the causal attention of the n queries over ``--cached`` earlier
keys plus their own: torch's SDPA as the engine called it before (``is_causal`` with ``enable_gqa`` for a whole
prompt; a boolean mask over the context, gathered beforehand as the engine gathers it from its cache, for a
chunk after cached tokens) and our ``prefill_attention_``. Each round times both sides; each cell is the median
[min-max] over ``--repeats`` rounds of the median of ``--calls`` calls, in microseconds. The kernel's output is
checked against SDPA's first.

With ``--decode 32x96,64x128,...`` it instead times paged decode attention (``paged_decode_attention``): B
sequences of L tokens each in SmolLM2's KV layout (30 layers of 16-token blocks per slot, K then V), their slots
scattered over an arena of twice the slots used, one call per layer across all 30 layers per
round so the K/V come from memory as in a real step. Each row gives microseconds per call and the K/V bytes read
per second, beside two reads of the same bytes: ``index_select`` of the same scattered blocks (the gather the torch
path did) and a ``sum()`` over one contiguous tensor of that size (a plain streamed read). The kernel's output
is checked against SDPA over the gathered blocks first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from serve.model import kernels
from workload.repeats import cell, median_call_us

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _sides(n: int, cached: int, ops) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(n + cached)
    L, q_size, kv_size = n + cached, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(L, q_size + 2 * kv_size, generator=gen)
    q = qkv[cached:, :q_size].view(n, HEADS, HEAD_DIM)
    k = qkv[:, q_size: q_size + kv_size].view(L, KV_HEADS, HEAD_DIM)
    v = qkv[:, q_size + kv_size:].view(L, KV_HEADS, HEAD_DIM)
    scale, group = HEAD_DIM ** -0.5, HEADS // KV_HEADS
    kc, vc = (k.contiguous(), v.contiguous()) if cached else (k, v)  # the engine gathers a context from its cache
    if cached == 0:
        def sdpa() -> torch.Tensor:
            o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                               v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                               enable_gqa=True)
            return o[0].transpose(0, 1).reshape(n, q_size)
    else:
        mask = (torch.arange(L)[None, :] <= torch.arange(cached, L)[:, None]).repeat(group, 1)

        def sdpa() -> torch.Tensor:
            qp = q.reshape(n, KV_HEADS, group, HEAD_DIM).permute(1, 2, 0, 3).reshape(1, KV_HEADS, group * n, HEAD_DIM)
            o = F.scaled_dot_product_attention(qp, kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, scale=scale)
            return o.view(KV_HEADS, group, n, HEAD_DIM).permute(2, 0, 1, 3).reshape(n, q_size)
    out = torch.empty(n, q_size)

    def ours() -> torch.Tensor:
        ops.prefill_attention_(q, kc, vc, out, scale)
        return out
    torch.testing.assert_close(ours(), sdpa(), atol=1e-4, rtol=1e-4)
    return {"torch SDPA": sdpa, "ours": ours}


def run(lengths: list[int], cached: int, repeats: int, calls: int) -> str:
    ops = kernels.ops()
    if ops is None:
        raise SystemExit(f"our CPU kernels are unavailable: {kernels.describe()}")
    lines = [f"causal prompt attention, {HEADS} query / {KV_HEADS} kv heads x {HEAD_DIM}, {cached} cached tokens, "
             f"{torch.get_num_threads()} threads; us, median [min-max] of {repeats} rounds",
             "| prompt tokens | torch SDPA | ours | SDPA / ours |", "|---:|---:|---:|---:|"]
    for n in lengths:
        sides = _sides(n, cached, ops)
        samples: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(repeats):
            for name, fn in sides.items():
                samples[name].append(median_call_us(fn, calls))
        ratio = statistics.median(samples["torch SDPA"]) / statistics.median(samples["ours"])
        lines.append(f"| {n} | {cell(samples['torch SDPA'], 0)} | {cell(samples['ours'], 0)} | {ratio:.2f}x |")
    return "\n".join(lines)


NUM_LAYERS, BLOCK = 30, 16


def _check_decode(ops, q: torch.Tensor, kv, slots: torch.Tensor, entries: torch.Tensor, lens: torch.Tensor) -> None:
    """The kernel's layer-0 output against SDPA over the same blocks gathered densely (the torch path), so the
    table never times a wrong result."""
    b, length = slots.shape[0], int(lens[0])
    kd, vd = kv.read_blocks(0, slots)  # [b, blocks * BLOCK, kv heads, hd]
    kd, vd = kd[:, :length].transpose(1, 2), vd[:, :length].transpose(1, 2)
    ref = F.scaled_dot_product_attention(q.view(b, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM), kd, vd,
                                         scale=HEAD_DIM ** -0.5).reshape(b, HEADS * HEAD_DIM)
    got = ops.paged_decode_attention(q, kv.blocks, entries, 0, NUM_LAYERS, lens, HEAD_DIM ** -0.5)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def run_decode(shapes: list[tuple[int, int]], repeats: int) -> str:
    """Paged decode attention per call over all layers, against two reads of the same K/V bytes (module doc)."""
    from types import SimpleNamespace  # noqa: PLC0415

    from serve.model.kv_cache import PagedKVCache, block_shape  # noqa: PLC0415

    ops = kernels.ops()
    if ops is None:
        raise SystemExit(f"our CPU kernels are unavailable: {kernels.describe()}")
    cfg = SimpleNamespace(num_layers=NUM_LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, kv_size=KV_HEADS * HEAD_DIM)
    lines = [f"paged decode attention, {HEADS} query / {KV_HEADS} kv heads x {HEAD_DIM}, {NUM_LAYERS} layers of "
             f"{BLOCK}-token blocks, {torch.get_num_threads()} threads; us per call (one layer), median [min-max] of "
             f"{repeats} rounds over all layers; GB/s of K/V read at the median",
             "| sequences x tokens | K/V per call | ours | ours GB/s | index_select GB/s | contiguous sum() GB/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for b, length in shapes:
        gen = torch.Generator().manual_seed(b * 1000 + length)
        nb = -(-length // BLOCK)
        storage = torch.randn(2 * b * nb, *block_shape(cfg, BLOCK), generator=gen)
        kv = PagedKVCache(cfg, BLOCK, storage, storage.shape[0])
        slots = torch.randperm(storage.shape[0], generator=gen)[: b * nb].view(b, nb)
        entries = kv.block_entries(0, slots).contiguous()
        lens = torch.full((b,), length, dtype=torch.long)
        q = torch.randn(b, HEADS * HEAD_DIM, generator=gen)
        nbytes = 2 * b * length * KV_HEADS * HEAD_DIM * 4
        flat = torch.randn(NUM_LAYERS, nbytes // 4, generator=gen)
        _check_decode(ops, q, kv, slots, entries, lens)

        def per_layer(fn: Callable[[int], object]) -> float:
            t0 = time.perf_counter()
            for layer in range(NUM_LAYERS):
                fn(layer)
            return (time.perf_counter() - t0) / NUM_LAYERS * 1e6

        sides: dict[str, Callable[[int], object]] = {
            "ours": lambda layer: ops.paged_decode_attention(q, kv.blocks, entries, layer, NUM_LAYERS, lens,
                                                             HEAD_DIM ** -0.5),
            "index_select": lambda layer: kv.read_blocks(layer, slots),
            "sum": lambda layer: flat[layer].sum(),
        }
        samples: dict[str, list[float]] = {name: [] for name in sides}
        for name, fn in sides.items():
            per_layer(fn)  # warm-up
        for _ in range(repeats):
            for name, fn in sides.items():
                samples[name].append(per_layer(fn))
        whole_blocks = 2 * b * nb * BLOCK * KV_HEADS * HEAD_DIM * 4  # what index_select reads
        read = {"ours": nbytes, "sum": nbytes, "index_select": whole_blocks}
        rate = {name: read[name] / statistics.median(us) / 1e3 for name, us in samples.items()}
        lines.append(f"| {b} x {length} | {nbytes / 2 ** 20:.1f} MiB | {cell(samples['ours'], 0)} | "
                     f"{rate['ours']:.1f} | {rate['index_select']:.1f} | {rate['sum']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.attention_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="64,128,192,256,512,1024", help="prompt tokens (query rows), comma-separated")
    p.add_argument("--cached", type=int, default=0, help="tokens already cached before the prompt chunk")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--decode", default=None, metavar="BxL,...",
                   help="time paged decode attention instead: B sequences of L tokens each, e.g. 32x96,64x128")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.decode:
        try:
            shapes = [(int(b), int(n)) for b, n in (item.lower().split("x") for item in args.decode.split(","))]
        except ValueError:
            p.error(f"--decode wants BxL pairs such as 32x96,64x128, got {args.decode!r}")
        if any(b < 1 or n < 1 for b, n in shapes):
            p.error("--decode: sequences and tokens must be at least 1")
        print(run_decode(shapes, args.repeats))
        return 0
    print(run([int(x) for x in args.lengths.split(",")], args.cached, args.repeats, args.calls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
