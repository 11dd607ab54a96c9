"""Perplexity with a fraction of layers quantized, in the LIS swap order vs front-to-back (README table).

``python -m builder.evaluate --engine-dir engines/smollm2-135m --text ../shared/data/text/botchan.txt``

Text: the first ``--max-tokens`` tokens of ``--text`` (must not be the calibration text), split into
non-overlapping ``--window``-token windows; perplexity = exp(mean next-token NLL over every window).
Quantized layers use the engine directory's own runtime variants (``load_engine_dir`` ->
``layer_variant``): by default their dequantized weights in an fp32 dense forward (AWQ pre_quant_scale
folded in; exactly the weights the kernels use, the fastest path on CPU), or with ``--kernels`` the
runtime aten kernels themselves (bf16 activations, ~3e-3 relative difference per linear, slower). With
``--kv-cache-dtypes auto,int8`` (the default) the weight rows of the first order are repeated with every K/V rounded
as int8 KV blocks hold them (``kv_cache_dtype``; the KV column of the table). Each row also holds its top-1
agreement with full precision over every position (``agreement``: the live quality meter's per-token quantity); the
planner (``python -m sim --quality-table``) states it per level.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from builder.forward import DenseLayer, DenseLlama
from policy.precisions import KV_CACHE_DTYPES
from serve.model.engine_dir import EngineDir, EngineDirError, load_engine_dir

ORDER_LABELS = {"lis": "LIS", "front_to_back": "front-to-back", "back_to_front": "back-to-front"}


def num_quantized(fraction_pct: float, num_layers: int) -> int:
    """Round half up: 25 % of 30 layers -> 8."""
    return min(num_layers, int(math.floor(fraction_pct / 100 * num_layers + 0.5)))


def window_batches(token_ids: list[int], window: int) -> torch.Tensor:
    usable = len(token_ids) // window * window
    if usable == 0:
        raise ValueError(f"text has {len(token_ids)} tokens, fewer than one {window}-token window")
    return torch.tensor(token_ids[:usable]).reshape(-1, window)


@torch.no_grad()
def scores(model: DenseLlama, layers: list[DenseLayer], windows: torch.Tensor, batch: int = 2,
           kv_cache_dtype: str = "auto") -> tuple[float, torch.Tensor]:
    """Perplexity over every window, and each position's top-1 next token (``[windows, window - 1]``)."""
    nll, count, top1 = 0.0, 0, []
    for start in range(0, windows.shape[0], batch):
        ids = windows[start : start + batch]
        logits = model.forward(ids, layers, kv_cache_dtype)[:, :-1]
        targets = ids[:, 1:]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
        count += targets.numel()
        top1.append(logits.argmax(dim=-1))
    return math.exp(nll / count), torch.cat(top1)


def perplexity(model: DenseLlama, layers: list[DenseLayer], windows: torch.Tensor, batch: int = 2,
               kv_cache_dtype: str = "auto") -> float:
    return scores(model, layers, windows, batch, kv_cache_dtype)[0]


class QualityEval:
    def __init__(self, engine: EngineDir, windows: torch.Tensor, kernels: bool = False) -> None:
        self.engine = engine
        self.windows = windows
        self.kernels = kernels
        self.model = DenseLlama(engine.config, engine.loaded.weights, max_positions=windows.shape[1])
        self._quant: dict[tuple[int, str], DenseLayer] = {}
        self._cache: dict[tuple[str, frozenset[int], str], tuple[float, torch.Tensor]] = {}

    def _quant_layer(self, i: int, precision: str) -> DenseLayer:
        if (i, precision) not in self._quant:
            self._quant[(i, precision)] = self.model.quantized_layer(i, self.engine.layer_variant(i, precision),
                                                                     kernels=self.kernels)
        return self._quant[(i, precision)]

    def _scores(self, precision: str, quantized: frozenset[int], kv_cache_dtype: str) -> tuple[float, torch.Tensor]:
        key = (precision if quantized else "", quantized, kv_cache_dtype)
        if key not in self._cache:
            layers = [self._quant_layer(i, precision) if i in quantized else self.model.full_layers[i]
                      for i in range(self.engine.config.num_layers)]
            self._cache[key] = scores(self.model, layers, self.windows, kv_cache_dtype=kv_cache_dtype)
        return self._cache[key]

    def ppl(self, precision: str, quantized: frozenset[int], kv_cache_dtype: str = "auto") -> float:
        return self._scores(precision, quantized, kv_cache_dtype)[0]

    def agreement(self, precision: str, quantized: frozenset[int], kv_cache_dtype: str = "auto") -> float:
        """Share of positions whose top-1 next token is full precision's (every layer full, full-precision KV): the
        per-token quantity the live quality meter samples (docs/quality.md), here over every position."""
        got = self._scores(precision, quantized, kv_cache_dtype)[1]
        return float((got == self._scores("", frozenset(), "auto")[1]).float().mean())


def orders(engine: EngineDir) -> dict[str, list[int]]:
    return {"lis": engine.swap_order, "front_to_back": engine.front_to_back, "back_to_front": engine.back_to_front}


def evaluate(engine: EngineDir, token_ids: list[int], precisions: list[str], order_names: list[str],
             fractions: list[float], window: int, kernels: bool = False, progress: bool = True,
             kv_cache_dtypes: tuple[str, ...] = ("auto",)) -> dict[str, Any]:
    """Rows per (weight precision, order) with full-precision KV, and per 8-bit ``kv_cache_dtypes`` entry the same
    weight rows under the first order with K/V rounded as the engine's 8-bit KV blocks hold them."""
    from tqdm import tqdm

    windows = window_batches(token_ids, window)
    ev = QualityEval(engine, windows, kernels)
    all_orders = orders(engine)
    num_layers = engine.config.num_layers
    rows = []
    jobs = [(p, o, f, "auto") for p in precisions for o in order_names for f in fractions]
    jobs += [(p, order_names[0], f, kv) for kv in kv_cache_dtypes if kv != "auto" for p in precisions for f
             in fractions]
    start = time.perf_counter()
    for precision, order, frac, kv in tqdm(jobs, desc="perplexity", unit="config", disable=not progress):
        n = num_quantized(frac, num_layers)
        layers = all_orders[order][:n]
        rows.append({"precision": precision, "order": order, "fraction_pct": frac, "num_quantized": n,
                     "kv_cache_dtype": kv, "quantized_layers": layers,
                     "perplexity": ev.ppl(precision, frozenset(layers), kv),
                     "agreement": ev.agreement(precision, frozenset(layers), kv)})
    return {
        "engine_dir": str(engine.root), "tokens": int(windows.numel()), "window": window, "windows": windows.shape[0],
        "weights": "runtime kernels (bf16 activations)" if kernels else "dequantized runtime weights, fp32 forward",
        "profile_seconds": engine.manifest["importance"]["profile_seconds"],
        "int4_group_size": engine.manifest["int4"]["group_size"],
        "swap_order": engine.swap_order, "rows": rows, "seconds": round(time.perf_counter() - start, 1),
    }


def markdown_table(result: dict[str, Any], value: str = "perplexity") -> str:
    """One row per (precision, order, KV) and one column per fraction quantized, of ``value`` (perplexity, or
    agreement: the share of positions whose top-1 next token is full precision's)."""
    fractions = sorted({r["fraction_pct"] for r in result["rows"]})
    counts = {r["fraction_pct"]: r["num_quantized"] for r in result["rows"]}
    head = "| precision | order | KV | " + " | ".join(f"{f:g} % ({counts[f]})" for f in fractions) + " |"
    lines = [head, "|" + "---|" * (len(fractions) + 3)]
    keys = list(dict.fromkeys((r["precision"], r["order"], r.get("kv_cache_dtype", "auto")) for r in result["rows"]))
    for precision, order, kv in keys:
        vals = {r["fraction_pct"]: r.get(value, math.nan) for r in result["rows"]
                if (r["precision"], r["order"], r.get("kv_cache_dtype", "auto")) == (precision, order, kv)}
        lines.append(f"| {precision} | {ORDER_LABELS[order]} | {'full' if kv == 'auto' else kv} | "
                     + " | ".join(f"{vals[f]:.{2 if value == 'perplexity' else 3}f}" for f in fractions) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m builder.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--text", required=True, help="held-out UTF-8 text (not the calibration text)")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--precisions", default="int8,int4")
    p.add_argument("--orders", default="lis,front_to_back", help="from lis, front_to_back, back_to_front")
    p.add_argument("--fractions", default="0,25,50,75,100", help="percent of layers quantized")
    p.add_argument("--kv-cache-dtypes", default="auto,int8",
                   help="KV-cache storage per row set: auto (full precision) and 8-bit formats (int8, fp8), whose rows "
                        "repeat the weight rows of the first order with K/V rounded as the engine's 8-bit KV blocks "
                        "hold them")
    p.add_argument("--kernels", action="store_true", help="run the runtime aten kernels instead of dequantized weights")
    p.add_argument("--json", default=None, help="output JSON (default: <engine-dir>/quality_<text stem>.json)")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        engine = load_engine_dir(args.engine_dir)
        text = Path(args.text).read_text(encoding="utf-8")
    except (EngineDirError, OSError, UnicodeDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    order_names = [o.strip() for o in args.orders.split(",") if o.strip()]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    kv_dtypes = tuple(k.strip() for k in args.kv_cache_dtypes.split(",") if k.strip())
    bad = [o for o in order_names if o not in ORDER_LABELS] + [p for p in precisions if p not in engine.precisions]
    bad += [k for k in kv_dtypes if k not in KV_CACHE_DTYPES]
    if bad:
        print(f"error: unknown order or precision not in the engine dir: {', '.join(bad)}", file=sys.stderr)
        return 2
    token_ids = engine.loaded.tokenizer.encode(text)[: args.max_tokens]
    result = evaluate(engine, token_ids, precisions, order_names, [float(f) for f in args.fractions.split(",")],
                      args.window, args.kernels, progress=not args.quiet, kv_cache_dtypes=kv_dtypes)
    result["text"] = str(args.text)
    out = Path(args.json) if args.json else Path(args.engine_dir) / f"quality_{Path(args.text).stem}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown_table(result))
    print("\ntop-1 next-token agreement with full precision (every position):\n")
    print(markdown_table(result, "agreement"))
    print(f"\n{result['tokens']} tokens of {args.text} in {result['windows']} windows of {result['window']}; "
          f"{result['weights']}; layer profile took {result['profile_seconds']:.1f} s; eval {result['seconds']:.0f} s; "
          f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
