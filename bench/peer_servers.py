"""`make bench-peer-servers`: our Triton server (morph mode off) vs vLLM's OpenAI server (CPU build, fp32),
both driven by the same independent client, AIPerf, with the same fixed-rate trace, in one run.

  .venv/bin/python -m bench.peer_servers --vllm-python PEERS/vllm-venv/bin/python \\
      --aiperf .venv-aiperf/bin/aiperf --num-requests 32 --request-rate 1.0 --runs 3

Workload: --num-requests prompts of natural text (windows of workload/data/botchan_excerpt.txt or --text, of
--min-input..--max-input tokens, seeded), request i sent at i / --request-rate seconds, every output forced
to --output-len tokens (ignore_eos; vLLM also gets min_tokens), greedy. It is exported once as Mooncake
JSONL and replayed by AIPerf with ``--fixed-schedule`` against each server:
- vLLM: ``--endpoint-type completions --streaming`` on /v1/completions, extra inputs ignore_eos, min_tokens,
  temperature 0 (bench.vllm_server starts it from an HF directory exported from our weights);
- ours: bench.aiperf.run_aiperf, i.e. a fresh tritonserver in mode off and AIPerf's template endpoint on
  the HTTP generate_stream route.
Each of --runs starts both servers afresh, one after the other (vLLM first in runs 1, 3, ..., ours first in
runs 2, 4, ...: see run_order), each with a short
warm-up request, both with --threads torch threads. Reported: medians over runs (min-max) of TTFT p50/p95
and TPOT (AIPerf's inter_token_latency) p50/mean, ours / vLLM (<= 1.0: ours is not slower) as the ratio of
the medians and as the median of each run's own ratio (the VM's speed drifts between runs), AIPerf's
completed and error counts and output token counts (AIPerf re-tokenizes the streamed text with one
tokenizer for both servers, so forced lengths show as equal totals up to re-tokenization at the edges).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.aiperf import aiperf_env, export_mooncake, export_tokenizer, parse_aiperf, replay_args, run_aiperf
from bench.aiperf import build_parser as aiperf_parser
from bench.triton.__main__ import default_engine_dir
from bench.triton.requests import PreparedRequest, prepare_requests
from bench.triton.run import REPO_ROOT
from bench.vllm_server import VllmServer
from serve.config_flags import add_engine_flags
from workload.items import PromptBuilder, WorkItem, default_text_path
from workload.repeats import cell

# (label, our summary key, stat)
ROWS = (("TTFT p50", "ttft_s", "p50"), ("TTFT p95", "ttft_s", "p95"),
        ("TPOT p50 (AIPerf ITL)", "tpot_s", "p50"), ("TPOT mean (AIPerf ITL)", "tpot_s", "mean"),
        ("request latency p50", "e2el_s", "p50"))
SERVED_NAME = "morphserve"
WARMUP_PROMPT = "Warm-up request: hello"  # the text bench.aiperf warms our server with


def fixed_rate_items(builder: PromptBuilder, n: int, rate: float, min_in: int, max_in: int, out: int,
                     seed: int = 0) -> list[WorkItem]:
    """n requests at exactly i / rate seconds, prompt lengths uniform in [min_in, max_in], output ``out``."""
    import random  # noqa: PLC0415

    if rate <= 0 or n <= 0 or not 0 < min_in <= max_in or out <= 0:
        raise ValueError("need n > 0, rate > 0, 0 < min_in <= max_in and out > 0")
    rng = random.Random(seed)
    lens = [rng.randint(min_in, max_in) for _ in range(n)]
    return [WorkItem(i / rate, builder.prompt(k, rng), out) for i, k in enumerate(lens)]


def completions_command(aiperf: str, url: str, trace: Path, tokenizer_dir: Path, artifacts: Path, n: int,
                        output_len: int, model: str = SERVED_NAME) -> list[str]:
    """AIPerf against an OpenAI /v1/completions server; the lengths are forced as on our server."""
    return [aiperf, "profile", "--model", model, "--tokenizer", str(tokenizer_dir), "--url", f"http://{url}",
            "--endpoint-type", "completions", "--streaming",
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{output_len}",
            "--extra-inputs", "temperature:0.0",
            *replay_args(trace, n, artifacts)]


def token_counts(path: Path) -> dict:
    """Totals from profile_export_aiperf.json: AIPerf's output/input token counts and, when the server
    reported usage (vLLM does), its own completion-token total."""
    data = json.loads(path.read_text())
    m = data.get("records", data)

    def total(tag: str) -> float | None:
        v = m.get(tag)
        return v.get("avg") if isinstance(v, Mapping) else v
    osl = m.get("output_sequence_length") or {}
    return {"output_tokens": total("total_output_tokens"), "input_tokens": total("total_isl"),
            "usage_output_tokens": total("total_usage_completion_tokens"),
            "osl_min": osl.get("min"), "osl_max": osl.get("max")}


def profile_json(artifacts: Path) -> Path:
    found = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"AIPerf wrote no profile_export_aiperf.json under {artifacts}")
    return found[-1]


def run_vllm(args: argparse.Namespace, hf_dir: Path, reqs: Sequence[PreparedRequest], out: Path,
             tokenizer_dir: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.mooncake.jsonl"
    export_mooncake(reqs, trace)
    with VllmServer(args.vllm_python, hf_dir, out / "vllm-server.log", threads=args.threads,
                    name=SERVED_NAME) as srv:
        startup = srv.wait_ready(timeout=args.vllm_start_timeout)
        srv.complete(WARMUP_PROMPT, 4)
        cmd = completions_command(args.aiperf, srv.url, trace, tokenizer_dir, out / "artifacts", len(reqs),
                                  args.output_len)
        with (out / "aiperf.log").open("w") as log:
            subprocess.run(cmd, check=True, env=aiperf_env(), stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    path = profile_json(out / "artifacts")
    return {**parse_aiperf(path), **token_counts(path), "startup_s": startup,
            "command": " ".join(shlex.quote(c) for c in cmd)}


def run_ours(targs: argparse.Namespace, reqs: Sequence[PreparedRequest], out: Path, tokenizer_dir: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    r = run_aiperf(targs, reqs, out, tokenizer_dir)
    return {**r, **token_counts(profile_json(out / "artifacts"))}


def table(runs: Sequence[Mapping]) -> str:
    """Medians over runs (min-max) per server in ms, the ratio of the medians ours / vLLM, and the median (min-max)
    of each run's own ratio: the two servers of a run ran minutes apart, so a VM whose speed drifts over the
    runs moves both sides of that ratio together."""
    lines = ["| metric (ms, median [min-max] over runs) | vLLM server | our server (mode off) | ours / vLLM "
             "| per-run ours / vLLM, median [min-max] |", "|---|---:|---:|---:|---:|"]
    for label, key, stat in ROWS:
        v = [r["vllm"][key][stat] * 1e3 for r in runs]
        o = [r["ours"][key][stat] * 1e3 for r in runs]
        ratio = f"{statistics.median(o) / statistics.median(v):.2f}x" if v and statistics.median(v) else "n/a"
        paired = [oo / vv for oo, vv in zip(o, v) if vv]
        lines.append(f"| {label} | {cell(v)} | {cell(o)} | {ratio} | {cell(paired, 2)} |")
    return "\n".join(lines)


def counts_line(runs: Sequence[Mapping]) -> str:
    def per(server: str, key: str) -> list:
        return [r[server].get(key) for r in runs]
    return (f"Completed: vLLM {per('vllm', 'completed')}, ours {per('ours', 'completed')}; errors: vLLM "
            f"{per('vllm', 'errors')}, ours {per('ours', 'errors')}. Output tokens counted by AIPerf: vLLM "
            f"{per('vllm', 'output_tokens')}, ours {per('ours', 'output_tokens')} (vLLM's own usage count "
            f"{per('vllm', 'usage_output_tokens')}); input tokens: vLLM {per('vllm', 'input_tokens')}, ours "
            f"{per('ours', 'input_tokens')}. vLLM startup to ready: {[round(r['vllm']['startup_s']) for r in runs]} s.")


SERVER_NAMES = {"vllm": "vLLM server", "ours": "our server"}


def run_order(i: int) -> tuple[str, str]:
    """Which server goes first in run ``i`` (0-based): vLLM in even runs, ours in odd ones. A run serves the same
    trace through both, minutes apart; alternating who goes first keeps this VM's drift from always landing on
    the same side of the ratio."""
    return ("vllm", "ours") if i % 2 == 0 else ("ours", "vllm")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.peer_servers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="python of vLLM's venv (make bench-peer makes it)")
    p.add_argument("--aiperf", default=str(REPO_ROOT / ".venv-aiperf" / "bin" / "aiperf"))
    p.add_argument("--engine-dir", default=None, help="our engine directory or embedded model (default: as make serve)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=1.0, help="requests/s, fixed spacing (default: %(default)s)")
    p.add_argument("--min-input", type=int, default=128)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads of each server (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-start-timeout", type=float, default=900.0)
    add_engine_flags(p, ("device_memory",), defaults={"device_memory": "2600MiB"}, help_overrides={
        "device_memory": "our server's memory budget: fp32 weights (~515 MiB) + ~2 GiB of KV, the KV space vLLM gets "
                         "(VLLM_CPU_KVCACHE_SPACE=2); bench.aiperf's 600MiB admits only ~5 of these sequences at once"})
    p.add_argument("--output-dir", type=Path, default=Path("bench-results/peer-servers"))
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in OUTPUT_DIR/results.json (same workload) and add runs up to --runs: "
                        "lets a 3-run measurement be taken as 3 shorter lock holds")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from serve.logging_setup import configure_logging  # noqa: PLC0415
    from serve.model.engine_dir import open_model  # noqa: PLC0415
    from serve.model.loader import save_hf_directory  # noqa: PLC0415

    configure_logging("warning")
    for exe in (args.aiperf, args.vllm_python):
        if not Path(exe).exists():
            print(f"error: {exe} not found (make bench-aiperf / make bench-peer install them)", file=sys.stderr)
            return 2
    args.engine_dir = args.engine_dir or default_engine_dir()
    out_dir: Path = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    loaded, _ = open_model(args.engine_dir)  # our weights: the tokenizer, and vLLM's HF directory
    tokenizer = loaded.tokenizer
    builder = PromptBuilder(tokenizer, default_text_path().read_text(encoding="utf-8"))
    items = fixed_rate_items(builder, args.num_requests, args.request_rate, args.min_input, args.max_input,
                             args.output_len, args.seed)
    reqs, retok = prepare_requests(items, tokenizer)
    tokenizer_dir = export_tokenizer(tokenizer, out_dir / "tokenizer")
    hf_dir = save_hf_directory(loaded, out_dir / "hf")
    del loaded
    targs = aiperf_parser().parse_args(["--engine-dir", str(args.engine_dir), "--mode", "off", "--aiperf", args.aiperf,
                                        "--server-threads", str(args.threads), "--seed", str(args.seed),
                                        "--device-memory", args.device_memory])
    desc = (f"{len(reqs)} requests at a fixed {args.request_rate} req/s, prompts {args.min_input}-{args.max_input} "
            f"tokens of {default_text_path().name} ({retok['sent_tokens']} tokens sent in all), "
            f"{args.output_len} output tokens each (forced), greedy, {args.threads} threads per server, "
            f"our server in mode off with --device-memory {args.device_memory}")
    runs: list[dict] = []
    saved = out_dir / "results.json"
    if args.resume and saved.is_file():
        old = json.loads(saved.read_text())
        if old["workload"] != desc:
            print(f"error: {saved} holds another workload: {old['workload']}", file=sys.stderr)
            return 2
        runs = old["runs"]
    for i in range(len(runs), args.runs):
        run_dir = out_dir / f"run{i + 1}"
        run: dict = {"first": run_order(i)[0]}
        for server in run_order(i):
            print(f"run {i + 1}/{args.runs}: {SERVER_NAMES[server]}", file=sys.stderr, flush=True)
            run[server] = (run_vllm(args, hf_dir, reqs, run_dir / "vllm", tokenizer_dir) if server == "vllm"
                           else run_ours(targs, reqs, run_dir / "ours", tokenizer_dir))
        runs.append(run)
        (out_dir / "results.json").write_text(json.dumps({"workload": desc, "runs": runs}, indent=1))
    command = "python -m bench.peer_servers " + " ".join(shlex.quote(a) for a
                                                         in (sys.argv[1:] if argv is None else argv))
    md = (f"# Servers under AIPerf: ours vs vLLM\n\n`{command}`\n\nWorkload: {desc}; {len(runs)} runs (each: both "
          f"servers started afresh, vLLM first in runs 1, 3, ..., ours first in runs 2, 4, ...).\n\n"
          f"{table(runs)}\n\n{counts_line(runs)}\n")
    (out_dir / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
