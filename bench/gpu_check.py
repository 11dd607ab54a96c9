"""``make gpu-check``: what the CUDA path does on a real GPU, as one report.

    python -m bench.gpu_check [--out DIR] [--skip-tests] [--replay-seconds S]

1. the device (torch, CUDA, name, compute capability, memory, driver);
2. the CUDA-marked tests (tests/model/test_cuda.py: tokens vs transformers, quantized kernels, int4 layouts,
   device generators, NVML, the bf16 morphing engine with flat device memory, state preservation);
3. per-precision step cost on this GPU for a random Llama: the table the cost-aware controller reads
   (serve/model/step_costs.py's measurement, the same code `make build-engines` runs), and whole-model
   decode at batch 1 / 8 / 32 and prefill 512 per static mode, the end-to-end check of that table;
4. swap cost on this GPU (variant copy on the copy stream + in-place install) and restore;
5. a short bursty replay, morph mode off vs default at a budget where full precision runs out of KV;
6. the unified checkpoints `make build-engines` writes (hf/full, hf/levels/<level>) in TensorRT-LLM's PyTorch backend
   and vLLM, where they import, their greedy tokens against ours (bench/gpu_levels.py; "not installed" otherwise).

Random weights built in place (serve/model/random_model.py): the embedded GGUF need not be installed, and the
numbers are about the machinery, not model quality. Writes gpu-check.md and gpu-check.json to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import gpu_levels
from serve.model.random_model import make_tiny_model
from serve.morph.runtime import MorphRuntime

MODEL_SHAPE = dict(vocab_size=257, hidden_size=1024, intermediate_size=2816, num_layers=16, num_heads=16,
                   num_kv_heads=4, head_dim=64, max_position_embeddings=4096)


def device_info() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, capability=f"sm{props.major}{props.minor}",
                    total_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = None
    return info


def run_cuda_tests(repo: Path, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-s", "-m", "cuda", "-p", "no:cacheprovider",
           "tests/model/test_cuda.py"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=timeout_s)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        got = exc.stdout
        out, rc = got.decode(errors="replace") if isinstance(got, bytes) else str(got or ""), 124
    out = "\n".join(ln for ln in out.splitlines() if not ln.startswith('{"'))  # the engines' JSON logs: not the report
    lines = [ln for ln in out.splitlines() if ln.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED")) or " passed" in ln
             or " failed" in ln or "CUDA allocated" in ln]
    return {"command": " ".join(cmd[1:]), "exit_code": rc, "seconds": round(time.perf_counter() - t0, 1),
            "summary": lines[-40:], "tail": out[-6000:]}


DEVICE = "cuda"  # --dry-run-cpu switches it: the same sections on CPU with a small model, to catch errors
                 # before spending GPU time


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(0) if DEVICE == "cuda" else (9, 0)


def _engine(model, mode: str, **kw):
    from serve.config import EngineConfig  # noqa: PLC0415
    from serve.engine.engine import LLMEngine  # noqa: PLC0415

    return LLMEngine(EngineConfig(device=DEVICE, dtype="bfloat16" if DEVICE == "cuda" else None, morph_mode=mode,
                                  block_size=16,
                                  max_num_batched_tokens=kw.pop("budget", 2048), max_num_seqs=kw.pop("seqs", 64),
                                  **kw), loaded=model)


def _timed(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _ladder_precisions() -> list[str]:
    """The default ladders' precisions (int8, int4) that this GPU's kernels run (the format registry's CUDA
    capabilities: int4's tinygemm needs Ampere)."""
    from serve.model.quantized_linear import REGISTRY  # noqa: PLC0415

    return [p for p in ("int8", "int4") if _capability() >= REGISTRY[p].min_cuda_capability]


def _precisions() -> str:
    return ",".join(_ladder_precisions())


def layer_costs(model) -> dict:
    """The per-precision layer costs the cost-aware controller would read on this device: measured by
    serve/model/step_costs.py on the layers a default-mode engine serves (as builder.step_costs does)."""
    from serve.model.step_costs import measure  # noqa: PLC0415
    from serve.morph.setup import cost_inputs  # noqa: PLC0415

    e = _engine(model, "default", num_kv_blocks=64, morph_precisions=_precisions(),
                policy_overrides={"cost_aware": False})  # cost_aware would look the table up (or measure) at start
    try:
        runtime = e.resource_manager(MorphRuntime)
        assert runtime is not None
        layers, shape, head = cost_inputs(e.model, runtime.bank)
        costs = measure(layers, shape, e.model.device, e.model.dtype, head=head, repeats=5)
    finally:
        e.shutdown()
    return {"device": costs.device, "token_counts": list(costs.token_counts), "table": costs.table(),
            "ratios": {p: [round(costs.ratio(p, n), 3) for n in costs.token_counts] for p in costs.precisions}}


def step_costs(model) -> list[dict]:
    """Decode tok/s at batch 1/8/32 and prefill tok/s, the whole model at each precision (static modes)."""
    from serve.engine.sampling_params import SamplingParams  # noqa: PLC0415

    modes = [("full", "off")] + [(p, f"static-{p}") for p in _ladder_precisions()]
    rows = []
    for precision, mode in modes:
        e = _engine(model, mode, num_kv_blocks=2048)
        row: dict = {"precision": precision}
        for batch in (1, 8, 32):
            prompts = [[(b * 7 + j) % 250 + 1 for j in range(32)] for b in range(batch)]
            p = SamplingParams(max_tokens=64, ignore_eos=True)
            e.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            sec = _timed(lambda: e.generate(prompts, p))
            row[f"decode_b{batch}_tok_s"] = round(batch * 64 / sec, 1)
        long = [[(j * 5) % 250 + 1 for j in range(512)]]
        e.generate(long, SamplingParams(max_tokens=1))  # warm-up: the first 512-token prefill picks its kernels
        sec = _timed(lambda: e.generate(long, SamplingParams(max_tokens=1)))
        row["prefill_512_tok_s"] = round(512 / sec, 1)
        rows.append(row)
        e.shutdown()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def swap_costs(model) -> list[dict]:
    from policy import MorphDecision  # noqa: PLC0415

    e = _engine(model, "default", num_kv_blocks=64, morph_precisions=_precisions())
    m = e.resource_manager(MorphRuntime)
    rows = []
    for precision in sorted(m.bank.precisions):
        swap, restore = [], []
        for layer in range(4):
            _sync()
            t0 = time.perf_counter()
            m.apply_now(MorphDecision("quantize", (layer,), precision, "gpu-check"))
            _sync()
            swap.append((time.perf_counter() - t0) * 1e3)
        blocks = m.stack[-1].blocks
        for layer in reversed(range(4)):
            _sync()
            t0 = time.perf_counter()
            m.apply_now(MorphDecision("restore", (layer,), None, "gpu-check"))
            _sync()
            restore.append((time.perf_counter() - t0) * 1e3)
        rows.append({"precision": precision, "variant_mib": round(m.bank.nbytes(0, precision) / 2**20, 2),
                     "full_mib": round(m.bank.nbytes(0, "full") / 2**20, 2), "kv_blocks_gained": blocks,
                     "swap_ms_median": round(sorted(swap)[2], 3), "restore_ms_median": round(sorted(restore)[2], 3)})
    e.shutdown()
    return rows


def memory_yield(model) -> dict:
    """Yield and reclaim through the operator's control: the device's used memory (NVML, every process) before,
    while 8 layers are given back, and after they are reclaimed (on CPU: this process's resident memory)."""
    from serve.memory.budget import query_device_memory  # noqa: PLC0415
    from serve.memory.host_pages import resident_bytes  # noqa: PLC0415

    e = _engine(model, "default", num_kv_blocks=64, memory_floor="0", memory_pressure_source="none",
                policy_overrides={"cost_aware": False})

    def used() -> int:
        _sync()
        info = query_device_memory(torch.device(DEVICE))
        return info.used_bytes if info is not None else resident_bytes()

    def settle() -> None:
        for _ in range(64):
            m.before_schedule(e.scheduler)
            m.complete_ready(wait=True)

    m = e.resource_manager(MorphRuntime)
    want = 8 * m.blocks_per_layer_extent[m.config.ladder[0]] * e.ledger.slot_bytes
    before = used()
    e.request_memory_yield(want)
    settle()
    yielded = e.ledger.yielded_slots * e.ledger.slot_bytes
    during = used()
    e.request_memory_yield(None)
    settle()
    after = used()
    row = {"source": "nvml" if DEVICE == "cuda" else "VmRSS", "vmm_arena": e.memory.arena.vmm is not None,
           "asked_mib": round(want / 2**20, 1), "yielded_mib": round(yielded / 2**20, 1),
           "used_before_mib": round(before / 2**20, 1), "used_yielded_mib": round(during / 2**20, 1),
           "used_after_reclaim_mib": round(after / 2**20, 1), "drop_mib": round((before - during) / 2**20, 1),
           "back_mib": round((after - during) / 2**20, 1), "layers_after": m.quantized_by_precision()}
    e.shutdown()
    return row


def replay_modes(model, seconds: float) -> dict:
    """A bursty arrival pattern at a budget where full precision runs out of KV, off vs default."""
    import random  # noqa: PLC0415

    from workload.items import WorkItem  # noqa: PLC0415
    from workload.replay import replay  # noqa: PLC0415

    rng = random.Random(0)
    items, t = [], 0.0
    while t < seconds:
        burst = 0.5 < (t % 4.0) < 1.5
        t += rng.expovariate(60.0 if burst else 6.0)
        items.append(WorkItem(t, [rng.randrange(1, 250) for _ in range(rng.randint(200, 900))], rng.randint(32, 160)))
    out = {}
    for mode in ("off", "default"):
        e = _engine(model, mode, num_kv_blocks=180, budget=2048, seqs=64)
        r = replay(e, items, slo_ttft_s=0.5)
        out[mode] = {"requests": len(items), "completed": r.get("completed"), "ttft_s": r.get("ttft_s"),
                     "tpot_s": r.get("tpot_s"), "slo": r.get("slo"), "morph": r.get("morph")}
        e.shutdown()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return out


def to_markdown(report: dict) -> str:
    d = report["device"]
    lines = ["# make gpu-check", "", f"Device: {d.get('name')} ({d.get('capability')}, {d.get('total_gib')} GiB, "
             f"driver {d.get('driver')}), torch {d['torch']} (CUDA {d['cuda_build']}), Python {d['python']}.", ""]
    t = report.get("tests")
    if t:
        lines += [f"## CUDA tests: exit code {t['exit_code']} in {t['seconds']} s (`{t['command']}`)", "", "```",
                  *t["summary"], "```", ""]
    if report.get("layer_costs"):
        lines += ["## Layer step cost per precision: the cost-aware controller's table (serve/model/step_costs.py)", "",
                  report["layer_costs"]["table"], ""]
    if report.get("step_costs"):
        lines += ["## Whole-model decode and prefill per static mode (random 16-layer Llama, hidden 1024, bf16 "
                  "activations)", "",
                  "| precision | decode b1 tok/s | decode b8 | decode b32 | prefill 512 tok/s |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['precision']} | {r['decode_b1_tok_s']} | {r['decode_b8_tok_s']} | {r['decode_b32_tok_s']} | "
                  f"{r['prefill_512_tok_s']} |" for r in report["step_costs"]]
        lines.append("")
    if report.get("swap_costs"):
        lines += ["## Swap cost (copy stream + in-place install), medians of 4 layers", "",
                  "| precision | variant MiB | full MiB | KV blocks gained | swap ms | restore ms |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['precision']} | {r['variant_mib']} | {r['full_mib']} | {r['kv_blocks_gained']} | "
                  f"{r['swap_ms_median']} | {r['restore_ms_median']} |" for r in report["swap_costs"]]
        lines.append("")
    if report.get("memory_yield"):
        y = report["memory_yield"]
        lines += ["## Yield and reclaim (operator control, 8 layers; docs/memory-yield.md)", "",
                  f"Arena from VMM segments: {y['vmm_arena']}. Asked {y['asked_mib']} MiB, yielded {y['yielded_mib']} "
                  "MiB. "
                  f"Used memory ({y['source']}): {y['used_before_mib']} MiB before, {y['used_yielded_mib']} MiB "
                  "yielded "
                  f"(drop {y['drop_mib']} MiB), {y['used_after_reclaim_mib']} MiB after reclaim (back {y['back_mib']} "
                  "MiB); "
                  f"layers quantized after reclaim: {y['layers_after'] or 'none'}.", ""]
    if report.get("replay"):
        lines += ["## Bursty replay, off vs default (180-block base pool)", "",
                  "| mode | completed | TTFT p50 s | TTFT p95 s | TPOT mean s | SLO violations | swaps | max quantized "
                  "|",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for mode, r in report["replay"].items():
            ttft, tpot, slo, m = r["ttft_s"] or {}, r["tpot_s"] or {}, r["slo"] or {}, r["morph"] or {}
            lines.append(f"| {mode} | {r['completed']}/{r['requests']} | {ttft.get('p50')} | {ttft.get('p95')} | "
                         f"{tpot.get('mean')} | {slo.get('violation_rate')} | {m.get('swaps')} | "
                         f"{m.get('max_quantized_layers')} |")
        lines.append("")
    if report.get("levels"):
        lines += gpu_levels.to_markdown(report["levels"])
    for name, err in report.get("errors", {}).items():
        lines += [f"## {name}: FAILED", "", "```", err[-3000:], "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu-check"), help="report folder (default: %(default)s)")
    p.add_argument("--skip-tests", action="store_true", help="skip the CUDA-marked tests")
    p.add_argument("--tests-timeout", type=float, default=300.0)
    p.add_argument("--replay-seconds", type=float, default=12.0,
                   help="arrival span of the replay (default: %(default)s)")
    p.add_argument("--levels-engine-dir", type=Path, default=None,
                   help="engine directory whose unified checkpoints the peer engines load (default: a small random "
                        "model built here with three levels)")
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="run the sections on CPU with a small model (checks the script itself, no GPU numbers)")
    args = p.parse_args(argv)
    global DEVICE, MODEL_SHAPE  # noqa: PLW0603 - one switch for the whole script
    if args.dry_run_cpu:
        DEVICE = "cpu"
        MODEL_SHAPE = dict(MODEL_SHAPE, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=32)
        args.skip_tests = True
    repo = Path(__file__).resolve().parents[1]
    report: dict = {"device": device_info(), "errors": {}}
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device; nothing to check here (--dry-run-cpu checks the script)",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.skip_tests:
        report["tests"] = run_cuda_tests(repo, args.tests_timeout)
        print(f"tests: exit {report['tests']['exit_code']}", file=sys.stderr, flush=True)
        (args.out / "gpu-check-tests.log").write_text(report["tests"]["tail"])
    model = make_tiny_model(seed=11, **MODEL_SHAPE)
    for name, fn in (("layer_costs", lambda: layer_costs(model)), ("step_costs", lambda: step_costs(model)),
                     ("swap_costs", lambda: swap_costs(model)), ("memory_yield", lambda: memory_yield(model)),
                     ("replay", lambda: replay_modes(model, args.replay_seconds)),
                     ("levels", lambda: gpu_levels.level_section(args.levels_engine_dir, DEVICE))):
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as exc:  # noqa: BLE001 - report it and go on with the next section
            import traceback  # noqa: PLC0415

            report["errors"][name] = "".join(traceback.format_exception(exc))
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        (args.out / "gpu-check.json").write_text(json.dumps(report, indent=2, default=str))
        (args.out / "gpu-check.md").write_text(to_markdown(report))  # a killed run still leaves its report
    md = to_markdown(report)
    (args.out / "gpu-check.md").write_text(md)
    print(md)
    failed = report["errors"] or (report.get("tests", {}).get("exit_code", 0) not in (0,))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
