"""Self-speculative decoding: greedy decode tok/s with speculation off / always / auto, acceptance per draft precision
and k.

  .venv/bin/python -m bench.speculation [--batches 1,4,8] [--new 48] [--repeats 3] [--cells int8:1,int8:2,...]
                                        [--json PATH]

Prompts are held-out text (workload/data/botchan_excerpt.txt, slices of 24 words) and chat prompts (the model's chat
template). Per batch size B and configuration, decode tok/s = B * (N - 1) / (time(N new tokens) - time(1 new token))
as bench.quant_decode measures it (prefill excluded), greedy, ``--repeats`` times with the configurations
interleaved; reported as ``median [min-max]`` and as a ratio to off within the same repeat. Every speculative run's
tokens are compared with off's for the same prompts (a mismatch is a near-tie flipped by the verify kernels, counted
and reported). ``--cells`` lists the forced (precision, k) configurations (speculation always with that draft; ``:fast``
verifies with the kernels the verify's row count picks, not the plain step's); ``auto`` and ``off`` always run.
Acceptance per cell is accepted / drafted tokens over the cell's runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from serve.config import EMBEDDED_MODEL, EngineConfig
from serve.config_flags import add_engine_flags, engine_kwargs
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.engine.spec_manager import SpeculationManager
from workload.items import default_text_path
from workload.repeats import span

DATA = default_text_path()
CHATS = ["Name three colors.", "What is the capital of France?", "Explain what a prime number is.",
         "Write a short poem about the sea.", "Give me two tips for learning to cook.", "Who wrote Hamlet?",
         "What is 12 times 7?", "Describe a cat in one sentence."]


def prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    """``n`` prompts, alternating held-out text slices and chat prompts."""
    words = DATA.read_text(encoding="utf-8").split()
    tok = engine.tokenizer
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(tok.encode(" ".join(words[(i // 2) * 53:(i // 2) * 53 + 24])))
        else:
            chat = CHATS[(i // 2) % len(CHATS)]
            out.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": chat}])))
    return out


def _run(engine: LLMEngine, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = engine.generate(batch, SamplingParams(max_tokens=new, ignore_eos=True))
    return time.perf_counter() - t0, [o["token_ids"] for o in outs]


def decode_tok_s(engine: LLMEngine, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    full, tokens = _run(engine, batch, new)
    one, _ = _run(engine, batch, 1)
    return len(batch) * (new - 1) / max(full - one, 1e-9), tokens


def force(engine: LLMEngine, precision: str, k: int, fast: bool) -> None:
    """Speculation always with this draft: precision ``precision``, ``k`` tokens; ``fast``: verify with the kernels the
    verify's row count picks (not the plain step's: serve/engine/spec_executor.py ``match_kernels``)."""
    manager = engine.resource_manager(SpeculationManager)
    assert manager is not None
    c = manager.controller
    c.config = dataclasses.replace(c.config, mode="always", precisions=(precision,), always_k=k,
                                   max_k=max(k, c.config.max_k))
    engine.executor.match_kernels = not fast


def label(cell: tuple[str, int, bool]) -> str:
    return f"{cell[0]}:k{cell[1]}" + (" fast verify" if cell[2] else "")


def run(args: argparse.Namespace) -> dict:
    base = engine_kwargs(args, ("model", "num_threads"))
    torch.set_num_threads(args.num_threads)
    cfg = dict(num_kv_blocks=1024, max_num_seqs=64, enable_prefix_caching=False, **base)
    engines = {"off": LLMEngine(EngineConfig(speculation="off", **cfg)),
               "auto": LLMEngine(EngineConfig(speculation="auto", **cfg)),
               "always": LLMEngine(EngineConfig(speculation="always", **cfg))}
    cells = [(c.split(":")[0], int(c.split(":")[1]), c.endswith(":fast")) for c in args.cells.split(",") if c]
    batches = [int(b) for b in args.batches.split(",")]
    work = prompts(engines["off"], max(batches))
    results: dict = {"batches": {}, "cells": {}, "flips": 0, "compared": 0}
    counts = {cell: [0, 0] for cell in cells}
    for b in batches:
        per: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            rate, want = decode_tok_s(engines["off"], work[:b], args.new)
            per.setdefault("off", []).append(rate)
            runs = [("auto", engines["auto"], None)] + [(label(cell), engines["always"], cell) for cell in cells]
            for name, engine, cell in runs:
                manager = engine.resource_manager(SpeculationManager)
                if cell is not None:
                    force(engine, *cell)
                before = (manager.num_draft_tokens, manager.num_accepted_tokens) if manager else (0, 0)
                rate, got = decode_tok_s(engine, work[:b], args.new)
                print(f"# batch {b} {name}: {rate:.1f} tok/s (off {per['off'][-1]:.1f})", file=sys.stderr, flush=True)
                per.setdefault(name, []).append(rate)
                per.setdefault(f"{name} / off", []).append(rate / per["off"][-1])
                results["compared"] += len(got)
                results["flips"] += sum(g != w for g, w in zip(got, want))
                if cell is not None and manager is not None:
                    counts[cell][0] += manager.num_draft_tokens - before[0]
                    counts[cell][1] += manager.num_accepted_tokens - before[1]
        results["batches"][b] = {name: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                                 for name, v in per.items()}
    for cell, (drafted, accepted) in counts.items():
        results["cells"][label(cell)] = {"drafted": drafted, "accepted": accepted,
                                         "acceptance": accepted / drafted if drafted else None}
    auto = engines["auto"].resource_manager(SpeculationManager)
    results["auto"] = ({"built": True, "last_decision": auto.last_decision.reason if auto.last_decision else "",
                        "drafts": auto.num_drafts} if auto else {"built": False})
    for e in engines.values():
        e.shutdown()
    return results


def report(results: dict) -> str:
    lines = ["| batch | configuration | decode tok/s | ratio to off (same repeat) |", "|---|---|---:|---:|"]
    for b, per in results["batches"].items():
        for name, v in per.items():
            if name.endswith(" / off"):
                continue
            ratio = per.get(f"{name} / off")
            lines.append(f"| {b} | {name} | {span(v['median'], v['min'], v['max'])} | "
                         + (span(ratio['median'], ratio['min'], ratio['max'], 2) if ratio else "1") + " |")
    lines += ["", "| draft | drafted | accepted | acceptance |", "|---|---:|---:|---:|"]
    for cell, c in results["cells"].items():
        acc = "n/a" if c["acceptance"] is None else f"{c['acceptance']:.3f}"
        lines.append(f"| {cell} | {c['drafted']} | {c['accepted']} | {acc} |")
    lines.append(f"\noutputs differing from off: {results['flips']} of {results['compared']}; auto: {results['auto']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p, ("model", "num_threads"), defaults={"model": EMBEDDED_MODEL, "num_threads": 2},
                     aliases={"num_threads": ["--threads"]})
    p.add_argument("--batches", default="1,4,8", help="batch sizes, comma-separated (default: %(default)s)")
    p.add_argument("--new", type=int, default=48, help="new tokens per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration, interleaved (default: %(default)s)")
    p.add_argument("--cells", default="int8:1,int8:2,int8:3,int8:4,int4:2,int8:3:fast",
                   help="forced drafts PRECISION:K[:fast], comma-separated; fast: verify with the kernels the verify's "
                        "row "
                        "count picks instead of the plain step's (default: %(default)s)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.new < 2 or args.repeats < 1:
        p.error("--new must be >= 2 and --repeats >= 1")
    results = run(args)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
