"""`make bench-aiperf`: AIPerf (NVIDIA's benchmark client) against the Triton endpoint on the same workload
as `make bench`, next to the project's own client (bench.triton), in one run.

  .venv/bin/python -m bench.aiperf --trace ../shared/data/traces/AzureLLMInferenceTrace_conv.csv \\
      --window burst:72 --time-scale 6 --length-scale 0.25 --max-input-tokens 384 --max-output-tokens 64 \\
      --max-requests 40 --device-memory 600MiB --mode default --runs 3

The workload is built exactly as bench.triton builds it (same trace options, same prompt texts) and
exported as Mooncake JSONL with a fixed schedule (``timestamp`` ms, ``text_input``, ``output_length``).
Each run starts a fresh tritonserver for the project's client (gRPC streaming, bench.triton's replay)
and another for AIPerf (``--custom-dataset-type mooncake_trace --fixed-schedule``, HTTP generate_stream:
AIPerf has no gRPC transport), both with the same parameters; output lengths are forced (ignore_eos).
Names: AIPerf's "inter_token_latency" is vLLM's TPOT, which is what bench.triton reports as TPOT.
AIPerf counts tokens by re-tokenizing the text with a tokenizer directory exported from the engine's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.triton.__main__ import build_parser as triton_parser
from bench.triton.__main__ import default_engine_dir, load_tokenizer
from bench.triton.requests import PreparedRequest, prepare_requests
from bench.triton.run import REPO_ROOT, Progress, assemble_result, run_mode, server_params
from bench.vllm_server import peer_env
from serve.config_flags import add_engine_flags
from workload.items import build_workload
from workload.repeats import cell

TEMPLATE = ('{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens|tojson }}, "ignore_eos": true, '
            '"stream": true}')
# (our summary key, AIPerf metric tag, label)
METRICS = (("ttft_s", "time_to_first_token", "TTFT"), ("tpot_s", "inter_token_latency", "TPOT (AIPerf: ITL)"),
           ("e2el_s", "request_latency", "request latency"))
STATS = ("p50", "p95", "p99", "mean")


def build_parser() -> argparse.ArgumentParser:
    p = triton_parser()
    p.prog = "python -m bench.aiperf"
    p.description = __doc__
    p.set_defaults(output_dir=Path("bench-results/aiperf"), no_quality=True, no_plots=True, num_probes=0)
    g = p.add_argument_group("aiperf")
    add_engine_flags(g, ("morph_mode",), aliases={"morph_mode": ["--mode"]}, defaults={"morph_mode": "default"},
                     help_overrides={"morph_mode": "morph mode of the server"})
    g.add_argument("--runs", type=int, default=3, help="runs, each client on a fresh server (default: %(default)s)")
    g.add_argument("--aiperf", default=str(REPO_ROOT / ".venv-aiperf" / "bin" / "aiperf"),
                   help="the aiperf executable (make bench-aiperf installs it in .venv-aiperf)")
    return p


def export_mooncake(reqs: Sequence[PreparedRequest], path: Path) -> None:
    """Mooncake JSONL with a fixed schedule: the same prompt texts and send times as the own client."""
    with path.open("w") as f:
        for r in reqs:
            f.write(json.dumps({"timestamp": round(r.scheduled_s * 1000.0, 3), "text_input": r.text,
                                "output_length": r.max_tokens}) + "\n")


def export_tokenizer(tokenizer, out: Path) -> Path:
    """A Hugging Face tokenizer directory (tokenizer.json + config) for AIPerf's token counting."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(out / "tokenizer.json"))
    eos = tokenizer.token_to_str(tokenizer.eos_token_ids[0]) if tokenizer.eos_token_ids else None
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": eos, "model_max_length": 1 << 20}))
    return out


def replay_args(trace: Path, n: int, artifacts: Path) -> list[str]:
    """The AIPerf arguments every benchmark here shares: replay ``trace`` (Mooncake format) on its fixed
    schedule, ``n`` requests, no UI, artifacts in ``artifacts``. Without AIPerf's optional server-metrics
    collector: the benchmarks scrape our metrics themselves, and on the loaded 2-core VM the collector missed
    heartbeats and turned a complete run into exit status 1."""
    return ["--input-file", str(trace), "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
            "--fixed-schedule-auto-offset", "--request-count", str(n), "--ui", "none", "--no-server-metrics",
            "--artifact-dir", str(artifacts)]


def aiperf_command(args: argparse.Namespace, url: str, trace: Path, tokenizer_dir: Path, template: Path,
                   artifacts: Path, n: int) -> list[str]:
    return [args.aiperf, "profile", "--model", "morphserve", "--tokenizer", str(tokenizer_dir),
            "--url", f"http://{url}", "--endpoint-type", "template",
            "--custom-endpoint", "/v2/models/morphserve/generate_stream", "--streaming",
            "--extra-inputs", f"payload_template:{template}", "--extra-inputs", "response_field:text_output",
            *replay_args(trace, n, artifacts)]


def parse_aiperf(path: Path) -> dict:
    """profile_export_aiperf.json -> {our key: {p50, p95, p99, mean} in seconds}, plus counts."""
    data = json.loads(path.read_text())
    metrics = data.get("records", data)
    out: dict = {}
    for key, tag, _ in METRICS:
        m = metrics.get(tag) or {}
        scale = {"ms": 1e-3, "us": 1e-6, "ns": 1e-9, "s": 1.0}.get(m.get("unit", "ms"), 1e-3)
        out[key] = {s: (m.get("avg" if s == "mean" else s) or 0.0) * scale for s in STATS}
    count = metrics.get("request_count") or {}
    out["completed"] = count.get("avg") if isinstance(count, Mapping) else count
    errors = metrics.get("error_request_count") or {}
    out["errors"] = errors.get("avg", 0) if isinstance(errors, Mapping) else errors
    return out


def aiperf_env() -> dict[str, str]:
    """The environment AIPerf runs in: ours without the Hugging Face offline switches and without the OpenMP
    defaults our package sets for the servers (a client must not spin-wait on the cores the servers use)."""
    return {k: v for k, v in peer_env().items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}


def run_aiperf(args: argparse.Namespace, reqs: Sequence[PreparedRequest], out: Path, tokenizer_dir: Path) -> dict:
    from serve.triton.client import GrpcStream  # noqa: PLC0415
    from serve.triton.server import TritonServer  # noqa: PLC0415

    trace, template = out / "trace.mooncake.jsonl", out / "payload.j2"
    export_mooncake(reqs, trace)
    template.write_text(TEMPLATE)
    params = server_params(args, args.morph_mode, max(r.max_tokens for r in reqs))
    with TritonServer(params=params, log_path=out / "server-aiperf.log", keep_log=True) as srv:
        srv.wait_ready(timeout=args.server_start_timeout)
        with contextlib.suppress(Exception), GrpcStream(srv.grpc_url) as s:
            s.generate("Warm-up request: hello", max_tokens=4, stream=True, ignore_eos=True)
        cmd = aiperf_command(args, srv.http_url, trace, tokenizer_dir, template, out / "artifacts", len(reqs))
        with (out / "aiperf.log").open("w") as log:
            subprocess.run(cmd, check=True, env=aiperf_env(), stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    found = sorted((out / "artifacts").rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"AIPerf wrote no profile_export_aiperf.json; see {out / 'aiperf.log'}")
    return {**parse_aiperf(found[-1]), "command": " ".join(shlex.quote(c) for c in cmd)}


def run_own(args: argparse.Namespace, reqs: Sequence[PreparedRequest], out: Path, num_layers: int, desc: str,
            retok: Mapping) -> dict:
    records, info = run_mode(args.morph_mode, reqs, args, out, num_layers, 16, Progress(False))
    r = assemble_result(args.morph_mode, desc, records, info, args, num_layers, 16, retok)
    return {k: r[k] for k in ("ttft_s", "tpot_s", "e2el_s", "completed", "failed", "status", "error")}


def table(runs: Sequence[Mapping]) -> str:
    """Medians over runs (min-max in brackets) of each client's percentiles, in ms."""
    lines = ["| metric | stat | own client (gRPC) ms | AIPerf (HTTP SSE) ms | AIPerf / own |",
             "|---|---|---:|---:|---:|"]
    for key, _, label in METRICS:
        for s in STATS:
            own = [r["own"][key][s] * 1e3 for r in runs if r["own"][key][s] is not None]
            aip = [r["aiperf"][key][s] * 1e3 for r in runs]
            ratios = [a / o for a, o in zip(aip, own) if o]
            lines.append(f"| {label} | {s} | {cell(own)} | {cell(aip)} | {cell(ratios, 2)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from serve.logging_setup import configure_logging  # noqa: PLC0415

    configure_logging("warning")
    if not Path(args.aiperf).exists():
        print(f"error: {args.aiperf} not found; `make bench-aiperf` installs AIPerf in .venv-aiperf", file=sys.stderr)
        return 2
    args.engine_dir = args.engine_dir or default_engine_dir()
    tokenizer, num_layers = load_tokenizer(args.engine_dir)
    items, desc = build_workload(args, tokenizer)
    reqs, retok = prepare_requests(items, tokenizer)
    out_dir: Path = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = export_tokenizer(tokenizer, out_dir / "tokenizer")
    runs = []
    for i in range(args.runs):
        run_dir = out_dir / f"run{i + 1}"
        run_dir.mkdir(exist_ok=True)
        print(f"run {i + 1}/{args.runs}: own client", file=sys.stderr, flush=True)
        own = run_own(args, reqs, run_dir, num_layers, desc, retok)
        print(f"run {i + 1}/{args.runs}: AIPerf", file=sys.stderr, flush=True)
        runs.append({"own": own, "aiperf": run_aiperf(args, reqs, run_dir, tokenizer_dir)})
        (out_dir
         / "results.json").write_text(json.dumps({"workload": desc, "mode": args.morph_mode, "runs": runs}, indent=1))
    command = "python -m bench.aiperf " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    md = (f"# AIPerf vs own client\n\n`{command}`\n\nWorkload: {desc}; mode {args.morph_mode}; {args.runs} runs; "
          f"completed own {[r['own']['completed'] for r in runs]}, AIPerf {[r['aiperf']['completed'] for r in runs]}, "
          f"AIPerf errors {[r['aiperf']['errors'] for r in runs]}.\n\n{table(runs)}\n")
    (out_dir / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
