"""Capacity sweep: replay one workload at increasing arrival rates, per scheduler and morph mode.

  .venv/bin/python -m bench.capacity --rates 1,2,3 --configs fcfs:off,slai:off,slai:default --repeats 3 \\
      --trace ../shared/data/traces/AzureLLMInferenceTrace_conv.csv --window burst:72 --length-scale 0.25 \\
      --max-input-tokens 384 --max-output-tokens 64 --max-requests 30 \\
      --tbt-slo 1.5 --tight-share 0.1 --tight-tbt-slo 0.6 --json results/capacity.json --plot results/capacity.png

The workload (prompts, lengths, tiers) is built once; each rate rescales its arrival times so the mean
arrival rate is that many requests/s. Runs are interleaved (rate, repeat, then every config) so machine
noise spreads over the configs alike. Capacity of a config = the highest rate at which the median (over
repeats) of the run's median TTFT is under --ttft-target and every tier's P99 TBT (token gaps) meets its
target in the median run; as in SLAI (arXiv 2508.01002), whose target is 0.5 s on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from serve.config import SCHEDULERS, EngineConfig
from serve.config_flags import add_engine_flags, engine_kwargs
from workload import defaults
from workload.items import WorkItem, add_slo_arguments, add_trace_arguments, build_workload
from workload.repeats import span
from workload.replay import replay

ENGINE_FIELDS = ("model", "device_memory", "max_num_seqs", "max_num_batched_tokens", "num_threads", "slai_theta")
"""The EngineConfig fields the sweep's command line sets for every engine (serve/config_flags.py); the scheduler,
mode and TTFT target come from --configs and --ttft-target."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1,2,3", help="comma-separated mean arrival rates, requests/s")
    p.add_argument("--configs", default="fcfs:off,slai:off,slai:default",
                   help="comma-separated SCHEDULER:MORPH_MODE pairs (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per (config, rate); medians are reported")
    p.add_argument("--ttft-target", type=float, default=2.0,
                   help="median TTFT target in seconds (default: %(default)s)")
    add_engine_flags(p, ENGINE_FIELDS, aliases={"num_threads": ["--threads"]},
                     defaults={"model": defaults.MODEL, "device_memory": defaults.DEVICE_MEMORY, "num_threads": 1,
                               "max_num_seqs": defaults.ENGINE_DEFAULTS.max_num_seqs,
                               "max_num_batched_tokens": defaults.ENGINE_DEFAULTS.max_num_batched_tokens})
    p.add_argument("--json", type=Path, default=None, help="write every run and the capacities here")
    p.add_argument("--plot", type=Path, default=None, help="median TTFT vs rate (PNG)")
    add_trace_arguments(p)
    add_slo_arguments(p)
    return p


def parse_configs(text: str) -> list[tuple[str, str]]:
    from policy import MODES  # noqa: PLC0415

    out = []
    for item in text.split(","):
        sched, sep, mode = item.strip().partition(":")
        if not sep or sched not in SCHEDULERS or mode not in MODES:
            raise ValueError(f"--configs expects SCHEDULER:MODE with a scheduler in {list(SCHEDULERS)} and a mode in "
                             f"{sorted(MODES)}, got {item!r}")
        out.append((sched, mode))
    return out


def parse_rates(text: str) -> list[float]:
    try:
        rates = sorted(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--rates expects comma-separated numbers, got {text!r}") from None
    if not rates or rates[0] <= 0:
        raise ValueError(f"--rates must be positive, got {text!r}")
    return rates


def at_rate(items: list[WorkItem], rate: float) -> list[WorkItem]:
    """The same requests with arrival times scaled so that (n - 1) / span = rate, first arrival at 0."""
    items = sorted(items, key=lambda w: w.arrival_s)
    t0 = items[0].arrival_s
    span = items[-1].arrival_s - t0
    scale = (len(items) - 1) / (rate * span) if span > 0 else 0.0
    return [dataclasses.replace(w, arrival_s=(w.arrival_s - t0) * scale) for w in items]


def run_point(result: dict) -> dict:
    """What the sweep keeps of one replay: median TTFT and each tier's P99 TBT against its target."""
    return {"ttft_p50_s": result["ttft_s"]["p50"], "ttft_p99_s": result["ttft_s"]["p99"],
            "completed": result["completed"], "num_requests": result["num_requests"],
            "tiers": {t: {"ttft_p50_s": b["ttft_s"]["p50"], "tbt_p99_s": b["itl_s"]["p99"], "tbt_slo_s": b["tbt_slo_s"],
                          "tbt_p99_met": b["tbt_p99_met"]} for t, b in result["tiers"].items()},
            "preemptions": result["morph"]["preemptions"], "swaps": result["morph"]["swaps"],
            "critical_decodes_unscheduled": result["scheduler"]["critical_decodes_unscheduled"],
            "step_s_mean": result["scheduler"]["step_s"]["mean"]}


def summarize_config(points: dict[float, list[dict]], ttft_target: float) -> dict:
    """Per rate the median run (by median TTFT) with the spread, whether it passes, and the capacity."""
    per_rate = {}
    capacity = None
    for rate in sorted(points):
        runs = points[rate]
        ttfts = [r["ttft_p50_s"] if r["ttft_p50_s"] is not None else float("inf") for r in runs]
        median_run = sorted(runs, key=lambda r: r["ttft_p50_s"] if r["ttft_p50_s"] is not None
                            else float("inf"))[len(runs) // 2]
        tiers_ok = all(b["tbt_p99_met"] for b in median_run["tiers"].values())
        ok = (statistics.median(ttfts) < ttft_target and tiers_ok
              and median_run["completed"] == median_run["num_requests"])
        per_rate[str(rate)] = {"ttft_p50_s_median": statistics.median(ttfts), "ttft_p50_s_min": min(ttfts),
                               "ttft_p50_s_max": max(ttfts), "median_run": median_run, "pass": ok}
        if ok:
            capacity = rate
    return {"rates": per_rate, "capacity_rps": capacity}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from serve.engine.engine import LLMEngine  # noqa: PLC0415
    from serve.model.engine_dir import open_model  # noqa: PLC0415

    try:
        configs, rates = parse_configs(args.configs), parse_rates(args.rates)
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        loaded, _ = open_model(args.model)
        items, desc = build_workload(args, loaded.tokenizer)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    points: dict[str, dict[float, list[dict]]] = {f"{s}:{m}": {r: [] for r in rates} for s, m in configs}
    for rate in rates:
        work = at_rate(items, rate)
        for rep in range(args.repeats):
            for sched, mode in configs:
                cfg = EngineConfig(**engine_kwargs(args, ENGINE_FIELDS), morph_mode=mode, scheduler=sched,
                                   slo_ttft_s=args.ttft_target, seed=args.seed)
                engine = LLMEngine(cfg, loaded=loaded)
                try:
                    point = run_point(replay(engine, work, args.ttft_target))
                finally:
                    engine.shutdown()
                points[f"{sched}:{mode}"][rate].append(point)
                tiers = ", ".join(f"tier {t} P99 TBT {b['tbt_p99_s']:.3f}/{b['tbt_slo_s']}" for t, b
                                  in point["tiers"].items()
                                  if b["tbt_p99_s"] is not None)
                print(f"rate {rate} rep {rep} {sched}:{mode}: P50 TTFT {point['ttft_p50_s']:.3f} s, {tiers}, "
                      f"preemptions {point['preemptions']}, swaps {point['swaps']}", file=sys.stderr, flush=True)
    summary = {name: summarize_config(p, args.ttft_target) for name, p in points.items()}
    print(capacity_table(summary, rates))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"workload": desc, "ttft_target_s": args.ttft_target, "rates": rates,
                                         "repeats": args.repeats, "configs": summary,
                                         "runs": {n: {str(r): v for r, v in p.items()} for n, p in points.items()}},
                                        indent=2))
    if args.plot:
        from workload.plots import capacity_plot  # noqa: PLC0415

        capacity_plot(summary, args.ttft_target, args.plot)
    return 0


def capacity_table(summary: dict, rates: list[float]) -> str:
    head = "| config | " + " | ".join(f"{r:g} req/s: P50 TTFT s [min-max], tiers met" for r
                                      in rates) + " | capacity (req/s) |"
    lines = [head, "|---|" + "---|" * len(rates) + "---|"]
    for name, s in summary.items():
        cells = []
        for r in rates:
            p = s["rates"][str(r)]
            cells.append(f"{span(p['ttft_p50_s_median'], p['ttft_p50_s_min'], p['ttft_p50_s_max'], 3)}, "
                         f"{'yes' if p['pass'] else 'no'}")
        lines.append(f"| {name} | " + " | ".join(cells)
                     + f" | {s['capacity_rps'] if s['capacity_rps'] else 'below range'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
