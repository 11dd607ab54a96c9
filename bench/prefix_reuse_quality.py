"""What serving cached prefixes across morph transitions costs in quality (``prefix_cache_across_morph``).

Under ``preserve`` a prompt prefix cached while every layer ran at full precision serves a later request
after k layers moved to int4 (and one cached with k int4 layers serves after they are restored); under
``exact`` that request recomputes the prefix in the configuration it runs in. For k in ``--layers`` (the
engine's own swap order, int4), in both directions, and prompts of real text this measures, against exact:

- token agreement: the greedy continuation of ``prefix + suffix`` from a preserve engine that reuses the
  full-precision prefix, against the same engine after ``reset_prefix_cache`` (recomputed under the int4
  configuration): prefix match and position-wise match rates (``workload.quality.match_rates``); both also
  against every layer at full precision (the quality both approximate);
- perplexity of the continuation text: its tokens are scored in the int4 configuration with the prefix's KV
  computed at full precision (preserve) or in the int4 configuration (exact), with
  ``workload.quality.QualityEvaluator``: the prefix's KV is written in one configuration, then the continuation
  runs in the other as a chunk that attends to it (``QualityEvaluator.forward``).

Example: ``python -m bench.prefix_reuse_quality --layers 4,8,16 --prompts 8 --json out.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import torch

from policy import FULL, MorphDecision, signature
from serve.config import EMBEDDED_MODEL
from serve.config_flags import add_engine_flags
from serve.morph.runtime import MorphRuntime
from workload.items import PromptBuilder, default_text_path
from workload.quality import QualityEvaluator, aggregate_match, match_rates


def _signature(ev: QualityEvaluator, int4_layers: list[int]) -> str:
    return signature("int4" if i in int4_layers else FULL for i in range(ev.num_layers))


def continuation_nll(ev: QualityEvaluator, prefix: list[int], text: list[int], prefix_layers: list[int],
                     text_layers: list[int]) -> float:
    """Summed NLL of ``text[1:]`` given ``prefix + text[:1]``: the prefix's KV computed with ``prefix_layers`` at
    int4, the text with ``text_layers`` at int4 (the rest at full precision)."""
    with torch.inference_mode():
        with ev.configuration(_signature(ev, prefix_layers)):
            ev.forward(prefix, 0)  # writes the prefix's KV at slots 0..len(prefix)-1
        with ev.configuration(_signature(ev, text_layers)):
            logits = ev.forward(text, len(prefix))
        target = torch.tensor(text[1:], device=logits.device)
        return float(torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum"))


def token_agreement(engine: Any, prefix: list[int], suffix: list[int], layers: list[int], max_tokens: int) -> dict:
    from serve.engine.sampling_params import SamplingParams  # noqa: PLC0415

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()
    full = engine.generate([prefix + suffix], greedy)[0]["token_ids"]  # every layer at full precision
    engine.reset_prefix_cache()
    engine.generate([prefix + [suffix[0]]], SamplingParams(max_tokens=1))  # the prefix, cached at full precision
    engine.resource_manager(MorphRuntime).apply_now(MorphDecision("quantize", tuple(layers), "int4",
                                                                  "prefix reuse quality"))
    hits = engine.stats().prefix_cache_hits
    reused = engine.generate([prefix + suffix], greedy)[0]["token_ids"]
    hit_tokens = engine.stats().prefix_cache_hits - hits
    engine.reset_prefix_cache()
    recomputed = engine.generate([prefix + suffix], greedy)[0]["token_ids"]
    engine.reset_prefix_cache()
    engine.generate([prefix + [suffix[0]]], SamplingParams(max_tokens=1))  # the prefix, cached at int4
    for layer in reversed(layers):  # LIFO back to full precision
        engine.resource_manager(MorphRuntime).apply_now(MorphDecision("restore", (layer,), None,
                                                                      "prefix reuse quality"))
    back = engine.generate([prefix + suffix], greedy)[0]["token_ids"]  # preserve: full precision on int4 KV
    return {"to_int4": {"preserve_vs_exact": match_rates(recomputed, reused),
                        "exact_vs_full": match_rates(full, recomputed), "preserve_vs_full": match_rates(full, reused)},
            "to_full": {"preserve_vs_exact": match_rates(full, back)},  # exact recomputes at full precision
            "hit_tokens": hit_tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_reuse_quality", description=__doc__.split("\n")[0])
    add_engine_flags(p, ("model", "num_threads"), aliases={"num_threads": ["--threads"]},
                     defaults={"model": EMBEDDED_MODEL, "num_threads": 2})
    p.add_argument("--layers", default="4,8,16", help="numbers of layers at int4 (the swap order's first k)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=256, help="the cached prefix (a multiple of 16)")
    p.add_argument("--suffix-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    p.add_argument("--text-tokens", type=int, default=128, help="continuation tokens scored for perplexity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from serve.config import EngineConfig  # noqa: PLC0415
    from serve.engine.engine import LLMEngine  # noqa: PLC0415

    ks = [int(k) for k in args.layers.split(",")]
    window = args.prefix_tokens + max(args.text_tokens, args.suffix_tokens + args.max_tokens)
    ev = QualityEvaluator(args.model, window=window, num_threads=args.num_threads)
    engine = LLMEngine(EngineConfig(model=args.model, morph_mode="default", morph_precisions="int8,int4",
                                    prefix_cache_across_morph="preserve", num_kv_blocks=2 * math.ceil(window / 16) + 8,
                                    max_model_len=window + 16, num_threads=args.num_threads))
    order = list(engine.resource_manager(MorphRuntime).controller.swap_order)
    builder = PromptBuilder(engine.tokenizer, default_text_path().read_text(encoding="utf-8"))
    rng = random.Random(args.seed)
    samples = [builder.prompt(args.prefix_tokens + args.text_tokens, rng) for _ in range(args.prompts)]
    out: dict[str, Any] = {"model": args.model, "prompts": args.prompts, "prefix_tokens": args.prefix_tokens,
                           "suffix_tokens": args.suffix_tokens, "max_tokens": args.max_tokens,
                           "text_tokens": args.text_tokens, "by_layers": {}}
    try:
        for k in ks:
            layers = order[:k]
            rows: list[dict] = []
            nll = {"int4": 0.0, "full_kv_int4": 0.0, "full": 0.0, "int4_kv_full": 0.0}
            count = 0
            for ids in samples:
                prefix, rest = ids[:args.prefix_tokens], ids[args.prefix_tokens:]
                rows.append(token_agreement(engine, prefix, rest[:args.suffix_tokens], layers, args.max_tokens))
                nll["int4"] += continuation_nll(ev, prefix, rest, layers, layers)          # exact, int4 config
                nll["full_kv_int4"] += continuation_nll(ev, prefix, rest, [], layers)      # preserve, int4 config
                nll["full"] += continuation_nll(ev, prefix, rest, [], [])                  # exact, full config
                nll["int4_kv_full"] += continuation_nll(ev, prefix, rest, layers, [])      # preserve, full config
                count += len(rest) - 1
            ppl = {name: math.exp(v / count) for name, v in nll.items()}
            out["by_layers"][k] = {
                "int4_layers": layers,
                "full_kv_served_to_int4": {
                    "agreement": {pair: aggregate_match(r["to_int4"][pair] for r in rows)
                                  for pair in ("preserve_vs_exact", "exact_vs_full", "preserve_vs_full")},
                    "perplexity_exact": round(ppl["int4"], 4), "perplexity_preserve": round(ppl["full_kv_int4"], 4),
                    "perplexity_change_pct": round((ppl["full_kv_int4"] / ppl["int4"] - 1) * 100, 3)},
                "int4_kv_served_to_full": {
                    "agreement": {"preserve_vs_exact": aggregate_match(r["to_full"]["preserve_vs_exact"] for r
                                                                       in rows)},
                    "perplexity_exact": round(ppl["full"], 4), "perplexity_preserve": round(ppl["int4_kv_full"], 4),
                    "perplexity_change_pct": round((ppl["int4_kv_full"] / ppl["full"] - 1) * 100, 3)},
                "hit_tokens_per_prompt": sum(r["hit_tokens"] for r in rows) / len(rows),
            }
            print(json.dumps({k: out["by_layers"][k]}), file=sys.stderr, flush=True)
    finally:
        engine.shutdown()
        ev.shutdown()
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
