"""Per-kernel time of each ISA variant of our CPU kernels this machine executes (serve/model/kernels/isa.py): the
ops the AVX-512 variant has its own code for, AVX2 vs AVX-512 side by side, SmolLM2-135M shapes.

  .venv/bin/python -m bench.isa_kernels [--repeats 3] [--calls 30] [--threads 2] [--markdown]

Rows: one decoder layer's four projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) through the
blocked fp32 linear (``fp32_blocked_linear``, 64-row blocks) and the int8-activation int8 / int4 kernels
(``int8_linear_q8`` / ``int4_linear_q8``, group 64 / 128) at 1 / 4 / 16 rows; paged decode attention over fp32 and
8-bit KV (9 query / 3 kv heads x 64, 16-token blocks) at 1 x 512 and 8 x 256 tokens. Weights are random (the fp32
layer is 14 MB: from L3 on a CPU whose L3 holds it, else from memory). Under load from other processes run it with
``--threads 1``: with 2 threads a descheduled OpenMP worker stalls every parallel region (milliseconds per call).
Each cell is the median of ``--repeats`` rounds of the median of ``--calls`` calls, in microseconds; the rounds
interleave the variants. Outputs are checked equal across the variants first (docs/cpu-kernels.md: their
arithmetic is the same).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from types import ModuleType, SimpleNamespace

import torch

from serve.model import kernels
from serve.model.kernels import isa
from serve.model.kv_cache import FULL_BLOCK, Q8_BLOCK, BlockStore, PagedKVCache, block_shape
from serve.model.kv_format import KVLayout
from serve.model.linear import BlockedLayout
from serve.model.quantized_linear import pack_int4_blocked
from workload.repeats import median_call_us

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def _linears(rows: int) -> dict[str, Callable[[ModuleType], list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(rows)
    layers = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.05
        group = 64 if k % 128 else 128
        layers.append(SimpleNamespace(
            n=n, group=group, x=torch.randn(rows, k, generator=gen),
            blocked=BlockedLayout(n, k, 64, torch.empty(0, dtype=torch.uint8)).pack(w),
            q8=torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
            sc=(torch.rand(n, generator=gen) * 0.01 + 1e-4).bfloat16(),
            int4=pack_int4_blocked(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)),
            sz=torch.stack([torch.rand(k // group, n, generator=gen) * 0.02 + 1e-3,
                            torch.randn(k // group, n, generator=gen) * 0.01], dim=-1).bfloat16().contiguous()))
    return {
        f"fp32_blocked_linear, layer, {rows} rows":
            lambda ops: [ops.fp32_blocked_linear(c.x, c.blocked, c.n, 64, None) for c in layers],
        f"int8_linear_q8, layer, {rows} rows": lambda ops: [ops.int8_linear_q8(c.x, c.q8, c.sc) for c in layers],
        f"int4_linear_q8, layer, {rows} rows":
            lambda ops: [ops.int4_linear_q8(c.x, c.int4, c.sz, c.group) for c in layers]}


def _attention(batch: int, length: int) -> dict[str, Callable[[ModuleType], list[torch.Tensor]]]:
    """Decode attention over one layer of a two-layer cache whose fp32 slots and 8-bit grid share one arena."""
    gen = torch.Generator().manual_seed(batch * 1000 + length)
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, kv_size=KV_HEADS * HEAD_DIM)
    nb = -(-length // BLOCK)
    slots = 4 * batch * nb
    storage = torch.zeros(slots, *block_shape(cfg, BLOCK))
    layout = KVLayout.of(cfg, BLOCK, torch.float32, "int8")
    buf = storage.view(-1).view(torch.uint8)
    buf = buf[: buf.numel() // layout.unit * layout.unit]
    slot_bytes = storage[0].numel() * 4
    q8_blocks = [p for p in range(buf.numel() // layout.block_bytes)
                 if p * layout.block_bytes >= slots // 2 * slot_bytes][: batch * nb]
    full_slots = list(range(batch * nb))
    kv = PagedKVCache(cfg, BLOCK, storage, len(full_slots) + len(q8_blocks), BlockStore.quantized(layout, buf))
    kv.map_blocks(0, full_slots, FULL_BLOCK)
    kv.map_blocks(len(full_slots), q8_blocks, Q8_BLOCK)
    tokens = torch.arange(kv.max_blocks * BLOCK)
    for layer in range(2):
        k, v = (torch.randn(len(tokens), KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
        kv.write(layer, kv.locate(tokens), k, v)
    q = torch.randn(batch, HEADS * HEAD_DIM, generator=gen)
    lens = torch.full((batch,), length, dtype=torch.long)
    cells = {}
    for name, first in (("fp32 KV", 0), ("8-bit KV", len(full_slots))):
        tables = torch.arange(first, first + batch * nb).view(batch, nb)
        index = kv.decode_index(kv.block_map[tables], kv.block_format[tables])
        cells[f"decode attention, {name}, {batch} x {length} tokens"] = (
            lambda ops, index=index: [kv.paged_decode(ops, q, index, 1, lens, 0.125)])
    return cells


def run(repeats: int, calls: int) -> list[tuple[str, dict[str, float]]]:
    """(row, {variant: median us}) for every row, the variants this machine executes."""
    variants = {name: ops for name in isa.VARIANTS if (ops := kernels.variant_ops(name)) is not None}
    if not variants:
        raise SystemExit(f"no ISA variant of our CPU kernels is usable here: {kernels.describe()}")
    rows: dict[str, Callable[[ModuleType], list[torch.Tensor]]] = {}
    for m in (1, 4, 16):
        rows.update(_linears(m))
    rows.update(_attention(1, 512))
    rows.update(_attention(8, 256))
    table = []
    for label, fn in rows.items():
        outs = {name: fn(ops) for name, ops in variants.items()}
        first = next(iter(outs.values()))
        differ = [n for n, o in outs.items() if not all(torch.equal(a, b) for a, b in zip(o, first, strict=True))]
        if differ:
            raise SystemExit(f"{label}: the variants {differ} differ from {next(iter(outs))}")
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, ops in variants.items():
                samples[name].append(median_call_us(lambda ops=ops: fn(ops), calls=calls))
        table.append((label, {name: statistics.median(v) for name, v in samples.items()}))
    return table


def format_table(table: list[tuple[str, dict[str, float]]], markdown: bool) -> str:
    names = list(table[0][1]) if table else []
    ratio = len(names) > 1
    head = ["kernel", *[f"{n} us" for n in names], *([f"{names[0]} / {names[-1]}"] if ratio else [])]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"] if markdown else \
        ["  ".join(head)]
    for label, cells in table:
        values = [f"{cells[n]:.0f}" for n in names] + ([f"{cells[names[0]] / cells[names[-1]]:.2f}x"] if ratio else [])
        lines.append("| " + " | ".join([label, *values]) + " |" if markdown else "  ".join([label, *values]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{isa.machine_id()}; {args.threads} threads; chosen: {kernels.describe()}")
    print(format_table(run(args.repeats, args.calls), args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
