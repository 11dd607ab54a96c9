"""AIPerf (NVIDIA's benchmark client, independent of this project) through NVIDIA Dynamo's frontend:
1 vs 2 MorphServe replicas, morph off vs default, the same per-replica memory budget, on a bursty trace.

  .venv/bin/python -m bench.dynamo_aiperf --trace ../shared/data/traces/AzureLLMInferenceTrace_conv.csv \\
      --window burst:72 --time-scale 6 --length-scale 0.25 --max-input-tokens 384 --max-output-tokens 64 \\
      --max-requests 100 --device-memory 600MiB --configs 1:off,1:default,2:off,2:default --runs 3

Per run and configuration: a fresh cluster (``serve.dynamo.cluster``), one warm-up request, then AIPerf's
chat endpoint replays the trace on its fixed schedule (prompts are real text of the trace's lengths, sent
as the user message; output lengths forced with ignore_eos) while a sampler reads every worker's
``/metrics`` (published KV capacity, swaps, requests per worker). On a machine whose cores the replicas
share, this shows what routing and per-replica KV capacity do, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.aiperf import replay_args
from serve.config_flags import add_engine_flags, engine_kwargs, flag_name
from serve.dynamo.cluster import REPO_ROOT, Cluster, ClusterConfig, free_port
from serve.dynamo.http import get_text, metric_values, post_json
from serve.model.embedded import EMBEDDED_MODEL
from workload.items import PromptBuilder, add_trace_arguments, default_text_path, trace_requests
from workload.repeats import cell

METRICS = {"ttft_s": "time_to_first_token", "itl_s": "inter_token_latency", "e2el_s": "request_latency"}
WORKER_FIELDS = ("model", "device_memory", "max_model_len", "num_threads", "slo_ttft_s")
"""The EngineConfig fields every worker of every configuration gets (serve/config_flags.py's flags, passed on)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.dynamo_aiperf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_arguments(p)
    g = p.add_argument_group("deployment")
    g.add_argument("--configs", default="1:off,1:default,2:off,2:default",
                   help="REPLICAS:MORPH_MODE[:ROUTER[:PREFIX_POLICY]] list, PREFIX_POLICY exact (default) or preserve "
                        "(--prefix-cache-across-morph of the workers) (default: %(default)s)")
    g.add_argument("--router-mode", default="least-loaded", help="default router (default: %(default)s)")
    add_engine_flags(g, WORKER_FIELDS, aliases={"num_threads": ["--worker-threads"]},
                     defaults={"model": EMBEDDED_MODEL, "device_memory": "600MiB", "max_model_len": 512,
                               "num_threads": 1,
                               "slo_ttft_s": 2.0},
                     help_suffix=" (every worker's)", help_overrides={
                         "slo_ttft_s": "TTFT SLO in seconds: the workers' controller target and the violation share"})
    g.add_argument("--runs", type=int, default=3)
    g.add_argument("--python", default=str(REPO_ROOT / ".venv-dynamo" / "bin" / "python"))
    g.add_argument("--aiperf", default=str(REPO_ROOT / ".venv-aiperf" / "bin" / "aiperf"))
    g.add_argument("--output-dir", type=Path, default=Path("bench-results/dynamo"))
    return p


def write_trace(args: argparse.Namespace, path: Path) -> tuple[int, str]:
    """AIPerf's mooncake_trace JSONL: send time (ms), the prompt text, the forced output length."""
    from serve.model.loader import load_model  # noqa: PLC0415

    tokenizer = load_model(args.model).tokenizer
    reqs, desc = trace_requests(args)
    builder = PromptBuilder(tokenizer, default_text_path().read_text(encoding="utf-8") if args.text is None
                            else Path(args.text).read_text(encoding="utf-8"))
    rng = random.Random(args.seed)
    blocks = args.prefix_block_tokens
    if blocks is not None:  # Mooncake hash_ids -> shared prompt blocks (requests sharing ids share prefixes)
        desc += f", prompts from hash_ids x {blocks} tokens"
    with path.open("w") as f:
        for r in reqs:
            ids = builder.shared_blocks_prompt(r.block_ids, blocks, args.max_input_tokens) if blocks is not None \
                else builder.prompt(r.input_tokens, rng)
            text = tokenizer.decode(ids)
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000.0, 3), "text_input": text,
                                "output_length": r.output_tokens}) + "\n")
    return len(reqs), desc


class Sampler(threading.Thread):
    """Reads every worker's /metrics twice a second: published capacity, KV used, swaps, requests."""

    NAMES = ("dynamo_component_total_blocks", "morphserve_kv_blocks_used", "morphserve_swaps_total",
             "morphserve_restores_total", "dynamo_component_requests_total", "morphserve_num_preemptions_total",
             "morphserve_prefix_cache_queries_total", "morphserve_prefix_cache_hits_total")

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.stop = threading.Event()
        self.samples: list[dict[str, Any]] = []

    def run(self) -> None:
        while not self.stop.wait(0.5):
            row: dict[str, Any] = {"t": time.monotonic()}
            for i, w in enumerate(self.cluster.workers):
                text = get_text(f"http://127.0.0.1:{w.port}/metrics", timeout=2.0) or ""
                row[i] = {n: sum(metric_values(text, n)) for n in self.NAMES}
            self.samples.append(row)

    def summary(self) -> dict[str, Any]:
        workers = range(len(self.cluster.workers))
        last = self.samples[-1] if self.samples else {}
        first = self.samples[0] if self.samples else {}
        return {
            "max_total_blocks": [max((s[i]["dynamo_component_total_blocks"] for s in self.samples), default=0) for i
                                 in workers],
            "base_total_blocks": [first.get(i, {}).get("dynamo_component_total_blocks", 0) for i in workers],
            "swaps": [last.get(i, {}).get("morphserve_swaps_total", 0) for i in workers],
            "restores": [last.get(i, {}).get("morphserve_restores_total", 0) for i in workers],
            "preemptions": [last.get(i, {}).get("morphserve_num_preemptions_total", 0) for i in workers],
            "requests": [last.get(i, {}).get("dynamo_component_requests_total", 0) - first.get(i, {}).get(
                "dynamo_component_requests_total", 0) for i in workers],
            "prefix_queried_tokens": sum(last.get(i, {}).get("morphserve_prefix_cache_queries_total", 0) - first.get(
                i, {}).get("morphserve_prefix_cache_queries_total", 0) for i in workers),
            "prefix_hit_tokens": sum(last.get(i, {}).get("morphserve_prefix_cache_hits_total", 0) - first.get(
                i, {}).get("morphserve_prefix_cache_hits_total", 0) for i in workers),
        }


def worker_flags(args: argparse.Namespace, mode: str, prefix_policy: str) -> list[str]:
    """``python -m serve.dynamo`` flags of every worker of one configuration: the shared engine flags (the model goes
    to the cluster), the configuration's morph mode and prefix-cache policy."""
    shared = {f: v for f, v in engine_kwargs(args, WORKER_FIELDS).items() if f != "model"}
    return [a for f, v in {**shared, "morph_mode": mode, "prefix_cache_across_morph": prefix_policy}.items()
            for a in (flag_name(f), str(v))]


def aiperf_command(args: argparse.Namespace, url: str, trace: Path, card: Path, artifacts: Path, n: int) -> list[str]:
    return [args.aiperf, "profile", "--model", "morphserve", "--tokenizer", str(card), "--url", url,
            "--endpoint-type", "chat", "--streaming", "--extra-inputs", "ignore_eos:true",
            *replay_args(trace, n, artifacts)]


def run_one(args: argparse.Namespace, replicas: int, mode: str, router: str, trace: Path, n: int, out: Path,
            prefix_policy: str = "exact") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    worker_args = worker_flags(args, mode, prefix_policy)
    cluster = Cluster(ClusterConfig(replicas=replicas, model=args.model, http_port=free_port(), system_port_base=0,
                                    router_mode=router, worker_args=worker_args, python=args.python,
                                    log_dir=out / "logs"))
    try:
        cluster.start()
        ready_s = cluster.wait_ready(900)
        post_json(f"{cluster.base_url}/v1/chat/completions", {"model": "morphserve", "max_tokens": 4, "messages": [
            {"role": "user", "content": "Warm-up: hello"}]}, timeout=120)
        sampler = Sampler(cluster)
        sampler.start()
        cmd = aiperf_command(args, cluster.base_url, trace, cluster.root / "card", out / "artifacts", n)
        t0 = time.monotonic()
        with (out / "aiperf.log").open("w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=3600,
                           env={k: v for k, v in os.environ.items() if not k.startswith("DYN_")})
        wall = time.monotonic() - t0
        sampler.stop.set()
        sampler.join(5)
    finally:
        cluster.close()
    found = sorted((out / "artifacts").rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"AIPerf wrote no profile_export_aiperf.json; see {out / 'aiperf.log'}")
    result = {"replicas": replicas, "mode": mode, "router": router, "prefix_policy": prefix_policy,
              "ready_s": ready_s, "aiperf_wall_s": wall,
              **parse_aiperf(found[-1], args.slo_ttft_s), "workers": sampler.summary(), "command": cmd}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return result


def parse_aiperf(path: Path, slo_ttft_s: float) -> dict:
    """profile_export_aiperf.json (+ the per-request records next to it) -> seconds and counts."""
    data = json.loads(path.read_text())
    records = data.get("records", data)
    out: dict[str, Any] = {}
    for key, tag in METRICS.items():
        m = records.get(tag) or {}
        scale = {"ms": 1e-3, "us": 1e-6, "ns": 1e-9, "s": 1.0}.get(m.get("unit", "ms"), 1e-3)
        out[key] = {s: (m.get(s) or 0.0) * scale for s in ("p50", "p95", "p99", "avg")}
    for key, tag in (("completed", "request_count"), ("errors", "error_request_count"),
                     ("throughput_rps", "request_throughput"), ("output_tok_s", "output_token_throughput")):
        v = records.get(tag) or {}
        out[key] = v.get("avg", 0) if isinstance(v, dict) else v
    ttfts = per_request_ttfts(path.parent)
    out["slo_violation_pct"] = (100.0 * sum(t > slo_ttft_s for t in ttfts) / len(ttfts)) if ttfts else None
    return out


def per_request_ttfts(folder: Path) -> list[float]:
    out = []
    for f in folder.glob("profile_export*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                m = json.loads(line).get("metrics", {}).get("time_to_first_token")
            except json.JSONDecodeError:
                continue
            if isinstance(m, dict) and m.get("value") is not None:
                out.append(m["value"] * {"ms": 1e-3, "us": 1e-6, "ns": 1e-9, "s": 1.0}.get(m.get("unit", "ms"), 1e-3))
    return out


def hit_rate(result: dict) -> float | None:
    """Prompt tokens served from the workers' prefix caches over prompt tokens looked up, in one run."""
    w = result["workers"]
    q = w.get("prefix_queried_tokens", 0)
    return w.get("prefix_hit_tokens", 0) / q if q else None


def table(results: list[dict]) -> str:
    rows = ["| replicas | morph | router | prefix cache across transitions | runs | completed/errors | prefix hit rate "
            "| P50 TTFT (s) | P95 TTFT (s) | "
            "P99 TTFT (s) | mean ITL (ms) | TTFT > SLO % | req/s | KV blocks per replica: registered -> max "
            "published | swaps | requests per replica |", "|" + "---|" * 15]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["replicas"], r["mode"], r["router"], r.get("prefix_policy", "exact")), []).append(r)
    for (n, mode, router, policy), rs in groups.items():
        med = lambda f: statistics.median(f(r) for r in rs)  # noqa: E731
        slo = [r["slo_violation_pct"] for r in rs if r["slo_violation_pct"] is not None]
        kv = "; ".join(f"{int(b)} -> {int(m)}" for b, m in zip(rs[-1]["workers"]["base_total_blocks"],
                                                               rs[-1]["workers"]["max_total_blocks"]))
        rates = [hit_rate(r) for r in rs if hit_rate(r) is not None]
        rate = cell(rates, 1, "%")
        rows.append(f"| {n} | {mode} | {router} | {policy} | {len(rs)} | {med(lambda r: r['completed']):.0f}/"
                    f"{med(lambda r: r['errors']):.0f} | {rate} | {med(lambda r: r['ttft_s']['p50']):.3f} | "
                    f"{med(lambda r: r['ttft_s']['p95']):.3f} | {med(lambda r: r['ttft_s']['p99']):.3f} | "
                    f"{1e3 * med(lambda r: r['itl_s']['avg']):.1f} | "
                    f"{statistics.median(slo) if slo else float('nan'):.1f} | {med(lambda r: r['throughput_rps']):.3f} "
                    "| "
                    f"{kv} (last run) | {[int(x) for x in rs[-1]['workers']['swaps']]} | "
                    f"{[int(x) for x in rs[-1]['workers']['requests']]} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for exe in (args.aiperf, args.python):
        if not Path(exe).exists():
            print(f"error: {exe} not found (make install-dynamo; AIPerf: a venv with `pip install aiperf`)",
                  file=sys.stderr)
            return 2
    args.output_dir.mkdir(parents=True, exist_ok=True)
    trace = args.output_dir / "trace.mooncake.jsonl"
    n, desc = write_trace(args, trace)
    configs = [c.split(":") for c in args.configs.split(",")]
    results = []
    for run in range(args.runs):  # interleaved: each run visits every configuration
        for c in configs:
            replicas, mode, router = int(c[0]), c[1], (c[2] if len(c) > 2 else args.router_mode)
            policy = c[3] if len(c) > 3 else "exact"
            out = args.output_dir / f"run{run}" / f"{replicas}x-{mode}-{router}-{policy}"
            print(f"run {run}: {replicas} x {mode} ({router}, prefix cache {policy}) ...", file=sys.stderr, flush=True)
            results.append(run_one(args, replicas, mode, router, trace, n, out, policy))
            (args.output_dir / "results.json").write_text(json.dumps(results, indent=2))
    md = f"Workload: {desc}.\n\n{table(results)}\n"
    (args.output_dir / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
