"""What structured output costs on this machine: output tok/s with and without guides at batch 1 and 32
(medians of N interleaved rounds, with the spread), compile time per schema, and the two maintained grammar
engines side by side (xgrammar, the one serve/guided uses; llguidance) on the same schemas: compile time and
per-token mask time along the same recorded outputs.

Fair throughput: the unguided run of each request is given exactly the token count its guided run produced
(``ignore_eos``), so both runs decode the same number of tokens with the same batch occupancy.

    python -m bench.guided_cost --rounds 3 --out docs/benchmarks/guided_cost_<date>.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.guided_schemas import SCHEMAS, schema_prompt
from serve.config import EMBEDDED_MODEL, EngineConfig
from serve.config_flags import add_engine_flags
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.guided.compiler import GuideCompiler
from serve.guided.spec import GuidedDecoding
from workload.repeats import cell, spread


def cpu_description() -> dict[str, Any]:
    """lscpu's model name and the SIMD flags that decide kernel speed, from /proc/cpuinfo."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile"})
    return {"model_name": model, "simd": simd, "torch_threads": torch.get_num_threads()}


def _params(schema: dict, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, guided_decoding={"type": "json_schema", "guide": json.dumps(schema)})


def _timed(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - t0, outs


def throughput(engine: LLMEngine, batch: int, rounds: int, max_tokens: int,
               schemas: list[tuple[str, dict]] = SCHEMAS) -> dict[str, Any]:
    picks = [schemas[i % len(schemas)] for i in range(batch)]
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": schema_prompt(s)}]) for s, _ in picks]
    guided = [_params(schema, max_tokens) for _, schema in picks]
    _, outs = _timed(engine, prompts, guided)  # warm-up, and the token counts the unguided runs get
    counts = [len(o["token_ids"]) for o in outs]
    plain = [SamplingParams(max_tokens=n, ignore_eos=True) for n in counts]
    rates: dict[str, list[float]] = {"guided": [], "unguided": []}
    for _ in range(rounds):  # interleaved, so a load change hits both alike
        for label, params in (("unguided", plain), ("guided", guided)):
            engine.reset_prefix_cache()
            seconds, outs = _timed(engine, prompts, params)
            rates[label].append(sum(len(o["token_ids"]) for o in outs) / seconds)
    ratios = [g / u for g, u in zip(rates["guided"], rates["unguided"])]
    return {"batch": batch, "output_tokens": sum(counts), "tok_s": {k: spread(v) for k, v in rates.items()},
            "guided_over_unguided": spread(ratios), "cells": {k: cell(v) for k, v in rates.items()},
            "ratio_cell": cell(ratios, 3)}


def xgrammar_compile_ms(engine: LLMEngine, schemas: list[tuple[str, dict]] = SCHEMAS) -> list[float]:
    compiler = GuideCompiler(engine.tokenizer, engine.model_config.vocab_size, cache_bytes=0)
    compiler.compile(GuidedDecoding("json_schema", json.dumps(schemas[0][1])))  # tokenizer analysis, once
    times = []
    for _, schema in schemas:
        t0 = time.perf_counter()
        compiler.compile(GuidedDecoding("json_schema", json.dumps(schema)))
        times.append((time.perf_counter() - t0) * 1e3)
    compiler.close()
    return times


def engines_side_by_side(engine: LLMEngine, outputs: list[list[int]],
                         schemas: list[tuple[str, dict]] = SCHEMAS) -> dict[str, Any]:
    """Compile and per-token mask time of xgrammar and llguidance on the same schemas, each matcher driven
    along the same recorded (xgrammar-guided) output."""
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    vocab = engine.model_config.vocab_size
    hf = PreTrainedTokenizerFast(tokenizer_object=engine.tokenizer.backend)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=list(engine.tokenizer.eos_token_ids))
    xcomp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=list(engine.tokenizer.eos_token_ids)[0])
    result: dict[str, dict[str, list[float]]] = {"xgrammar": {"compile_ms": [], "mask_us_per_token": []},
                                                 "llguidance": {"compile_ms": [], "mask_us_per_token": []}}
    rejected: list[str] = []
    for (_, schema), tokens in zip(schemas, outputs):
        text = json.dumps(schema)
        t0 = time.perf_counter()
        compiled = xcomp.compile_json_schema(text, any_whitespace=False)
        result["xgrammar"]["compile_ms"].append((time.perf_counter() - t0) * 1e3)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        t0 = time.perf_counter()
        for tok in tokens:
            matcher.fill_next_token_bitmask(bitmask, 0)
            matcher.accept_token(tok)
        result["xgrammar"]["mask_us_per_token"].append((time.perf_counter() - t0) * 1e6 / max(len(tokens), 1))
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(  # the same compact JSON as xgrammar's
            text, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        ll = llguidance.LLMatcher(lltok, grammar)
        result["llguidance"]["compile_ms"].append((time.perf_counter() - t0) * 1e3)
        llmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
        t0 = time.perf_counter()
        for tok in tokens:
            llguidance.torch.fill_next_token_bitmask(ll, llmask, 0)
            ll.consume_token(tok)
        result["llguidance"]["mask_us_per_token"].append((time.perf_counter() - t0) * 1e6 / max(len(tokens), 1))
        if ll.is_error() or not matcher.is_terminated():  # both must have taken the whole output
            rejected.append(text)
    out: dict[str, Any] = {name: {k: {"median": statistics.median(v), "max": max(v)} for k, v in figures.items()}
                           for name, figures in result.items()}
    out["outputs_rejected_by_either"] = len(rejected)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.guided_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p, ("model",), defaults={"model": EMBEDDED_MODEL})
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per batch size (default: %(default)s)")
    p.add_argument("--batches", default="1,32", help="batch sizes, comma-separated (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=160, help="cap of each guided answer (default: %(default)s)")
    p.add_argument("--schemas", type=int, default=len(SCHEMAS),
                   help="the first N of bench/guided_schemas.py's schemas (default: all %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    schemas = SCHEMAS[:max(1, args.schemas)]
    argv = sys.argv[1:] if argv is None else argv
    engine = LLMEngine(EngineConfig(model=args.model, num_kv_blocks=1024, max_num_seqs=32, max_num_batched_tokens=1024))
    try:
        result: dict[str, Any] = {"command": "python -m bench.guided_cost " + " ".join(argv or []),
                                  "cpu": cpu_description(),
                                  "date": time.strftime("%Y-%m-%d"), "schemas": len(schemas)}
        result["throughput"] = [throughput(engine, int(b), args.rounds, args.max_tokens, schemas)
                                for b in args.batches.split(",")]
        compile_ms = xgrammar_compile_ms(engine, schemas)
        result["xgrammar_compile_ms"] = {"median": statistics.median(compile_ms), "max": max(compile_ms)}
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": schema_prompt(s)}]) for s, _
                   in schemas]
        outs = engine.generate(prompts, [_params(schema, args.max_tokens) for _, schema in schemas])
        result["engines"] = engines_side_by_side(engine, [o["token_ids"] for o in outs], schemas)
    finally:
        engine.shutdown()
    for t in result["throughput"]:
        print(f"batch {t['batch']:>2}: unguided {t['cells']['unguided']} tok/s, guided {t['cells']['guided']} tok/s, "
              f"guided/unguided {t['ratio_cell']}")
    print(f"xgrammar compile per schema: median {result['xgrammar_compile_ms']['median']:.2f} ms, "
          f"max {result['xgrammar_compile_ms']['max']:.2f} ms")
    for name, figures in result["engines"].items():
        if not isinstance(figures, dict):
            continue
        print(f"{name}: compile median {figures['compile_ms']['median']:.2f} ms (max "
              f"{figures['compile_ms']['max']:.2f}), "
              f"mask+advance median {figures['mask_us_per_token']['median']:.0f} us/token")
    print(f"cpu: {result['cpu']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
