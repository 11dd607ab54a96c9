"""What 8-bit KV costs and buys: perplexity with int8 vs full-precision KV (the engine's own forward and KV blocks),
greedy agreement of held-out probe prompts with full-precision KV, and the KV tokens at one ``--device-memory``.

``python -m bench.kv_precision [--model smollm2-135m] [--device-memory 1200MiB] [--json OUT]``

Perplexity: ``workload.quality.QualityEvaluator`` (held-out Botchan text, 512-token windows) with its KV stored as
``auto`` and as ``int8``, for the all-full configuration and for the signatures given with ``--signature`` (e.g.
half the layers at int4). Agreement: ``workload.quality.PROBE_PROMPTS`` greedy, one at a time, int8 KV against fp32 KV
(prefix and position-wise token match). Capacity: the base KV pool's blocks x block_size of two engines at the same
budget. Nothing here is timed (decode speed at long context: ``bench.engine_throughput`` /
``bench.attention_kernels``; docs/morphing.md "KV-cache precision" gives the commands).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from serve.config import EMBEDDED_MODEL
from serve.config_flags import add_engine_flags
from workload.quality import PROBE_PROMPTS, QualityEvaluator, aggregate_match, match_rates, quality_loss_pct


def perplexities(model: str, signatures: list[str], num_tokens: int, window: int) -> dict[str, dict[str, float]]:
    """{kv_cache_dtype: {signature: perplexity}} for auto and int8 KV."""
    out: dict[str, dict[str, float]] = {}
    for kv in ("auto", "int8"):
        ev = QualityEvaluator(model, num_tokens=num_tokens, window=window, kv_cache_dtype=kv)
        try:
            full = "f" * ev.num_layers
            out[kv] = {sig: ev.perplexity(sig) for sig in [full, *signatures]}
        finally:
            ev.shutdown()
    return out


def agreement(model: str, max_tokens: int) -> dict:
    from serve.config import EngineConfig  # noqa: PLC0415
    from serve.engine.engine import LLMEngine  # noqa: PLC0415
    from serve.engine.sampling_params import SamplingParams  # noqa: PLC0415

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = {}
    for kv in ("auto", "int8"):
        engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, kv_cache_dtype=kv))
        try:
            outs[kv] = [engine.generate([p], params)[0]["token_ids"] for p in PROBE_PROMPTS]
        finally:
            engine.shutdown()
    rows = [match_rates(ref, got) for ref, got in zip(outs["auto"], outs["int8"])]
    return {"max_tokens": max_tokens, **aggregate_match(rows), "per_probe": rows}


def capacity(model: str, device_memory: str) -> dict:
    from serve.config import EngineConfig  # noqa: PLC0415
    from serve.engine.engine import LLMEngine  # noqa: PLC0415

    out = {"device_memory": device_memory}
    for kv in ("auto", "int8"):
        engine = LLMEngine(EngineConfig(model=model, device_memory=device_memory, kv_cache_dtype=kv))
        out[kv] = {"kv_blocks": engine.pool.num_blocks, "kv_tokens": engine.pool.num_blocks * engine.config.block_size,
                   "block_bytes": engine.ledger.slot_bytes}
        engine.shutdown()
    out["ratio"] = out["int8"]["kv_tokens"] / out["auto"]["kv_tokens"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_precision", description=__doc__.split("\n\n")[0])
    add_engine_flags(p, ("model", "device_memory"), defaults={"model": EMBEDDED_MODEL, "device_memory": "1200MiB"},
                     help_overrides={"device_memory": "memory budget of the KV capacity comparison"})
    p.add_argument("--signature", action="append", default=[],
                   help="also a layer configuration (one character per layer: f, 8, 4), e.g. half at int4")
    p.add_argument("--num-tokens", type=int, default=4096, help="held-out tokens for perplexity")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--probe-tokens", type=int, default=64, help="greedy tokens per probe prompt")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    ppl = perplexities(args.model, args.signature, args.num_tokens, args.window)
    result = {"model": args.model, "perplexity": ppl,
              "perplexity_cost_pct": {sig: quality_loss_pct(ppl["int8"][sig], ppl["auto"][sig]) for sig in ppl["auto"]},
              "agreement": agreement(args.model, args.probe_tokens),
              "capacity": capacity(args.model, args.device_memory)}
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
