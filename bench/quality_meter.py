"""Calibration of the live quality meter against the same quantity computed offline over every position.

One engine serves a fixed configuration: ``--layers`` decoder layers (the first of the swap order) at ``--precision``
and, by default, an 8-bit KV cache (``kv_cache_dtype`` int8); restores, further swaps and the KV rung are off, so the
configuration stays as set. Requests whose prompts are windows of the held-out text (workload/quality.py's: the
committed Botchan excerpt, tokenized by the engine's tokenizer) are served greedily with the meter on, at a budget
that lets it sample ``--per-step`` positions per step (a random subset: the meter's own rule). Then, offline, each
finished request's context is run twice in scratch state, once in the served configuration (its layers, an 8-bit
cache) and once at full precision, and the top-1 agreement is counted over every position that emitted a token.
The report: the meter's agreement and bound, the offline agreement over all positions, the difference in points.

Reading it: the meter's number is a sample of the offline one (the same positions, the same two models), so the two
differ by sampling error and by the served path's arithmetic (paged decode vs the offline prefill), a few points at
most; a larger gap means the meter compares the wrong distributions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import torch

from policy import FULL, MorphDecision
from policy.quality import SamplingRule
from serve.config import EngineConfig
from serve.config_flags import add_engine_flags
from serve.engine.engine import LLMEngine
from serve.engine.quality_meter import QualityMeter
from serve.engine.sampling_params import SamplingParams
from serve.model.embedded import EMBEDDED_MODEL
from serve.model.kv_cache import PagedKVCache
from serve.model.llama import ForwardBatch, PrefillChunk
from serve.morph.runtime import MorphRuntime
from workload.items import default_text_path

FIXED = {"cost_aware": False, "restore_persist_s": 1e9, "kv_rung": None, "max_quantized_fraction": 1.0}
"""Policy keys that keep the configuration as the tool set it: no restore, no KV rung, room for every layer."""


def build_engine(model: str, layers: int, precision: str, kv_cache_dtype: str, requests: int,
                 num_threads: int | None = None) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model, morph_mode="default", morph_precisions="int8,int4",
                                    kv_cache_dtype=kv_cache_dtype, policy_overrides=FIXED, quality_meter=1e9,
                                    num_kv_blocks=max(64, 16 * requests), max_num_seqs=requests,
                                    num_threads=num_threads, speculation="off"))
    runtime = engine.resource_manager(MorphRuntime)
    assert runtime is not None
    runtime.apply_now(MorphDecision("quantize", tuple(runtime.controller.swap_order[:layers]), precision,
                                    "calibration"))
    return engine


def prompts(engine: LLMEngine, requests: int, prompt_tokens: int) -> list[list[int]]:
    """``requests`` windows of ``prompt_tokens`` tokens of the held-out text (workload/quality.py's)."""
    ids = engine.tokenizer.encode(default_text_path().read_text(encoding="utf-8"))
    return [ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(requests)]


def logits_over(engine: LLMEngine, tokens: list[int], first: int, layers: list[Any],
                kv_cache_dtype: str) -> torch.Tensor:
    """Logits at positions ``first - 1 .. len(tokens) - 2`` (each predicting the next token) of one prefill over
    ``tokens`` with ``layers``, in a scratch cache of ``kv_cache_dtype``."""
    m, bs = engine.model, engine.config.block_size
    n = len(tokens) - 1
    kv = PagedKVCache.standalone(m.config, math.ceil(n / bs), bs, m.device, m.dtype, kv_cache_dtype)
    pos = torch.arange(n, device=m.device)
    batch = ForwardBatch(input_ids=torch.tensor(tokens[:n], device=m.device), positions=pos, slot_mapping=pos,
                         num_decodes=0, prefills=[PrefillChunk(0, n, 0, None)],
                         sample_indices=torch.arange(first - 1, n, device=m.device))
    with torch.inference_mode():
        return m.forward(batch, kv, layers=layers)


def full_precision_layers(engine: LLMEngine) -> list[Any]:
    """Every layer at full precision, taken from the layer bank here (``detached``: fresh copies of its sources), not
    through the meter, so that a meter reading the wrong layers cannot make the offline number agree with it."""
    bank = engine.resource_manager(MorphRuntime).bank
    return [layer if layer.precision == FULL else bank.detached(i, FULL) for i, layer in enumerate(engine.model.layers)]


def offline_agreement(engine: LLMEngine, sequences: list[tuple[int, list[int]]],
                      kv_cache_dtype: str) -> tuple[int, int]:
    """(positions whose served top-1 token is full precision's, positions) over every emitted token."""
    agreed = total = 0
    served_layers, full_layers = list(engine.model.layers), full_precision_layers(engine)
    for prompt_len, tokens in sequences:
        served = logits_over(engine, tokens, prompt_len, served_layers, kv_cache_dtype).argmax(-1)
        full = logits_over(engine, tokens, prompt_len, full_layers, "auto").argmax(-1)
        agreed += int((served == full).sum())
        total += served.numel()
    return agreed, total


def calibrate(model: str = EMBEDDED_MODEL, layers: int = 15, precision: str = "int4", kv_cache_dtype: str = "int8",
              requests: int = 8, prompt_tokens: int = 48, max_tokens: int = 40, per_step: int = 6,
              num_threads: int | None = None) -> dict[str, Any]:
    engine = build_engine(model, layers, precision, kv_cache_dtype, requests, num_threads)
    try:
        meter = engine.resource_manager(QualityMeter)
        assert meter is not None
        meter.rule = SamplingRule(1e9, max_per_step=per_step, seed=engine.config.seed)  # a fixed share of positions
        ps = prompts(engine, requests, prompt_tokens)
        outs = engine.generate(ps, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        stats = meter.resource_stats()
        sequences = [(len(p), [*p, *o["token_ids"]]) for p, o in zip(ps, outs)]
        agreed, total = offline_agreement(engine, sequences, kv_cache_dtype)
        r = stats.reading
        live = stats.agreed_total / stats.samples_total if stats.samples_total else None
        return {"model": model, "configuration": engine.resource_manager(MorphRuntime).config_signature(),
                "kv_cache_dtype": kv_cache_dtype, "requests": requests, "positions": total,
                "meter_samples": stats.samples_total, "meter_agreement": live,
                "meter_lower": r.lower if r else None, "meter_divergence": r.divergence if r else None,
                "offline_agreement": agreed / total if total else None,
                "difference_points": None if live is None or not total else round(100 * (live - agreed / total), 2)}
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(ap, ("model", "kv_cache_dtype", "num_threads"),
                     defaults={"model": EMBEDDED_MODEL, "kv_cache_dtype": "int8"})
    ap.add_argument("--layers", type=int, default=15, help="layers served quantized (the swap order's first)")
    ap.add_argument("--precision", default="int4", choices=("int8", "int4"))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--per-step", type=int, default=6, help="positions the meter may sample per step")
    a = ap.parse_args(argv)
    report = calibrate(a.model, a.layers, a.precision, a.kv_cache_dtype, a.requests, a.prompt_tokens, a.max_tokens,
                       a.per_step, a.num_threads)
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
