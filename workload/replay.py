"""An engine driven through a workload in real time, without a server: latency, SLO and morphing behaviour in one
result (``python -m bench.replay`` is its command; the planner, sim/, runs the same loop on a virtual clock).

Requests arrive in real time on the trace's (scaled) schedule; the engine runs in this thread; TTFT is
measured from each request's scheduled arrival, so it includes queueing. Output lengths are forced
(ignore_eos) so modes do the same work.

Repeated-run verdicts: ``--mode`` may be given several times and ``--repeat N`` runs each mode N times,
interleaved by mode (run 1 of every mode, then run 2, ...), and reports each figure as the median with its
spread (workload/repeats.py). A mode may carry policy overrides of its own: ``default+cost_aware=false``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from policy.precisions import full_signature
from serve.config import EngineConfig, parse_policy_overrides
from serve.config_flags import add_engine_flags, engine_kwargs
from serve.engine.sampling_params import SamplingParams
from serve.engine.slo import RequestSLO
from serve.morph.runtime import MorphRuntime
from serve.process.host_load import HostLoad
from workload import defaults
from workload.items import WorkItem, add_slo_arguments, add_trace_arguments, build_workload
from workload.latency import RequestTiming, by_tier, distribution, markdown_table, summarize
from workload.repeats import repeated_table, summarize_runs
from workload.summary import MorphSummary, time_weighted_quantized_share

ENGINE_FIELDS = ("model", "device_memory", "slo_ttft_s", "scheduler", "slai_theta", "max_num_seqs",
                 "max_num_batched_tokens", "device", "dtype", "num_threads", "prefix_cache_across_morph",
                 "kv_cache_dtype", "speculation", "quality_meter")
"""The EngineConfig fields a replay's command line sets (one engine per mode; serve/config_flags.py)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", action="append", default=None, metavar="MODE[+KEY=VALUE...]",
                   help="morph mode: off, static-int8, static-int4, accuracy, default, performance (default: default); "
                        "repeatable; +KEY=VALUE adds policy overrides for that mode only, e.g. "
                        "default+cost_aware=false, "
                        "or sets speculation / kv_cache_dtype / scheduler / quality_meter for it, e.g. "
                        "default+speculation=off, off+scheduler=slai")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per mode, interleaved by mode; figures are reported as median [min-max] (default: "
                        "%(default)s)")
    add_engine_flags(p, ENGINE_FIELDS, aliases={"slo_ttft_s": ["--slo-ttft"], "num_threads": ["--threads"]},
                     defaults={"model": defaults.MODEL, "device_memory": defaults.DEVICE_MEMORY, "device": "cpu",
                               "slo_ttft_s": defaults.ENGINE_DEFAULTS.slo_ttft_s, "num_threads": 2,
                               "scheduler": defaults.ENGINE_DEFAULTS.scheduler,
                               "max_num_seqs": defaults.ENGINE_DEFAULTS.max_num_seqs,
                               "max_num_batched_tokens": defaults.ENGINE_DEFAULTS.max_num_batched_tokens,
                               "prefix_cache_across_morph": defaults.ENGINE_DEFAULTS.prefix_cache_across_morph})
    p.add_argument("--slo-tpot", type=float, default=None, help="optional TPOT SLO in seconds")
    p.add_argument("--policy", action="append", default=[], metavar="KEY=VALUE",
                   help="override a policy threshold, e.g. --policy kv_high=0.8 (repeatable)")
    p.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--quality", action="store_true",
                   help="also measure perplexity (held-out text) of every configuration the engine ran, "
                        "weighted by the tokens it generated in each (workload/quality.py)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    add_trace_arguments(p)
    add_slo_arguments(p)
    return p



def replay(engine, items: list[WorkItem], slo_ttft_s: float, slo_tpot_s: float | None = None,
           progress: bool = False, sleep: Callable[[float], None] = time.sleep) -> dict:
    """Replay ``items`` on their schedule through ``engine`` (a real LLMEngine; the planner's runs on a
    virtual clock, so it passes ``sleep`` that advances that clock instead of waiting)."""
    clock = engine.clock
    queue = collections.deque(sorted(items, key=lambda w: w.arrival_s))
    timings: dict[str, RequestTiming] = {}
    targets: dict[str, RequestSLO] = {}
    step_s: list[float] = []
    done: set[str] = set()
    timeline: list[dict] = []
    tokens_by_config: collections.Counter = collections.Counter()
    num_layers = engine.model_config.num_layers
    morph = engine.resource_manager(MorphRuntime)
    kv_block_tokens = engine.config.block_size
    t0 = clock()
    last_sample = -1.0
    rss_after_load = resident_bytes()
    rss_max = rss_after_load

    def on_output(out) -> None:
        t = timings[out.request_id]
        now = clock()
        if out.new_token_ids:
            t.token_times_s.extend([now] * len(out.new_token_ids))
            t.num_output_tokens += len(out.new_token_ids)
        if out.finished:
            done.add(out.request_id)
            if out.error:
                t.ok, t.error = False, out.error

    while queue or engine.has_unfinished_requests():
        now = clock() - t0
        while queue and queue[0].arrival_s <= now:
            w = queue.popleft()
            rid = f"r{len(timings)}"
            timings[rid] = RequestTiming(send_s=t0 + w.arrival_s)
            cfg = engine.config
            targets[rid] = RequestSLO(tbt_s=w.tbt_slo_s, priority=w.priority).resolved(
                cfg.slo_ttft_s, cfg.slo_tbt_s, cfg.default_priority)
            try:
                engine.add_request(w.prompt_ids, SamplingParams(max_tokens=w.output_tokens, ignore_eos=True),
                                   request_id=rid, callback=on_output, arrival_time=t0 + w.arrival_s,
                                   slo=targets[rid])
            except ValueError as exc:
                timings[rid].ok, timings[rid].error = False, str(exc)
                done.add(rid)
        before = engine.num_generated_tokens
        idle = not engine.has_unfinished_requests()
        t_step = clock()
        engine.step()  # when idle this still lets the controller tick (restore when calm) between arrivals
        if engine.num_generated_tokens > before:
            step_s.append(clock() - t_step)
        if idle and queue:
            sleep(max(0.0, min(0.01, queue[0].arrival_s - (clock() - t0))))
        config = morph.config_signature() if morph is not None else full_signature(num_layers)
        tokens_by_config[config] += engine.num_generated_tokens - before
        now = clock() - t0
        if now - last_sample >= 0.1:
            last_sample = now
            s = engine.stats()
            rss_max = max(rss_max, resident_bytes())
            timeline.append({"t": round(now, 3), "quantized_layers": sum(s.layers_quantized.values()),
                             "kv_capacity_tokens": s.kv_blocks_total * kv_block_tokens,
                             "kv_used_tokens": s.kv_blocks_used * kv_block_tokens,
                             "waiting": s.num_waiting, "running": s.num_running})
            if progress:
                print(f"\r t={now:7.1f}s  done {len(done)}/{len(items)}  waiting {s.num_waiting:3d}  running "
                      f"{s.num_running:3d}  quantized {timeline[-1]['quantized_layers']:2d}/{num_layers}  "
                      f"kv {s.kv_blocks_used}/{s.kv_blocks_total}", end="", file=sys.stderr, flush=True)
    duration = clock() - t0
    if progress:
        print(file=sys.stderr)
    result = summarize(list(timings.values()), duration, slo_ttft_s, slo_tpot_s)
    rids = list(timings)
    result["tiers"] = by_tier([timings[r] for r in rids], [targets[r].priority for r in rids],  # type: ignore[misc]
                              [targets[r].tbt_s for r in rids])  # type: ignore[misc]
    result["scheduler"] = {"name": engine.config.scheduler, "step_s": distribution(step_s),
                           "critical_decodes_unscheduled": engine.stats().critical_decodes_unscheduled}
    result["morph"] = morph_summary(engine, timeline, duration, kv_block_tokens)
    result["tokens_by_config"] = dict(tokens_by_config)
    stats = engine.stats()
    queried, hit = stats.prefix_cache_queries, stats.prefix_cache_hits
    result["prefix_cache"] = {"policy": engine.config.prefix_cache_across_morph, "queried_tokens": queried,
                              "hit_tokens": hit, "hit_rate": round(hit / queried, 4) if queried else None}
    result["quality_meter"] = {"samples": stats.quality_samples_total, "agreement": stats.quality_agreement,
                               "agreement_lower": stats.quality_agreement_lower,
                               "divergence": stats.quality_divergence,
                               "seconds": round(stats.quality_meter_seconds_total, 4),
                               "tokens_quantized_layers": stats.tokens_quantized_layers_total,
                               "tokens_kv_8bit": stats.tokens_kv_8bit_total}
    result["timeline"] = timeline
    result["requests"] = [{"arrival_s": timings[r].send_s - t0, "ttft_s": timings[r].ttft_s, "ok": timings[r].completed}
                          for r in rids]  # for the TTFT CDF and timeline plots
    result["resident_mib"] = {"after_load": round(rss_after_load / 2**20, 1), "max": round(rss_max / 2**20, 1),
                              "growth": round((rss_max - rss_after_load) / 2**20, 1)}
    return result


def resident_bytes() -> int:
    """The process's resident set (Linux /proc; 0 elsewhere): what the arena makes flat after load."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def morph_summary(engine, timeline: list[dict], duration: float, block_tokens: int) -> dict:
    """The "morph" block of the result, from the in-process engine (same schema as the Triton benchmark's)."""
    m = engine.resource_manager(MorphRuntime)
    return MorphSummary(
        swaps=m.stats.swaps if m else 0,
        restores=m.stats.restores if m else 0,
        max_quantized_layers=max((p["quantized_layers"] for p in timeline), default=0),
        final_quantized_layers=m.num_quantized if m else 0,
        time_weighted_quantized_share=time_weighted_quantized_share(timeline, engine.model_config.num_layers, duration),
        kv_capacity_base_tokens=engine.pool.base_blocks * block_tokens,
        kv_capacity_max_tokens=max((p["kv_capacity_tokens"] for p in timeline), default=0),
        mean_swap_ms={k: round(sum(v) / len(v), 3) for k, v in m.stats.swap_ms.items()} if m else {},
        preemptions=engine.scheduler.num_preemptions,
    ).as_dict()


MODE_ENGINE_KEYS = ("speculation", "kv_cache_dtype", "scheduler", "quality_meter", "slai_admission")
"""Engine settings a mode spec may carry beside policy overrides (``default+speculation=off``,
``off+scheduler=slai``, ``default+quality_meter=0``), so configurations that differ in them run interleaved in one
command."""


def parse_mode(spec: str) -> tuple[str, dict]:
    """``default+cost_aware=false+kv_high=0.8`` -> ("default", {"cost_aware": False, "kv_high": 0.8}); the engine
    settings of :data:`MODE_ENGINE_KEYS` are left to :func:`mode_engine_settings`."""
    name, *pairs = spec.split("+")
    own = parse_policy_overrides(pairs)
    return name, {k: v for k, v in own.items() if k not in MODE_ENGINE_KEYS}


def mode_engine_settings(spec: str) -> dict[str, str | float]:
    """``default+speculation=off+quality_meter=0`` -> {"speculation": "off", "quality_meter": 0.0}: the engine
    settings a mode spec overrides (the meter's fraction a number, the others names)."""
    _, *pairs = spec.split("+")
    own = {k: v for k, v in parse_policy_overrides(pairs).items() if k in MODE_ENGINE_KEYS}
    return {k: float(v) if k == "quality_meter" else str(v) for k, v in own.items()}


def engine_config(args: argparse.Namespace, spec: str) -> EngineConfig:
    """The engine configuration of one mode spec (``default+kv_high=0.8``, ``default+speculation=off``) under the
    command's arguments."""
    mode, own = parse_mode(spec)
    kwargs = {**engine_kwargs(args, ENGINE_FIELDS), **mode_engine_settings(spec)}
    return EngineConfig(**kwargs, morph_mode=mode, seed=args.seed,
                        policy_overrides={**parse_policy_overrides(args.policy), **own})


def run_once(args: argparse.Namespace, spec: str) -> dict:
    """One replay of one mode on a fresh engine (the same workload for every mode: same seed, same trace)."""
    from serve.engine.engine import LLMEngine  # noqa: PLC0415

    engine = LLMEngine(engine_config(args, spec))
    try:
        items, desc = build_workload(args, engine.tokenizer)
        with HostLoad() as load:  # a run beside other work is slow for a reason that leaves with that work
            served = replay(engine, items, args.slo_ttft_s, args.slo_tpot, progress=not args.quiet)
        result = {"mode": spec, "trace": desc, "device_memory": args.device_memory, "model": args.model, **served,
                  "host_load": {"other_share": round(load.other_share, 4), "steal_share": round(load.steal_share, 4),
                                "known": load.known}}
    finally:
        engine.shutdown()
    if args.quality:
        result["quality"] = configuration_quality(args.model, result["tokens_by_config"], args.num_threads)
    return result


def run_cli(args: argparse.Namespace, run: Callable[[argparse.Namespace, str], dict]) -> int:
    """Every ``--mode`` (``--repeat`` times) through ``run``; the table on stdout, the JSON to ``--json``.
    The planner (sim/) passes its own ``run``, so a plan prints and writes what a replay does."""
    specs = args.mode or ["default"]
    try:
        if args.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
        for spec in specs:
            name, own = parse_mode(spec)
            EngineConfig(morph_mode=name, policy_overrides={**parse_policy_overrides(args.policy), **own},
                         **mode_engine_settings(spec))
        if len(specs) == 1 and args.repeat == 1:
            result = run(args, specs[0])
        else:
            return repeated(args, specs, run)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_single(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def repeated(args: argparse.Namespace, specs: list[str],
             run: Callable[[argparse.Namespace, str], dict] = run_once) -> int:
    """Every mode ``--repeat`` times, interleaved; medians and spreads of each figure."""
    runs: dict[str, list[dict]] = {spec: [] for spec in specs}
    for rep in range(args.repeat):
        for spec in specs:
            r = run(args, spec)
            runs[spec].append(r)
            m = r["morph"]
            print(f"run {rep + 1}/{args.repeat} {spec}: P50 TTFT {r['ttft_s']['p50']:.3f} s, P95 "
                  f"{r['ttft_s']['p95']:.3f} s, "
                  f"SLO violations {r['slo']['violation_rate']:.1%}, swaps {m['swaps']}, restores {m['restores']}"
                  + (f", other processes {r['host_load']['other_share']:.0%} of the CPUs" if "host_load" in r else ""),
                  file=sys.stderr, flush=True)
    print(f"medians of {args.repeat} run(s) per mode, [min-max]:\n")
    print(repeated_table(runs))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        slim = {spec: [{k: v for k, v in r.items() if k not in ("timeline", "requests")} for r in rs]
                for spec, rs in runs.items()}
        args.json.write_text(json.dumps({"modes": specs, "repeat": args.repeat, "summary": summarize_runs(runs),
                                         "runs": slim}, indent=2))
    return 0


def print_single(result: dict) -> None:
    print(markdown_table({result["mode"]: result}))
    print("\n" + tier_table(result["tiers"]))
    m = result["morph"]
    print(f"\nswaps {m['swaps']}, restores {m['restores']}, max quantized layers {m['max_quantized_layers']}, "
          f"KV capacity {m['kv_capacity_tokens']['base']} -> {m['kv_capacity_tokens']['max']} tokens, "
          f"time-weighted quantized share {m['time_weighted_quantized_share']:.1%}, preemptions {m['preemptions']}")
    pc = result.get("prefix_cache")
    if pc:
        rate = "n/a" if pc["hit_rate"] is None else f"{pc['hit_rate']:.1%}"
        print(f"prefix cache ({pc['policy']} across morph transitions): hit rate {rate} "
              f"({pc['hit_tokens']} of {pc['queried_tokens']} prompt tokens)")
    r = result["resident_mib"]
    print(f"resident memory: {r['after_load']} MiB after load, max {r['max']} MiB (+{r['growth']} MiB during the "
          "replay)")
    if "quality" in result:
        q = result["quality"]
        print(f"perplexity: full {q['perplexity_full']:.2f}, served (token-weighted) {q['perplexity']:.2f} "
              f"({q['loss_pct']:+.2f} %)")


def tier_table(tiers: dict) -> str:
    """Per tier: requests, median/P99 TTFT, P99 TBT (token gaps) against the tier's target."""
    lines = ["| tier | requests | P50 TTFT (s) | P99 TTFT (s) | P99 TBT (s) | TBT target (s) | met |",
             "|---|---|---|---|---|---|---|"]
    for tier, b in tiers.items():
        f = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {tier} | {b['completed']}/{b['num_requests']} | {f(b['ttft_s']['p50'])} | "
                     f"{f(b['ttft_s']['p99'])} "
                     f"| {f(b['itl_s']['p99'])} | {b['tbt_slo_s']} | {b['tbt_p99_met']} |")
    return "\n".join(lines) + "\n"


def configuration_quality(model: str, tokens_by_config: dict[str, int], threads: int) -> dict:
    from workload.quality import QualityEvaluator, quality_loss_pct, weighted_perplexity

    evaluator = QualityEvaluator(model, num_threads=threads)
    try:
        configs = {c: n for c, n in tokens_by_config.items() if n > 0}
        full = full_signature(len(next(iter(tokens_by_config))))
        nll = {c: evaluator.nll(c) for c in set(configs) | {full}}
        ppl = weighted_perplexity(configs, nll)
        ppl_full = evaluator.perplexity(full)
        return {"perplexity": ppl, "perplexity_full": ppl_full, "loss_pct": quality_loss_pct(ppl, ppl_full),
                "perplexity_by_config": {c: evaluator.perplexity(c) for c in configs}}
    finally:
        evaluator.shutdown()

