"""`make bench-peer`: the engine side by side with vLLM (CPU build) at full precision and with llama.cpp at
4 bits, in one run, on the same token-id prompts (greedy, ignore_eos, every output length forced).

  .venv/bin/python -m bench.peer --vllm-python PEERS/vllm-venv/bin/python \\
      --llamacpp-python PEERS/llamacpp-venv/bin/python --runs 3 [--json results/bench_peer.json]

Rows (output tok/s, medians of --runs with their [min-max] spread):
- fp32, ours (morph mode off) vs vLLM offline `LLM.generate`: batch-1 decode (128 tokens after a 32-token
  prompt), 32 prompts x 128 new tokens, 64 mixed requests (16-256 in, 16-128 out). Both engines cache
  prompt prefixes by default, and each workload is repeated: "cold" runs reset both prefix caches first
  (every prompt computed: engine speed on the same work), "warm" runs follow without a reset (the prompts
  were seen in the run before; vLLM's CPU blocks hold 128 tokens, ours 16, so more of each prompt is reused);
- 4 bits, batch-1 decode: ours in static-int4 and static-int8 vs llama.cpp on the GGUF Q4_1 file the project
  embeds (the same file our fp32 weights are dequantized from);
- self-speculative decoding, batch-1 greedy decode: ours with speculation off, always and auto on the engine
  directory (--speculation-model, default engines/smollm2-135m from make build-engines: auto needs its measured
  step costs; the Makefile passes $(ENGINE_DIR)), beside llama.cpp's and vLLM's batch-1 rows; each mode's greedy
  tokens are compared with off's (equal by construction; a difference is a near-tie the verify kernels flipped,
  counted); off and auto also run the 32-prompt and 64-mixed workloads (auto must not slow a full batch down).
  The fp32 and 4-bit rows above run with speculation off;
- batch-1 decode as a fraction of the memory-bandwidth bound: weight bytes read per token / the read rate
  of a GEMV-shaped read (``F.linear`` of one row against a 256 MiB fp32 matrix, the access pattern of a
  decode step), not ``sum()``, which streams faster than any matrix-vector product does here.
vLLM needs an HF directory: it is exported from the engine's own weights (serve.model.loader.save_hf_directory).
Each peer runs in a venv of its own (the Makefile makes them), as a subprocess, one after the other.
The server comparison (both servers under AIPerf at a fixed request rate) is bench.peer_servers
(`make bench-peer-servers`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.engine_throughput import decode_weight_bytes, emit, gemv_read_gbs
from bench.vllm_server import peer_env, vllm_env
from serve.config import EMBEDDED_MODEL, EngineConfig
from serve.config_flags import add_engine_flags
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.engine.spec_manager import SpeculationManager
from serve.model.embedded import DEFAULT_ENGINE_DIR
from serve.model.loader import embedded_model_path, load_model, save_hf_directory
from workload.repeats import cell

PEERS_DIR = Path(__file__).resolve().parent / "peers"


def workloads(vocab: int, seed: int = 0) -> dict[str, dict]:
    """The three offline workloads, as token ids (both engines get exactly these)."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]
    lens_in = [rng.randint(16, 256) for _ in range(64)]
    lens_out = [rng.randint(16, 128) for _ in range(64)]
    return {
        "batch-1 decode, 128 tokens after a 32-token prompt": {"prompts": [prompt(32)], "max_tokens": [128]},
        "32 prompts x 128 new tokens": {"prompts": [prompt(32) for _ in range(32)], "max_tokens": [128] * 32},
        "64 mixed requests (16-256 in, 16-128 out)": {"prompts": [prompt(n) for n in lens_in], "max_tokens": lens_out},
    }


def make_engine(mode: str, threads: int, model: str, speculation: str = "off") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, morph_mode=mode, max_num_seqs=64, max_num_batched_tokens=512,
                                  num_threads=threads, speculation=speculation))


def ours(engine: LLMEngine, wl: dict[str, dict], runs: int, warm_runs: int = 0) -> dict[str, dict[str, list[float]]]:
    """Output tok/s per workload: {"cold": runs with the prefix cache reset before each, "warm": warm_runs
    right after them, without a reset}."""
    engine.generate([[200] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    out: dict[str, dict[str, list[float]]] = {}
    for name, w in wl.items():
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in w["max_tokens"]]
        out[name] = {"cold": [], "warm": []}
        for i in range(runs + warm_runs):
            kind = "cold" if i < runs else "warm"
            if kind == "cold":
                engine.reset_prefix_cache()
            t0 = time.perf_counter()
            engine.generate(w["prompts"], params)
            out[name][kind].append(sum(w["max_tokens"]) / (time.perf_counter() - t0))
    return out


def speculation_rows(make: Callable[[str], LLMEngine], wl: dict, runs: int, modes: list[str]) -> dict[str, dict]:
    """Batch-1 greedy decode of the first workload of ``wl`` with speculation off and each of ``modes``
    (``make(speculation)`` builds the engine): tok/s per cold run, whether the greedy tokens equal off's, and what was
    drafted; off and auto also run the other workloads (``batched_tok_s``: auto must not slow a full batch down)."""
    name = next(iter(wl))
    rows: dict[str, dict] = {}
    reference: list[list[int]] | None = None
    for mode in ["off", *modes]:
        engine = make(mode)
        try:
            params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl[name]["max_tokens"]]
            tokens = [o["token_ids"] for o in engine.generate(wl[name]["prompts"], params)]
            reference = tokens if reference is None else reference
            manager = engine.resource_manager(SpeculationManager)
            drafted = (manager.num_draft_tokens, manager.num_accepted_tokens) if manager else (0, 0)
            loads = wl if mode != "always" else {name: wl[name]}  # always at batch 32+ only wastes the run
            timed = ours(engine, loads, runs)
            rows[mode] = {"tok_s": timed[name]["cold"],
                          "batched_tok_s": {w: t["cold"] for w, t in timed.items() if w != name},
                          "differing_outputs": sum(t != r for t, r in zip(tokens, reference)), "outputs": len(tokens),
                          "built": manager is not None, "draft_tokens": drafted[0], "accepted_tokens": drafted[1],
                          "last_decision": manager.last_decision.reason if manager and manager.last_decision else ""}
        finally:
            engine.shutdown()
    return rows


def run_vllm(python: str, hf_dir: Path, wl: dict, runs: int, warm_runs: int, threads: int, work: Path) -> dict:
    (work / "workloads.json").write_text(json.dumps(wl))
    env = vllm_env(threads)
    subprocess.run([python, str(PEERS_DIR / "vllm_offline.py"), "--model", str(hf_dir), "--workloads",
                    str(work / "workloads.json"), "--out", str(work / "vllm.json"), "--runs", str(runs),
                    "--warm-runs", str(warm_runs)],
                   env=env, check=True)
    return json.loads((work / "vllm.json").read_text())


def run_llamacpp(python: str, gguf: Path, prompt: list[int], new: int, runs: int, threads: int,
                 work: Path) -> list[float]:
    subprocess.run([python, str(PEERS_DIR / "llamacpp_decode.py"), "--gguf", str(gguf), "--prompt-ids",
                    ",".join(map(str, prompt)), "--new", str(new), "--runs", str(runs), "--threads", str(threads),
                    "--out", str(work / "llamacpp.json")], env=peer_env(), check=True)
    return json.loads((work / "llamacpp.json").read_text())["decode_tok_s"]


def _ratio(a: list[float] | None, b: list[float] | None) -> str:
    return f"{statistics.median(a) / statistics.median(b):.2f}x" if a and b else "n/a"


def to_markdown(r: dict) -> str:
    lines = ["| workload (fp32, output tok/s, median [min-max]) | prefix caches | ours (mode off) | vLLM CPU | ours / "
             "vLLM |",
             "|---|---|---:|---:|---:|"]
    for kind in ("cold", "warm"):
        for name, values in r["ours_fp32"].items():
            peer = r.get("vllm", {}).get(name, {}).get(kind)
            if values.get(kind) or peer:
                lines.append(f"| {name} | {kind} | {cell(values.get(kind))} | {cell(peer)} | "
                             f"{_ratio(values.get(kind), peer)} |")
    if "vllm" in r:
        lines.append(f"| startup to first request (s) | {r['ours_startup_s']:.1f} | {r['vllm']['startup_s']:.0f} | |")
    lines += ["", "| batch-1 decode at low precision, tok/s | ours | llama.cpp (GGUF Q4_1) | ours / llama.cpp |",
              "|---|---:|---:|---:|"]
    b1 = next(iter(r["ours_fp32"]))
    for mode, values in r["ours_quantized"].items():
        lines.append(f"| {mode} | {cell(values)} | {cell(r.get('llamacpp'))} | {_ratio(values, r.get('llamacpp'))} |")
    lines += speculation_markdown(r, b1)
    b = r["bound"]
    fp32 = statistics.median(r["ours_fp32"][b1]["cold"])
    lines.append(f"\nBatch-1 fp32 decode: {fp32:.1f} tok/s = {fp32 / b['bound_tok_s']:.0%} of the bound "
                 f"{b['bound_tok_s']:.1f} tok/s ({b['weight_bytes_per_token'] / 2**20:.0f} MiB of weights per token, "
                 f"GEMV read rate {b['gemv_read_gbs']:.1f} GB/s).")
    return "\n".join(lines)


def speculation_markdown(r: dict, b1: str) -> list[str]:
    """The speculation rows: ours at batch 1 with speculation off / always / auto beside llama.cpp and vLLM."""
    rows = r.get("ours_speculation")
    if not rows:
        return []
    off = rows["off"]["tok_s"]
    vllm = r.get("vllm", {}).get(b1, {}).get("cold")
    lines = ["",
             f"| batch-1 greedy decode, full-precision output ({r['speculation_model']}), tok/s | ours | / ours off "
             "| / llama.cpp Q4_1 | / vLLM CPU | outputs equal to off | drafted (accepted) |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for mode, row in rows.items():
        equal = ("reference" if mode == "off" else "yes" if row["differing_outputs"] == 0
                 else f"no: {row['differing_outputs']} of {row['outputs']} differ")
        drafted = f"{row['draft_tokens']} ({row['accepted_tokens']})" if row["built"] else "not built"
        lines.append(f"| speculation {mode} | {cell(row['tok_s'])} | {_ratio(row['tok_s'], off)} | "
                     f"{_ratio(row['tok_s'], r.get('llamacpp'))} | {_ratio(row['tok_s'], vllm)} | {equal} | "
                     f"{drafted} |")
    batched = rows.get("auto", {}).get("batched_tok_s", {})
    if batched:
        lines += ["", "| batched workload, ours, tok/s | speculation off | auto | auto / off |", "|---|---:|---:|---:|"]
        for w, t in batched.items():
            base = rows["off"].get("batched_tok_s", {}).get(w)
            lines.append(f"| {w} | {cell(base or [])} | {cell(t)} | {_ratio(t, base)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p, ("model", "num_threads"), aliases={"num_threads": ["--threads"]},
                     defaults={"model": EMBEDDED_MODEL, "num_threads": 2},
                     help_overrides={"num_threads": "torch threads of every engine, ours and the peers'"})
    p.add_argument("--vllm-python", default=None, help="python of vLLM's venv (row skipped when absent)")
    p.add_argument("--llamacpp-python", default=None,
                   help="python of llama-cpp-python's venv (row skipped when absent)")
    p.add_argument("--runs", type=int, default=3, help="cold runs per workload (prefix caches reset before each)")
    p.add_argument("--warm-runs", type=int, default=3,
                   help="runs per fp32 workload after the cold ones, prefix caches kept (0: none)")
    p.add_argument("--quantized-modes", default="static-int4,static-int8")
    p.add_argument("--speculation-model", default=DEFAULT_ENGINE_DIR,
                   help="engine directory of the speculation rows (auto needs its measured step costs; make "
                        "build-engines) (default: %(default)s)")
    p.add_argument("--speculation-modes", default="always,auto",
                   help="speculation modes run beside off at batch 1, comma-separated; empty: no speculation rows "
                        "(default: %(default)s)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    modes = [m for m in args.speculation_modes.split(",") if m]
    if any(m not in ("always", "auto") for m in modes):
        p.error(f"--speculation-modes takes always and/or auto, got {args.speculation_modes!r}")
    if modes and args.speculation_model != EMBEDDED_MODEL and not Path(args.speculation_model).exists():
        p.error(f"--speculation-model {args.speculation_model} does not exist (make build-engines), or pass "
                "--speculation-modes '' for no speculation rows")
    torch.set_num_threads(args.num_threads)
    t0 = time.perf_counter()
    engine = make_engine("off", args.num_threads, args.model)
    startup = time.perf_counter() - t0
    wl = workloads(engine.model_config.vocab_size)
    b1_name = next(iter(wl))
    fp32 = ours(engine, wl, args.runs, args.warm_runs)
    bw = gemv_read_gbs()
    wbytes = decode_weight_bytes(engine)
    result: dict = {"threads": args.num_threads, "ours_fp32": fp32, "ours_startup_s": startup,
                    "bound": {"gemv_read_gbs": bw, "weight_bytes_per_token": wbytes, "bound_tok_s": bw * 1e9 / wbytes}}
    engine.shutdown()
    result["ours_quantized"] = {}
    for mode in filter(None, args.quantized_modes.split(",")):
        qe = make_engine(mode, args.num_threads, args.model)
        result["ours_quantized"][mode] = ours(qe, {b1_name: wl[b1_name]}, args.runs)[b1_name]["cold"]
        qe.shutdown()
    if modes:
        result["speculation_model"] = args.speculation_model
        result["ours_speculation"] = speculation_rows(
            lambda spec: make_engine("off", args.num_threads, args.speculation_model, spec), wl, args.runs, modes)
    with tempfile.TemporaryDirectory(prefix="morphserve-peer-") as tmp:
        work = Path(tmp)
        if args.vllm_python:
            hf_dir = save_hf_directory(load_model(args.model), work / "hf")
            result["vllm"] = run_vllm(args.vllm_python, hf_dir, wl, args.runs, args.warm_runs, args.num_threads, work)
        if args.llamacpp_python:
            result["llamacpp"] = run_llamacpp(args.llamacpp_python, embedded_model_path(EMBEDDED_MODEL),
                                              wl[b1_name]["prompts"][0], wl[b1_name]["max_tokens"][0], args.runs,
                                              args.num_threads, work)
    return emit(result, to_markdown(result), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
