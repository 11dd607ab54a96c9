"""Plan a deployment before it exists: bench.replay's experiment on a virtual clock, at a GPU's measured speed.

  make plan PLAN_ARGS="--system a100_sxm --model llama-2-7b --trace
  ../shared/data/traces/AzureLLMInferenceTrace_conv.csv \\
      --window burst:72 --time-scale 4.75 --fixed-lengths --input-len 512 --output-len 256 \\
      --device-memory 0.9 --mode off --mode static-int4 --mode default --repeat 1 --json plan.json"

The engine loop, scheduler (fcfs or slai), block pool, arena arithmetic and morph controller are the server's
own; only the executor and the layer bank are simulated: each iteration's time comes from NVIDIA's measured
TensorRT-LLM kernel tables for ``--system`` (aiconfigurator-core) and layer copies take bytes / PCIe bandwidth,
overlapped with compute. ``--system local`` plans this machine from the engine's own measured step costs
(validation against bench.replay). Output: bench.replay's table and JSON (same keys), plus plots with --plots.
With --speculation-acceptance, self-speculative decoding is modelled (sim/speculation.py) and each mode's TPOT is
reported without and with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from policy.speculation import SpeculationConfig
from serve.engine.kv_rung import KVPrecisionRung
from serve.morph.runtime import MorphRuntime
from sim.assemble import build_engine
from sim.bank import SimLayerBank
from sim.clock import VirtualClock
from sim.executor import SimExecutor
from sim.kernel_tables import TableError, list_systems
from sim.model_specs import builtin_names
from sim.quality_levels import find_table, load_table, plan_quality, quality_table
from sim.speculation import DRAFT_PRECISIONS, ModelledSpeculation, SimSpeculation, default_draft_precision
from sim.target import Target, table_target
from workload.defaults import DEVICE_MEMORY, ENGINE_DEFAULTS
from workload.items import build_workload
from workload.replay import build_parser as replay_parser
from workload.replay import engine_config, replay, run_cli

DEFAULT_TABLE_MODEL = "llama-2-7b"
GPU_MAX_NUM_SEQS = 256
GPU_MAX_NUM_BATCHED_TOKENS = 8192
# What a GPU deployment gives the engine when nothing says otherwise: the engine's own device_memory=auto on CUDA
# (serve/memory/budget.py) is 0.9 of the device; bench.replay's 600MiB is a CPU budget for the embedded model.
GPU_DEVICE_MEMORY = "0.9"


def build_parser() -> argparse.ArgumentParser:
    p = replay_parser()
    p.prog = "python -m sim"
    p.description = __doc__
    g = p.add_argument_group("planner")
    g.add_argument("--system", default="a100_sxm",
                   help="a GPU of aiconfigurator-core's TensorRT-LLM tables (a100_sxm, h100_sxm, h200_sxm, ...; "
                        "--list-systems) or 'local' (this machine, the engine's own measured costs); default: "
                        "%(default)s")
    g.add_argument("--overhead-ms", type=float, default=1.0,
                   help="GPU systems: fixed host time per iteration (scheduling, sampling, launches) in ms (default: "
                        "%(default)s)")
    g.add_argument("--plots", type=Path, default=None, help="write the TTFT CDF and per-mode timelines (PNG) here")
    g.add_argument("--list-systems", action="store_true",
                   help="list the systems with tables and the built-in models, then exit")
    g.add_argument("--speculation-acceptance", type=float, default=None, metavar="A",
                   help="model self-speculative decoding (--speculation auto or always) on a GPU system's tables with "
                        "this acceptance rate of a draft token (0..1): each mode runs without and with it and both "
                        "TPOTs are reported (docs/planner.md); not given: speculation is not modelled (--speculation "
                        "then changes nothing in a plan)")
    g.add_argument("--speculation-k", type=int, default=SpeculationConfig.max_k, metavar="K",
                   help="the longest draft: auto picks k in 1..K by the controller's predicted gain, always drafts "
                        f"min({SpeculationConfig.always_k}, K) (default: %(default)s, the engine's)")
    g.add_argument("--speculation-rung", choices=DRAFT_PRECISIONS, default=None,
                   help="the draft precision for full-precision layers: int8 / int4 weight-only (A100's tables) or fp8 "
                        "(H100, H200, L40S); default: int8 where the tables have it, else fp8")
    g.add_argument("--quality-table", type=Path, default=None, metavar="JSON",
                   help="make quality's offline table (builder.evaluate: <engine-dir>/quality_<text>.json): the plan "
                        "states each served level's top-1 agreement with full precision from it "
                        "(sim/quality_levels.py); "
                        "default: the one in --model when that is an engine directory with one")
    for action in p._actions:  # --model means a config here (and an engine on --system local)
        if action.dest == "model":
            action.default = None
            action.help = (f"GPU systems: a built-in model ({', '.join(builtin_names())}), an HF config.json or a "
                           f"directory with one (default {DEFAULT_TABLE_MODEL}); local: an engine directory or "
                           f"embedded model name as bench.replay takes (default {ENGINE_DEFAULTS.model})")
        if action.dest in ("max_num_seqs", "max_num_batched_tokens"):
            action.default = None
            action.help = ("default: "
                           f"{GPU_MAX_NUM_SEQS if action.dest == 'max_num_seqs' else GPU_MAX_NUM_BATCHED_TOKENS} "
                           "on a GPU system (TensorRT-LLM's), the engine's own on --system local")
        if action.dest == "device_memory":
            action.default = None
            action.help = ("memory budget (weights + KV + reserve): a size, or on a GPU system a fraction of its "
                           f"memory; default: {GPU_DEVICE_MEMORY} of the GPU's memory on a GPU system (as the engine's "
                           f"device_memory=auto on CUDA), {DEVICE_MEMORY} on --system local (bench.replay's)")
    return p


class Planner:
    """One target per command (tables are read once); a fresh engine and clock for every run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: dict[str, dict] = {}  # the last run of each mode, for --plots
        if args.speculation_acceptance is not None and args.system == "local":
            raise ValueError("--speculation-acceptance models self-speculative decoding on a GPU system's tables; "
                             "on this machine run it for real: bench.replay --speculation auto")
        if args.system == "local":
            from sim.local_target import local_target  # noqa: PLC0415 - loads a real engine

            args.model = args.model or ENGINE_DEFAULTS.model
            args.max_num_seqs = args.max_num_seqs or ENGINE_DEFAULTS.max_num_seqs
            args.max_num_batched_tokens = args.max_num_batched_tokens or ENGINE_DEFAULTS.max_num_batched_tokens
            args.device_memory = args.device_memory or DEVICE_MEMORY
            self.target: Target = local_target(args)
        else:
            args.model = args.model or DEFAULT_TABLE_MODEL
            # a GPU server's batch limits, not the CPU engine's (TensorRT-LLM's defaults: 256 sequences, 8192 tokens)
            args.max_num_seqs = args.max_num_seqs or GPU_MAX_NUM_SEQS
            args.max_num_batched_tokens = args.max_num_batched_tokens or GPU_MAX_NUM_BATCHED_TOKENS
            args.device_memory = args.device_memory or GPU_DEVICE_MEMORY
            self.target = table_target(args.system, args.model, 16, args.overhead_ms / 1e3)
        self.quality_path = args.quality_table or find_table(args.model)
        self.quality = load_table(self.quality_path) if self.quality_path is not None else None
        self.speculation: ModelledSpeculation | None = None
        if args.speculation_acceptance is not None:
            self.speculation = ModelledSpeculation(args.speculation_acceptance, args.speculation_k,
                                                   args.speculation_rung
                                                   or default_draft_precision(self.target.layer_nbytes[0]))

    def modelled(self, config_speculation: str) -> ModelledSpeculation | None:
        """What the plan assumes about self-speculative decoding; None: not modelled (not asked for, or off)."""
        return None if config_speculation == "off" else self.speculation

    def run(self, args: argparse.Namespace, spec: str) -> dict:
        modelled = self.modelled(engine_config(args, spec).speculation)
        if modelled is None:
            result = self.run_one(args, spec, None)
            result["plan"]["speculation"] = {"modelled": False, "why": not_modelled(args)}
            return result
        without = self.run_one(args, spec, None, speculation="off")
        result = self.run_one(args, spec, modelled)
        result["plan"]["speculation"] = speculation_summary(modelled, result, without)
        return result

    def run_one(self, args: argparse.Namespace, spec: str, modelled: ModelledSpeculation | None,
                speculation: str | None = None) -> dict:
        clock = VirtualClock()
        config = engine_config(args, spec)
        if speculation is not None:
            config = dataclasses.replace(config, speculation=speculation)
        if args.system != "local":  # a GPU plan: slai's CUDA calibration where theta is unset (virtual clock)
            low, high = config.slai_thetas("cuda")
            config = dataclasses.replace(config, slai_theta_low=low, slai_theta_high=high)
        engine = build_engine(config, self.target, clock, modelled)
        items, desc = build_workload(args, engine.tokenizer)
        wall = time.perf_counter()
        result = {"mode": spec, "trace": desc, "device_memory": args.device_memory, "model": args.model,
                  **replay(engine, items, args.slo_ttft_s, args.slo_tpot, progress=False, sleep=clock.sleep)}
        m = engine.resource_manager(MorphRuntime)
        rung = engine.resource_manager(KVPrecisionRung)
        executor = engine.executor
        assert isinstance(executor, SimExecutor)
        result["plan"] = {
            "system": self.target.system, "device": self.target.device, "notes": self.target.notes,
            "wall_s": round(time.perf_counter() - wall, 3), "virtual_s": round(clock(), 3),
            "iterations": executor.steps, "busy_s": round(executor.busy_s, 3),
            "kv_blocks_base": engine.pool.base_blocks, "kv_block_tokens": config.block_size,
            "kv_block_bytes": self.target.slot_bytes, "memory": engine.ledger.as_dict(),
            "swap_bytes_copied": m.bank.bytes_copied if m and isinstance(m.bank, SimLayerBank) else 0,
            "kv_rung": dataclasses.asdict(rung.resource_stats()) if rung else None,
        }
        if self.quality is not None and self.quality_path is not None:
            result["plan"]["quality"] = plan_quality(self.quality, self.quality_path, result["tokens_by_config"])
        drafting = engine.resource_manager(SimSpeculation)
        if drafting is not None:
            result["plan"]["speculation_counts"] = drafting.resource_stats().as_dict()
        engine.shutdown()
        if not args.quiet:
            what = "" if modelled is None else f" with speculation modelled (acceptance {modelled.acceptance:g})"
            print(f"planned {spec}{what} on {self.target.device}: {result['plan']['virtual_s']:.1f} s of serving in "
                  f"{result['plan']['wall_s']:.1f} s", file=sys.stderr, flush=True)
        self.results[spec] = result
        return result


def not_modelled(args: argparse.Namespace) -> str:
    if args.speculation_acceptance is None:
        return ("self-speculative decoding is not modelled: give --speculation-acceptance A (and --speculation auto "
                "or always) to model it")
    return "--speculation off: the engine would not draft"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def speculation_summary(modelled: ModelledSpeculation, with_: dict, without: dict) -> dict:
    """The plan's "speculation" block: what was assumed, how often it drafted, TPOT without and with it."""
    counts = with_["plan"].get("speculation_counts", {})
    iters = counts.get("decode_iterations", 0)
    # "rung": the plan JSON's public key for the draft precision
    return {"modelled": True, "acceptance": modelled.acceptance, "k": modelled.k, "rung": modelled.precision,
            "mode": counts.get("mode"),
            "drafting_share_of_decode_iterations": round(counts.get("drafting_iterations", 0) / iters, 4) if iters
            else None,
            "tpot_ms": {"without": {k: _ms(v) for k, v in without["tpot_s"].items()},
                        "with": {k: _ms(v) for k, v in with_["tpot_s"].items()}},
            "ttft_p95_s": {"without": without["ttft_s"]["p95"], "with": with_["ttft_s"]["p95"]},
            "slo_violation_rate": {"without": without["slo"]["violation_rate"],
                                   "with": with_["slo"]["violation_rate"]}}


def speculation_table(results: dict[str, dict]) -> str:
    """Per mode: the modelled TPOT without and with self-speculative decoding (the last run of each mode)."""
    lines = ["| mode | speculation | acceptance | k | draft precision | mean TPOT without (ms) | mean TPOT with (ms) | "
             "P95 TPOT without (ms) | P95 TPOT with (ms) | drafting iterations |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for spec, r in results.items():
        s = r["plan"].get("speculation") or {}
        if not s.get("modelled"):
            continue
        t = s["tpot_ms"]
        share = s["drafting_share_of_decode_iterations"]
        lines.append(f"| {spec} | {s['mode']} | {s['acceptance']:g} | {s['k']} | {s['rung']} | {t['without']['mean']} "
                     "| "
                     f"{t['with']['mean']} | {t['without']['p95']} | {t['with']['p95']} | "
                     f"{'n/a' if share is None else f'{share:.1%}'} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quiet:  # the morph runtime's swap events are JSON log lines; a plan's JSON keeps the counts
        from serve.logging_setup import configure_logging  # noqa: PLC0415

        configure_logging("warning", force=True)
    if args.list_systems:
        print("systems:", ", ".join(list_systems() + ["local"]))
        print("built-in models:", ", ".join(builtin_names()))
        return 0
    if args.quality:
        print("error: --quality needs real weights; run bench.replay for it", file=sys.stderr)
        return 2
    try:
        planner = Planner(args)
    except (TableError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        status = run_cli(args, planner.run)
    except TableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    levels = quality_table(planner.results) if status == 0 else ""
    if levels:
        print(f"\nquality per level, offline (make quality's table {planner.quality_path}, top-1 agreement with full "
              "precision on its held-out text):\n")
        print(levels)
    table = speculation_table(planner.results) if status == 0 else ""
    if table:
        print("\nself-speculative decoding, modelled (sim/speculation.py; TPOT without: the same mode, speculation "
              "off):\n")
        print(table)
    elif status == 0 and not args.quiet:
        print(f"note: {not_modelled(args)}", file=sys.stderr)
    if args.plots is not None and planner.results:
        from workload.plots import make_plots  # noqa: PLC0415 - matplotlib only when asked

        for path in make_plots(planner.results, args.plots, args.slo_ttft_s):
            print(f"plot: {path}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
