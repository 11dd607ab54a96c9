"""Benchmark the Triton endpoint: replay a trace per morph mode over gRPC streaming; latency, SLO, quality, plots.

  .venv/bin/python -m bench.triton --trace ../shared/data/traces/AzureLLMInferenceTrace_conv.csv \\
      --window burst:72 --time-scale 4 --length-scale 0.25 --device-memory 600MiB --output-dir bench-results

For each mode (--modes, default off,static-int4,accuracy,default,performance) a fresh tritonserver is
started with morph_mode set (plus the shared --device-memory, --slo-ttft, ... parameters), warmed up with
one short request, and the workload is replayed on its (scaled) arrival schedule: one thread and one gRPC
stream per in-flight request, greedy, output length forced (ignore_eos) so modes do the same work. A
fixed set of probe prompts is sent at fixed times during the run. Every request has a deadline
(--request-timeout); a server error or timeout counts the request as failed. The server's Prometheus
metrics are sampled for the timeline; its log (server-<mode>.log in the output directory) gives the
swap/restore events, hence the layer configurations it ran and the tokens it generated in each.

Metrics follow vLLM's `vllm bench serve` (workload/latency.py): TTFT is measured from the request's
scheduled send time (the client's lag behind the schedule is reported as send_lag_s), TPOT = (E2EL - TTFT)
/ (output tokens - 1), ITL = every gap between streamed chunks, goodput = requests/s meeting every SLO.

Afterwards (unless --no-quality) the quality of each mode is measured offline (workload/quality.py):
perplexity of the configurations the server ran on held-out text, weighted by the tokens generated in
each, and the agreement of the served probe outputs with a full-precision engine's greedy outputs.

Output directory: <mode>.json per mode (written even when the mode fails, and rewritten with the quality
section), results.md (tables, target checks, command), results.json (all modes), and PNG plots.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.triton.report import _num, _pct, check_targets, results_markdown, write_json
from bench.triton.requests import make_probes, prepare_requests
from bench.triton.run import REPO_ROOT, Progress, add_quality, assemble_result, parse_params, run_mode
from serve.config_flags import add_engine_flags
from serve.model.embedded import DEFAULT_ENGINE_DIR
from workload import defaults
from workload.items import add_slo_arguments, add_trace_arguments, build_workload
from workload.repeats import repeated_table

DEFAULT_MODES = ("off", "static-int4", "accuracy", "default", "performance")
SERVER_FIELDS = ("slo_ttft_s", "device_memory", "device", "scheduler", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len", "num_threads")
"""The EngineConfig fields this benchmark sets on every mode's server (config.pbtxt parameters of the same names;
serve/config_flags.py makes the flags)."""


def default_engine_dir() -> str:
    """The embedded model's engine directory when built (as `make serve` does), else the embedded model."""
    from serve.model.engine_dir import is_engine_dir  # noqa: PLC0415 - torch only when needed

    built = REPO_ROOT / DEFAULT_ENGINE_DIR
    return str(built) if is_engine_dir(built) else defaults.MODEL


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.triton", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="comma-separated morph modes, each on a fresh server (default: %(default)s)")
    p.add_argument("--output-dir", type=Path, default=Path("bench-results"),
                   help="where the per-mode JSON, results.md and the plots go (default: %(default)s)")
    p.add_argument("--slo-tpot", type=float, default=None, help="optional TPOT SLO in seconds (goodput and violations)")
    g = p.add_argument_group("server")
    g.add_argument("--engine-dir", default=None,
                   help=f"engine directory or embedded model name (default: {DEFAULT_ENGINE_DIR} if built, "
                        f"else {defaults.MODEL})")
    add_engine_flags(g, SERVER_FIELDS, aliases={"slo_ttft_s": ["--slo-ttft"], "num_threads": ["--server-threads"]},
                     defaults={"slo_ttft_s": defaults.ENGINE_DEFAULTS.slo_ttft_s,
                               "device_memory": defaults.DEVICE_MEMORY,
                               "scheduler": defaults.ENGINE_DEFAULTS.scheduler,
                               "max_num_seqs": defaults.ENGINE_DEFAULTS.max_num_seqs,
                               "max_num_batched_tokens": defaults.ENGINE_DEFAULTS.max_num_batched_tokens,
                               "num_threads": 1},
                     help_overrides={"slo_ttft_s": "TTFT SLO in seconds: the server's policy target and the "
                                                   "benchmark's SLO",
                                     "device": "server device: cpu, cuda, cuda:N or auto (default: config.pbtxt's, "
                                               "auto)",
                                     "num_threads": "torch threads in the server (1 is fastest on a shared 2-core "
                                                    "machine)"})
    g.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="any other config.pbtxt parameter for every mode (repeatable)")
    g.add_argument("--server-start-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    g.add_argument("--request-timeout", type=float, default=300.0,
                   help="per-request deadline in seconds from its send time; later = failed (default: %(default)s)")
    g.add_argument("--warmup-requests", type=int, default=1, help="short requests before the clock starts")
    g.add_argument("--sample-interval", type=float, default=0.25, help="metrics sampling period in seconds")
    q = p.add_argument_group("quality")
    q.add_argument("--no-quality", action="store_true", help="skip perplexity and probe agreement")
    q.add_argument("--num-probes", type=int, default=8, help="probe prompts sent during each run (0 = none; max 8)")
    q.add_argument("--probe-output-len", type=int, default=32, help="tokens generated per probe")
    q.add_argument("--ppl-tokens", type=int, default=2048, help="held-out tokens for perplexity")
    q.add_argument("--ppl-window", type=int, default=512, help="perplexity window in tokens")
    q.add_argument("--ppl-text", type=Path, default=None,
                   help="held-out text (default: workload/data/botchan_excerpt.txt, "
                   "whose first tokens are the whole book's)")
    q.add_argument("--quality-threads", type=int, default=None, help="torch threads for the offline quality engines")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per mode, interleaved by mode; the median run (by P95 TTFT) is reported per mode and "
                        "repeats.md gives every figure as median [min-max] (default: %(default)s)")
    add_trace_arguments(p)
    add_slo_arguments(p)
    return p


def load_tokenizer(model: str):
    """(tokenizer, number of decoder layers) of an engine directory or any model source."""
    from serve.model.engine_dir import open_model  # noqa: PLC0415

    loaded, _ = open_model(model)
    return loaded.tokenizer, loaded.config.num_layers


def validate_modes(text: str) -> list[str]:
    from policy import MODES  # noqa: PLC0415

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad or text!r}; valid: {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"a mode is repeated in --modes {text!r}")
    return modes


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = "python -m bench.triton " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    from serve.logging_setup import configure_logging  # noqa: PLC0415

    configure_logging("warning")

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    try:
        modes = validate_modes(args.modes)
        if args.engine_dir is None:
            args.engine_dir = default_engine_dir()
        elif Path(args.engine_dir).exists():
            args.engine_dir = str(Path(args.engine_dir).resolve())
        if args.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
        if not 0 <= args.num_probes <= 8:
            raise ValueError("--num-probes must be between 0 and 8")
        parse_params(args.param)
        tokenizer, num_layers = load_tokenizer(args.engine_dir)
        items, desc = build_workload(args, tokenizer)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_dir: Path = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    reqs, retok = prepare_requests(items, tokenizer)
    span = max(r.scheduled_s for r in reqs)
    probes = make_probes(args.num_probes, span, args.probe_output_len, tokenizer, len(reqs))
    all_reqs = sorted([*reqs, *probes], key=lambda r: (r.scheduled_s, r.index))
    block_size = int(parse_params(args.param).get("block_size", 16))
    log(f"workload: {desc}; {len(reqs)} requests + {len(probes)} probes over {span:.1f} s; "
        f"prompts re-tokenize exactly for {retok['exact']}/{retok['requests']} (max |diff| {retok['max_abs_diff']})")
    progress = Progress(not args.quiet)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    interrupted = False
    for rep in range(args.repeat):
        for mode in modes:
            log(f"== mode {mode} (run {rep + 1}/{args.repeat}): starting tritonserver "
                f"(log {out_dir / f'server-{mode}.log'})")
            records, info = run_mode(mode, all_reqs, args, out_dir, num_layers, block_size, progress)
            r = assemble_result(mode, desc, records, info, args, num_layers, block_size, retok)
            runs[mode].append(r)
            write_json(out_dir / (f"{mode}.json" if args.repeat == 1 else f"{mode}-run{rep + 1}.json"), r)
            log(f"== mode {mode}: {r['status']}, completed {r['completed']}/{r['num_requests']}, P95 TTFT "
                f"{_num(r['ttft_s']['p95'])} s, SLO violations {_pct(r['slo']['violation_rate'])}"
                + (f"; error: {str(r['error']).splitlines()[0]}" if r.get("error") else ""))
            if info.get("interrupted"):
                interrupted = True
                break
        if interrupted:
            break
    results = {mode: median_run(rs) for mode, rs in runs.items() if rs}
    if args.repeat > 1:
        (out_dir / "repeats.md").write_text(f"medians of {args.repeat} runs per mode, [min-max]\n\n"
                                            + repeated_table(runs))
    if not args.no_quality and not interrupted:
        try:
            add_quality(results, args, tokenizer, num_layers, log)
        except Exception as exc:  # noqa: BLE001 - the latency results stand without it
            log(f"quality: failed: {type(exc).__name__}: {exc}")
            for r in results.values():
                r["quality"] = {"error": f"{type(exc).__name__}: {exc}"}
        for mode, r in results.items():
            write_json(out_dir / f"{mode}.json", r)
    plots: list[str] = []
    if not args.no_plots:
        try:
            from workload.plots import make_plots  # noqa: PLC0415

            plots = make_plots(results, out_dir, slo_ttft_s=args.slo_ttft_s)
        except Exception as exc:  # noqa: BLE001
            log(f"plots: failed: {type(exc).__name__}: {exc}")
    md = results_markdown(results, args, command, desc, retok, plots)
    (out_dir / "results.md").write_text(md)
    write_json(out_dir / "results.json", {"command": command, "workload": desc, "modes": list(results),
                                          "targets": check_targets(results),
                                          "results": {m: {k: v for k, v in r.items()
                                                          if k not in ("timeline", "requests")}
                                                      for m, r in results.items()}})
    print(md)
    return 130 if interrupted else (0 if all(r.get("status") == "ok" for r in results.values()) else 1)


def median_run(runs: list[dict]) -> dict:
    """The run whose P95 TTFT is the median of the mode's runs (the one the single-run report shows)."""
    def key(r: dict) -> float:
        p95 = (r.get("ttft_s") or {}).get("p95")
        return p95 if p95 is not None else float("inf")
    return sorted(runs, key=key)[(len(runs) - 1) // 2]


if __name__ == "__main__":
    sys.exit(main())
