"""Benchmark the Triton endpoint: replay a trace per morph mode over gRPC streaming; latency, SLO, quality, plots.

  .venv/bin/python -m serve.bench --trace ../shared/data/traces/AzureLLMInferenceTrace_conv.csv \\
      --window burst:72 --time-scale 4 --length-scale 0.25 --device-memory 600MiB --output-dir bench-results

For each mode (--modes, default off,static-int4,accuracy,default,performance) a fresh tritonserver is
started with morph_mode set (plus the shared --device-memory, --slo-ttft, ... parameters), warmed up with
one short request, and the workload is replayed on its (scaled) arrival schedule: one thread and one gRPC
stream per in-flight request, greedy, output length forced (ignore_eos) so modes do the same work. A
fixed set of probe prompts is sent at fixed times during the run. Every request has a deadline
(--request-timeout); a server error or timeout counts the request as failed. The server's Prometheus
metrics are sampled for the timeline; its log (server-<mode>.log in the output directory) gives the
swap/restore events, hence the layer configurations it ran and the tokens it generated in each.

Metrics follow vLLM's `vllm bench serve` (serve/latency_metrics.py): TTFT is measured from the request's
scheduled send time (the client's lag behind the schedule is reported as send_lag_s), TPOT = (E2EL - TTFT)
/ (output tokens - 1), ITL = every gap between streamed chunks, goodput = requests/s meeting every SLO.

Afterwards (unless --no-quality) the quality of each mode is measured offline (serve/quality.py):
perplexity of the configurations the server ran on held-out text, weighted by the tokens generated in
each, and the agreement of the served probe outputs with a full-precision engine's greedy outputs.

Output directory: <mode>.json per mode (written even when the mode fails, and rewritten with the quality
section), results.md (tables, target checks, command), results.json (all modes), and PNG plots.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from serve.latency_metrics import RequestTiming, distribution, markdown_table, summarize
from serve.replay import time_weighted_quantized_share
from serve.workload import WorkItem, add_trace_arguments, build_workload

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODES = ("off", "static-int4", "accuracy", "default", "performance")
MORPH_EVENTS = ("swap", "restore", "kv_shrink")
PRECISION_CODE = {"full": "f", "int8": "8", "int4": "4", "fp8": "e"}


def default_engine_dir() -> str:
    """engines/smollm2-135m when built (as `make serve` does), else the embedded model."""
    built = REPO_ROOT / "engines" / "smollm2-135m"
    return str(built) if (built / "manifest.json").is_file() else "smollm2-135m"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serve.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="comma-separated morph modes, each on a fresh server (default: %(default)s)")
    p.add_argument("--output-dir", type=Path, default=Path("bench-results"),
                   help="where the per-mode JSON, results.md and the plots go (default: %(default)s)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO in seconds, also given to the server's "
                   "policy (default: %(default)s)")
    p.add_argument("--slo-tpot", type=float, default=None, help="optional TPOT SLO in seconds (goodput and violations)")
    g = p.add_argument_group("server")
    g.add_argument("--engine-dir", default=None,
                   help="engine directory or embedded model name (default: engines/smollm2-135m if built, "
                        "else smollm2-135m)")
    g.add_argument("--device-memory", default="600MiB", help="memory budget: weights + KV + reserve (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--server-threads", type=int, default=1,
                   help="torch threads in the server (1 is fastest on a shared 2-core machine; default: %(default)s)")
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
    q.add_argument("--ppl-text", type=Path, default=None, help="held-out text (default: botchan.txt if present, "
                   "else the bundled text)")
    q.add_argument("--quality-threads", type=int, default=None, help="torch threads for the offline quality engines")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    add_trace_arguments(p)
    return p


# --------------------------------------------------------------------------------------------------
# Workload -> request texts
# --------------------------------------------------------------------------------------------------


@dataclass
class PreparedRequest:
    index: int
    kind: str                # "request" | "probe"
    scheduled_s: float       # send time relative to the run's start
    text: str
    max_tokens: int
    target_prompt_tokens: int
    sent_prompt_tokens: int  # the client tokenizer's count of `text` (the server tokenizes the same way)


def prompt_text(tokenizer, ids: Sequence[int]) -> tuple[str, int]:
    """Text whose tokenization has (nearly) len(ids) tokens: decode, re-encode, trim to the target once.

    The server receives text, and decoding then re-encoding a window cut from the middle of a text can
    merge or split tokens at its edges. Returns (text, token count of the text).
    """
    target = len(ids)
    text = tokenizer.decode(ids)
    enc = tokenizer.encode(text)
    if len(enc) > target:
        text = tokenizer.decode(enc[:target])
        enc = tokenizer.encode(text)
    return text, len(enc)


def prepare_requests(items: Sequence[WorkItem], tokenizer) -> tuple[list[PreparedRequest], dict]:
    reqs = []
    for i, w in enumerate(sorted(items, key=lambda w: w.arrival_s)):
        text, n = prompt_text(tokenizer, w.prompt_ids)
        reqs.append(PreparedRequest(i, "request", w.arrival_s, text, w.output_tokens, len(w.prompt_ids), n))
    return reqs, retokenization_stats([(r.target_prompt_tokens, r.sent_prompt_tokens) for r in reqs])


def retokenization_stats(pairs: Sequence[tuple[int, int]]) -> dict:
    """How far the prompts sent as text are from the requested token counts (target, sent) pairs."""
    diffs = [s - t for t, s in pairs]
    return {"requested_tokens": sum(t for t, _ in pairs), "sent_tokens": sum(s for _, s in pairs),
            "exact": sum(1 for d in diffs if d == 0), "requests": len(diffs),
            "mean_abs_diff": float(np.mean(np.abs(diffs))) if diffs else 0.0,
            "max_abs_diff": int(max((abs(d) for d in diffs), default=0))}


def probe_schedule(num_probes: int, span_s: float) -> list[float]:
    """Fixed send times: evenly spread over the workload's arrival span, (i + 0.5) * span / n."""
    if num_probes <= 0:
        return []
    return [span_s * (i + 0.5) / num_probes for i in range(num_probes)]


def make_probes(num_probes: int, span_s: float, output_len: int, tokenizer, start_index: int) -> list[PreparedRequest]:
    from serve.quality import PROBE_PROMPTS  # noqa: PLC0415

    prompts = PROBE_PROMPTS[:num_probes]
    return [PreparedRequest(start_index + i, "probe", t, text, output_len, len(tokenizer.encode(text)),
                            len(tokenizer.encode(text)))
            for i, (t, text) in enumerate(zip(probe_schedule(len(prompts), span_s), prompts))]


# --------------------------------------------------------------------------------------------------
# One request over gRPC streaming
# --------------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """What the client saw of one request (times absolute, time.perf_counter)."""

    req: PreparedRequest
    send_s: float = 0.0          # scheduled send time (TTFT counts from here)
    actual_send_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_input_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    ok: bool = False
    error: str | None = None
    end_s: float | None = None

    def timing(self) -> RequestTiming:
        return timing_from_chunks(self.send_s, self.chunk_times_s, self.num_output_tokens, self.ok, self.error)


def timing_from_chunks(send_s: float, chunk_times: Sequence[float], num_output_tokens: int, ok: bool,
                       error: str | None = None) -> RequestTiming:
    """A RequestTiming from streamed chunk receive times (one time per chunk; TPOT uses the token count).

    Chunk times earlier than ``send_s`` (impossible unless clocks disagree) are clamped to it.
    """
    times = [max(send_s, t) for t in chunk_times]
    return RequestTiming(send_s=send_s, token_times_s=times, num_output_tokens=max(num_output_tokens, 0) if times else 0,
                         ok=ok and bool(times), error=error)


def run_request(url: str, model: str, rec: RequestRecord, timeout_s: float,
                clock: Callable[[], float] = time.perf_counter) -> None:
    """Send ``rec.req`` on its own gRPC stream and fill ``rec``; never raises, never outlives its deadline."""
    from serve.client import GrpcStream, request_inputs  # noqa: PLC0415

    deadline = rec.send_s + timeout_s
    stream = None
    try:
        stream = GrpcStream(url, model)
        stream.__enter__()
        rec.actual_send_s = clock()
        stream.send(request_inputs(rec.req.text, max_tokens=rec.req.max_tokens, stream=True, temperature=0.0,
                                   ignore_eos=True), request_id=f"{rec.req.kind}-{rec.req.index}")
        parts = []
        while True:
            remaining = deadline - clock()
            if remaining <= 0:
                raise TimeoutError(f"no final response within {timeout_s:.0f} s")
            item = next(stream.responses(timeout=remaining))
            now = clock()
            n = item.get("num_output_tokens")
            if n is not None and n > rec.num_output_tokens:
                rec.chunk_times_s.append(now)
                rec.num_output_tokens = int(n)
            if item.get("text_output"):
                parts.append(item["text_output"])
            if item.get("num_input_tokens") is not None:
                rec.num_input_tokens = int(item["num_input_tokens"])
            if item.get("finish_reason"):
                rec.finish_reason = item["finish_reason"]
            if item.get("final"):
                break
        rec.text = "".join(parts)
        rec.ok = rec.num_output_tokens > 0
        if not rec.ok:
            rec.error = "finished without tokens"
    except Exception as exc:  # noqa: BLE001 - tritonclient raises its own types; any error = failed request
        rec.ok = False
        rec.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.cancel()
    finally:
        rec.end_s = clock()
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()


# --------------------------------------------------------------------------------------------------
# Server metrics and log
# --------------------------------------------------------------------------------------------------


def metrics_sample(metrics: Mapping[str, list], block_size: int) -> dict:
    """The timeline fields from one /metrics scrape (absent series read as 0)."""
    from serve.client import metric_value  # noqa: PLC0415

    def v(name: str) -> float:
        x = metric_value(metrics, name)  # type: ignore[arg-type]
        return float(x) if x is not None else 0.0

    by_precision = {lbl.get("precision", "?"): val for lbl, val in metrics.get("morphserve_layers_quantized", [])}
    return {"quantized_layers": int(sum(by_precision.values())),
            "layers_by_precision": {k: int(x) for k, x in by_precision.items() if x},
            "kv_capacity_tokens": int(v("morphserve_kv_blocks_total")) * block_size,
            "kv_used_tokens": int(v("morphserve_kv_blocks_used")) * block_size,
            "waiting": int(v("morphserve_num_requests_waiting")),
            "running": int(v("morphserve_num_requests_running")),
            "generation_tokens": int(v("morphserve_generation_tokens_total")),
            "swaps": int(v("morphserve_swaps_total")), "restores": int(v("morphserve_restores_total"))}


def parse_morph_events(log_text: str) -> list[dict]:
    """The morph runtime's swap / restore / kv_shrink JSON lines from a server log, in log order.

    Triton's own lines and other JSON events are skipped; a truncated last line is ignored.
    """
    events = []
    for line in log_text.splitlines():
        line = line.strip()
        if not line.startswith("{") or '"event"' not in line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("event") in MORPH_EVENTS:
            events.append(rec)
    return events


def _epoch(ts: object) -> float | None:
    if not isinstance(ts, str):
        return None
    try:
        return dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def config_changes(events: Sequence[Mapping], num_layers: int,
                   tokens_at_epoch: Callable[[float], float] | None = None) -> list[tuple[int, str]]:
    """(tokens served, configuration signature after the event) per swap/restore/kv_shrink event.

    Uses the event's "config" and "tokens_served" fields when present. Without "config" the signature
    is rebuilt by applying each swap/restore (layer -> to_precision) to an all-full start; without
    "tokens_served" the count is interpolated at the event's timestamp with ``tokens_at_epoch`` (events
    it cannot place are dropped).
    """
    sig = ["f"] * num_layers
    out: list[tuple[int, str]] = []
    for e in events:
        if e.get("event") in ("swap", "restore") and isinstance(e.get("layer"), int) and 0 <= e["layer"] < num_layers:
            sig[e["layer"]] = PRECISION_CODE.get(str(e.get("to_precision")), "?")
        config = e.get("config") if isinstance(e.get("config"), str) else "".join(sig)
        sig = list(config) if len(config) == num_layers else sig
        tokens = e.get("tokens_served")
        if not isinstance(tokens, int):
            ts = _epoch(e.get("timestamp"))
            if tokens_at_epoch is None or ts is None:
                continue
            tokens = int(round(tokens_at_epoch(ts)))
        out.append((tokens, config))
    return out


def tokens_by_config(changes: Sequence[tuple[int, str]], initial: str, start_tokens: int, end_tokens: int) -> dict[str, int]:
    """Tokens generated in each configuration within [start_tokens, end_tokens).

    ``changes`` are (tokens served when the configuration changed, new configuration) in order; the
    configuration before the first change is ``initial``. Counts are clipped to the window.
    """
    out: dict[str, int] = {}
    bounds = [(0, initial), *changes]
    for k, (t_from, config) in enumerate(bounds):
        t_to = bounds[k + 1][0] if k + 1 < len(bounds) else max(end_tokens, t_from)
        lo, hi = max(t_from, start_tokens), min(t_to, end_tokens)
        if hi > lo:
            out[config] = out.get(config, 0) + (hi - lo)
    return out


def morph_summary(events: Sequence[Mapping], timeline: Sequence[Mapping], final: Mapping | None, num_layers: int,
                  duration_s: float, block_size: int) -> dict:
    """The serve.replay "morph" fields, from the server's events, sampled metrics and final scrape."""
    swaps = [e for e in events if e.get("event") == "swap"]
    restores = [e for e in events if e.get("event") == "restore"]
    counts = [sum(1 for c in str(e.get("config", "")) if c not in "f?") for e in events if e.get("config")]
    max_q = max([*counts, *(p["quantized_layers"] for p in timeline)], default=0)
    base_blocks = None
    if swaps and isinstance(swaps[0].get("kv_blocks_total"), int):
        base_blocks = swaps[0]["kv_blocks_total"] - int(swaps[0].get("blocks_added") or 0)
    kv_caps = [p["kv_capacity_tokens"] for p in timeline] + ([final["kv_capacity_tokens"]] if final else [])
    kv_caps += [int(e["kv_blocks_total"]) * block_size for e in events if isinstance(e.get("kv_blocks_total"), int)]
    base = base_blocks * block_size if base_blocks is not None else (kv_caps[0] if kv_caps else None)
    swap_ms: dict[str, list[float]] = {}
    for e in [*swaps, *restores]:
        if isinstance(e.get("time_ms"), (int, float)):
            swap_ms.setdefault(f"{e.get('from_precision')}->{e.get('to_precision')}", []).append(float(e["time_ms"]))
    return {
        "swaps": (final or {}).get("swaps", len(swaps)),
        "restores": (final or {}).get("restores", len(restores)),
        "swap_events_in_log": len(swaps), "restore_events_in_log": len(restores),
        "max_quantized_layers": max_q,
        "final_quantized_layers": (final or {}).get("quantized_layers"),
        "time_weighted_quantized_share": time_weighted_quantized_share(timeline, num_layers, duration_s),
        "kv_capacity_tokens": {"base": base, "max": max(kv_caps, default=None)},
        "mean_swap_ms": {k: round(sum(v) / len(v), 3) for k, v in swap_ms.items()},
        "preemptions": None,  # not exported by the server's metrics
    }


# --------------------------------------------------------------------------------------------------
# One mode
# --------------------------------------------------------------------------------------------------


def parse_params(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--param expects KEY=VALUE, got {pair!r}")
        out[key.strip()] = value
    return out


def server_params(args: argparse.Namespace, mode: str, max_tokens: int) -> dict[str, object]:
    params: dict[str, object] = {
        "engine_dir": args.engine_dir, "morph_mode": mode, "device_memory": args.device_memory,
        "slo_ttft_s": args.slo_ttft, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "num_threads": args.server_threads,
        "seed": args.seed, "max_tokens_limit": max(4096, max_tokens), "log_level": "info",
    }
    if args.max_model_len:
        params["max_model_len"] = args.max_model_len
    params.update(parse_params(args.param))
    return params


class Progress:
    """One status line on stderr (rewritten in place on a terminal, every 5 s otherwise)."""

    def __init__(self, enabled: bool, stream=sys.stderr) -> None:
        self.enabled = enabled
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._last = 0.0

    def update(self, line: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r" + line[:160].ljust(160))
            self.stream.flush()
        elif force or now - self._last >= 5.0:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last = now

    def done(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _all_failed(reqs: Sequence[PreparedRequest], error: str) -> list[RequestRecord]:
    return [RequestRecord(r, error=error) for r in reqs]


def run_mode(mode: str, reqs: Sequence[PreparedRequest], args: argparse.Namespace, out_dir: Path, num_layers: int,
             block_size: int, progress: Progress) -> tuple[list[RequestRecord], dict]:
    """Start a server for ``mode``, replay ``reqs`` against it, stop it. Never raises for server trouble:
    whatever went wrong is in the returned info's "error" and the affected requests are failed."""
    from serve.client import GrpcStream, scrape_metrics  # noqa: PLC0415
    from serve.triton_launcher import TritonServer  # noqa: PLC0415

    info: dict[str, Any] = {"status": "ok", "error": None, "timeline": [], "events": []}
    log_path = out_dir / f"server-{mode}.log"
    with contextlib.suppress(OSError):
        log_path.unlink()
    params = server_params(args, mode, max((r.max_tokens for r in reqs), default=16))
    info["server"] = {"params": {k: str(v) for k, v in params.items()}, "log": str(log_path)}
    records: list[RequestRecord] = []
    srv = None
    t_wall0 = time.time()
    try:
        srv = TritonServer(params=params, log_path=log_path, keep_log=True)
        srv.start()
        info["server"]["ready_after_s"] = round(srv.wait_ready(timeout=args.server_start_timeout), 3)
        for _ in range(max(0, args.warmup_requests)):
            with contextlib.suppress(Exception), GrpcStream(srv.grpc_url) as s:
                s.generate("Warm-up request: hello", timeout=min(60.0, args.request_timeout), max_tokens=4,
                           stream=True, ignore_eos=True)
        try:
            start = metrics_sample(scrape_metrics(srv.metrics_url), block_size)
        except Exception:  # noqa: BLE001
            start = None
        info["start"] = start
        lead = 0.5
        t0 = time.perf_counter() + lead
        t_wall0 = time.time() + lead
        records = [RequestRecord(r, send_s=t0 + r.scheduled_s) for r in reqs]
        stop = threading.Event()
        timeline: list[dict] = info["timeline"]
        threads: list[threading.Thread] = []
        sent = [0]

        def sampler() -> None:
            nxt = t0
            while not stop.is_set():
                now = time.perf_counter()
                if now >= nxt:
                    nxt = now + args.sample_interval
                    try:
                        s = metrics_sample(scrape_metrics(srv.metrics_url, timeout=2.0), block_size)
                        s = {"t": round(now - t0, 3), **s}
                        timeline.append(s)
                    except Exception:  # noqa: BLE001 - a dead server: keep going, the requests will fail
                        s = None
                    done = sum(1 for r in records if r.end_s is not None)
                    failed = sum(1 for r in records if r.end_s is not None and not r.ok)
                    srv_part = (f"waiting {s['waiting']:3d} running {s['running']:3d} quantized "
                                f"{s['quantized_layers']:2d}/{num_layers} kv {s['kv_used_tokens']}/"
                                f"{s['kv_capacity_tokens']} tok") if s else "metrics unavailable"
                    progress.update(f"[{mode}] t={now - t0:6.1f}s sent {sent[0]}/{len(records)} done {done} "
                                    f"failed {failed} | {srv_part}")
                stop.wait(max(0.0, min(0.05, nxt - time.perf_counter())))

        sampler_thread = threading.Thread(target=sampler, name="bench-sampler", daemon=True)
        sampler_thread.start()
        try:
            for rec in records:
                delay = rec.send_s - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                th = threading.Thread(target=run_request, args=(srv.grpc_url, srv.model_name, rec, args.request_timeout),
                                      name=f"bench-{rec.req.kind}-{rec.req.index}", daemon=True)
                th.start()
                threads.append(th)
                sent[0] += 1
            for th, rec in zip(threads, records):
                # run_request enforces the deadline itself; the margin covers a stuck close().
                th.join(timeout=max(0.0, rec.send_s + args.request_timeout + 30.0 - time.perf_counter()))
            for rec in records:
                if rec.end_s is None:  # still stuck: count it as failed now
                    rec.ok, rec.error, rec.end_s = False, "client thread did not finish", time.perf_counter()
            try:
                final = metrics_sample(scrape_metrics(srv.metrics_url), block_size)
                final["t"] = round(time.perf_counter() - t0, 3)
                timeline.append(final)
            except Exception:  # noqa: BLE001
                final = None
            info["final"] = final
        finally:
            stop.set()
            sampler_thread.join(timeout=5)
            progress.update(f"[{mode}] finished: {sum(r.ok for r in records)}/{len(records)} ok", force=True)
            progress.done()
        info["t0"] = t0
        info["t_wall0"] = t_wall0
        rc = srv.proc.poll() if srv.proc is not None else None
        if rc is not None:
            info["status"] = "error"
            info["error"] = f"tritonserver exited with code {rc} during the run: {srv.error_summary()}"
    except BaseException as exc:  # noqa: BLE001 - record, fail the requests, re-raise only interrupts
        info["status"] = "error"
        info["error"] = f"{type(exc).__name__}: {exc}".strip()[:2000]
        if not records:
            records = _all_failed(reqs, info["error"].splitlines()[0])
        else:
            for rec in records:
                if rec.end_s is None:
                    rec.ok, rec.error, rec.end_s = False, info["error"].splitlines()[0], time.perf_counter()
        if isinstance(exc, KeyboardInterrupt):
            info["interrupted"] = True
    finally:
        if srv is not None:
            with contextlib.suppress(Exception):
                info["server"]["exit_code"] = srv.stop()
        with contextlib.suppress(OSError):
            info["events"] = parse_morph_events(log_path.read_text(encoding="utf-8", errors="replace"))
        info.setdefault("t_wall0", t_wall0)
    return records, info


def assemble_result(mode: str, desc: str, records: Sequence[RequestRecord], info: Mapping, args: argparse.Namespace,
                    num_layers: int, block_size: int, retok: Mapping) -> dict:
    """The per-mode JSON (serve.replay's fields plus the server's side, the requests and the probes)."""
    reqs = [r for r in records if r.req.kind == "request"]
    probes = [r for r in records if r.req.kind == "probe"]
    t0 = info.get("t0")
    if t0 is not None and records:
        duration = max((r.end_s or t0) for r in records) - t0
        reqs_dur = max((r.end_s or t0) for r in reqs) - t0 if reqs else 0.0
    else:
        duration = reqs_dur = 0.0
    summary = summarize([r.timing() for r in reqs], max(0.0, reqs_dur), args.slo_ttft, args.slo_tpot)
    timeline = list(info.get("timeline") or [])
    events = list(info.get("events") or [])
    final = info.get("final")
    start = info.get("start")
    t_wall0 = float(info.get("t_wall0") or 0.0)
    gen_t = [p["t"] for p in timeline]
    gen_n = [p["generation_tokens"] for p in timeline]

    def tokens_at_epoch(epoch: float) -> float:
        return float(np.interp(epoch - t_wall0, gen_t, gen_n)) if gen_t else 0.0

    changes = config_changes(events, num_layers, tokens_at_epoch if gen_t else None)
    start_tokens = (start or {}).get("generation_tokens", 0)
    end_tokens = (final or {}).get("generation_tokens", timeline[-1]["generation_tokens"] if timeline else 0)
    by_config = tokens_by_config(changes, "f" * num_layers, start_tokens, end_tokens)
    lags = [r.actual_send_s - r.send_s for r in records if r.actual_send_s is not None]
    result: dict[str, Any] = {
        "mode": mode, "trace": desc, "status": info.get("status", "ok"), "error": info.get("error"),
        "benchmark": "serve.bench (Triton gRPC streaming)", "model": args.engine_dir,
        "device_memory": args.device_memory,
        **summary,
        "run_duration_s": duration,
        "send_lag_s": {**distribution(lags), "max": max(lags) if lags else None},
        "prompt_retokenization": dict(retok),
        "morph": morph_summary(events, timeline, final, num_layers, max(0.0, duration), block_size),
        "tokens_by_config": by_config,
        "generation_tokens": {"start": start_tokens, "end": end_tokens},
        "config_changes": [{"tokens_served": t, "config": c} for t, c in changes],
        "server": info.get("server"),
        "timeline": timeline,
        "requests": [_request_row(r) for r in reqs],
        "probes": [{**_request_row(r), "prompt": r.req.text, "text": r.text} for r in probes],
    }
    return result


def _request_row(r: RequestRecord) -> dict:
    t = r.timing()
    base = r.send_s
    return {"index": r.req.index, "arrival_s": round(r.req.scheduled_s, 4),
            "prompt_tokens": r.req.target_prompt_tokens, "sent_prompt_tokens": r.req.sent_prompt_tokens,
            "server_prompt_tokens": r.num_input_tokens, "max_tokens": r.req.max_tokens,
            "output_tokens": r.num_output_tokens, "ok": t.completed, "error": r.error if not t.completed else None,
            "finish_reason": r.finish_reason, "ttft_s": t.ttft_s, "e2el_s": t.e2el_s, "tpot_s": t.tpot_s,
            "end_s": (r.end_s - base) if r.end_s is not None and base else None}


def write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)


# --------------------------------------------------------------------------------------------------
# Quality (offline, after the runs)
# --------------------------------------------------------------------------------------------------


def add_quality(results: Mapping[str, dict], args: argparse.Namespace, tokenizer, num_layers: int,
                log: Callable[[str], None]) -> None:
    """Fill each result's "quality": token-weighted perplexity of the configurations it ran, probe agreement."""
    from serve.quality import (  # noqa: PLC0415
        QualityEvaluator,
        aggregate_match,
        full_signature,
        match_rates,
        quality_loss_pct,
        reference_outputs,
        weighted_perplexity,
    )

    probe_prompts = sorted({p["prompt"] for r in results.values() for p in r.get("probes", [])})
    signatures = sorted({c for r in results.values() for c, n in r.get("tokens_by_config", {}).items() if n > 0})
    if not signatures and not any(p.get("ok") for r in results.values() for p in r.get("probes", [])):
        log("quality: skipped (no mode generated tokens)")
        for r in results.values():
            r["quality"] = {"skipped": "no tokens were generated"}
        return
    refs: dict[str, list[int]] = {}
    if probe_prompts:
        log(f"quality: full-precision reference outputs for {len(probe_prompts)} probes")
        ids = reference_outputs(args.engine_dir, probe_prompts, args.probe_output_len, args.quality_threads)
        refs = dict(zip(probe_prompts, ids))
    log(f"quality: perplexity of {len(signatures) + 1} configurations on {args.ppl_tokens} held-out tokens")
    ev = QualityEvaluator(args.engine_dir, args.ppl_text, args.ppl_tokens, args.ppl_window, args.quality_threads)
    try:
        full = full_signature(ev.num_layers)
        nll_full = ev.nll(full)
        nll: dict[str, float] = {}
        for k, sig in enumerate(signatures, 1):
            t = time.perf_counter()
            try:
                nll[sig] = ev.nll(sig)
            except ValueError as exc:
                log(f"quality: skipping configuration {sig}: {exc}")
                continue
            log(f"quality: [{k}/{len(signatures)}] {sig} ppl {np.exp(nll[sig]):.3f} ({time.perf_counter() - t:.1f} s)")
        text_desc = (f"{ev.text_path.name}: first {ev.num_eval_tokens + len(ev.windows)} tokens, "
                     f"{len(ev.windows)} windows of <= {ev.window}")
        for mode, r in results.items():
            by_config = {c: n for c, n in r.get("tokens_by_config", {}).items() if n > 0 and c in nll}
            ppl = weighted_perplexity(by_config, nll)
            rows = []
            for p in r.get("probes", []):
                ref = refs.get(p["prompt"], [])
                ref_canon = tokenizer.encode(tokenizer.decode(ref))
                served = tokenizer.encode(p.get("text") or "") if p.get("ok") else []
                m = match_rates(ref_canon, served)
                rows.append({"index": p["index"], "ok": p.get("ok", False), **m})
            agg = aggregate_match(rows)
            r["quality"] = {
                "ppl_full": float(np.exp(nll_full)), "ppl": ppl,
                "ppl_loss_pct": quality_loss_pct(ppl, float(np.exp(nll_full))),
                "configs": [{"signature": c, "tokens": n, "ppl": float(np.exp(nll[c]))}
                            for c, n in sorted(by_config.items(), key=lambda kv: -kv[1])],
                "ppl_text": text_desc,
                "probe_agreement": {**agg, "per_probe": rows,
                                    "method": "both texts re-tokenized; prefix = until first mismatch, positional "
                                              "= same-position matches; rates over reference tokens"},
            }
    finally:
        ev.shutdown()


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _get(r: Mapping | None, *path: str) -> Any:
    cur: Any = r
    for k in path:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(k)
    return cur


def check_targets(results: Mapping[str, Mapping]) -> list[dict]:
    """The issue's targets, each {name, value, target, passed (None = not measurable)}."""
    out = []
    off, de, acc, s4, perf = (results.get(m) for m in ("off", "default", "accuracy", "static-int4", "performance"))
    if off is not None and de is not None:
        v_off, v_de = _get(off, "slo", "violation_rate"), _get(de, "slo", "violation_rate")
        red = None if v_off in (None, 0) or v_de is None else 1.0 - v_de / v_off
        out.append({"name": "default vs off: SLO violations reduced", "value": red, "target": ">= 90%",
                    "passed": None if red is None else red >= 0.9,
                    "detail": f"off {_pct(v_off)}, default {_pct(v_de)}"})
        p_off, p_de = _get(off, "ttft_s", "p95"), _get(de, "ttft_s", "p95")
        ratio = None if not p_off or not p_de else p_off / p_de
        out.append({"name": "default vs off: P95 TTFT improvement", "value": ratio, "target": ">= 2x",
                    "passed": None if ratio is None else ratio >= 2.0,
                    "detail": f"off {_num(p_off)} s, default {_num(p_de)} s"})
    if acc is not None and s4 is not None:
        l_acc, l_s4 = _get(acc, "quality", "ppl_loss_pct"), _get(s4, "quality", "ppl_loss_pct")
        ok = None if l_acc is None or l_s4 is None else l_acc <= 0.5 * l_s4
        out.append({"name": "accuracy quality loss <= half of static-int4's (perplexity)",
                    "value": None if l_acc is None or not l_s4 else l_acc / l_s4, "target": "<= 0.5", "passed": ok,
                    "detail": f"accuracy {_num(l_acc, 2)} %, static-int4 {_num(l_s4, 2)} %"})
    if perf is not None and de is not None:
        p_pe, p_de = _get(perf, "ttft_s", "p95"), _get(de, "ttft_s", "p95")
        ok = None if p_pe is None or p_de is None else p_pe <= p_de
        out.append({"name": "performance P95 TTFT <= default's", "value": None if not p_de or p_pe is None else p_pe / p_de,
                    "target": "<= 1", "passed": ok, "detail": f"performance {_num(p_pe)} s, default {_num(p_de)} s"})
    return out


def _num(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f} %"


_MORPH_HEADER = ("| mode | status | swaps/restores | max quantized layers | time-weighted quantized share "
                 "| KV capacity base -> max (tokens) | configs run | PPL (token-weighted) | PPL loss % "
                 "| probe match prefix / positional |")


def morph_quality_table(results: Mapping[str, Mapping]) -> str:
    lines = [_MORPH_HEADER, "|" + "---|" * _MORPH_HEADER.count(" | ") + "---|"]
    for mode, r in results.items():
        m = r.get("morph") or {}
        q = r.get("quality") or {}
        pa = q.get("probe_agreement") or {}
        kv = m.get("kv_capacity_tokens") or {}
        configs = sum(1 for n in (r.get("tokens_by_config") or {}).values() if n > 0)
        share = m.get("time_weighted_quantized_share")
        cells = [mode, str(r.get("status", "?")), f"{m.get('swaps', 'n/a')}/{m.get('restores', 'n/a')}",
                 str(m.get("max_quantized_layers", "n/a")), _pct(share),
                 f"{kv.get('base', 'n/a')} -> {kv.get('max', 'n/a')}", str(configs),
                 _num(q.get("ppl"), 3), _num(q.get("ppl_loss_pct"), 2),
                 f"{_pct(pa.get('prefix_match_rate'))} / {_pct(pa.get('positional_match_rate'))}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def results_markdown(results: Mapping[str, Mapping], args: argparse.Namespace, command: str, desc: str,
                     retok: Mapping, plots: Sequence[str]) -> str:
    targets = check_targets(results)
    lines = [
        "# MorphServe benchmark through Triton", "",
        f"- command: `{command}`",
        f"- date (UTC): {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M')}",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}; server torch threads {args.server_threads}",
        f"- model: {args.engine_dir}; device memory {args.device_memory}; max_num_seqs {args.max_num_seqs}; "
        f"max_num_batched_tokens {args.max_num_batched_tokens}",
        f"- workload: {desc}",
        f"- prompts sent as text: {retok.get('exact')}/{retok.get('requests')} re-tokenize to the requested length "
        f"(mean |diff| {retok.get('mean_abs_diff', 0):.2f}, max {retok.get('max_abs_diff')} tokens; "
        f"{retok.get('sent_tokens')} sent vs {retok.get('requested_tokens')} requested)",
        f"- SLO: TTFT <= {args.slo_ttft} s" + (f", TPOT <= {args.slo_tpot} s" if args.slo_tpot else ""),
        "- metric definitions: vLLM's (`vllm bench serve`): TTFT from the scheduled send time, TPOT = (E2EL - TTFT)"
        " / (tokens - 1), ITL = gaps between streamed chunks; failed requests count as SLO violations.",
        "",
        "## Latency", "", markdown_table(results),
        "## Morphing and quality", "", morph_quality_table(results),
        "PPL: perplexity on held-out text of the layer configurations each server ran, weighted by the tokens it "
        "generated in each (exp of the token-weighted mean NLL); PPL loss = relative increase over full precision. "
        "Probe match: served greedy outputs of fixed probe prompts vs a full-precision engine's (re-tokenized; "
        "prefix = until the first mismatch, positional = same-position tokens).", "",
        "## Targets", "",
        "| target | measured | required | result |", "|---|---|---|---|",
    ]
    for t in targets:
        res = "n/a" if t["passed"] is None else ("PASS" if t["passed"] else "MISS")
        lines.append(f"| {t['name']} | {_num(t['value'], 3)} ({t['detail']}) | {t['target']} | {res} |")
    failed_modes = [m for m, r in results.items() if r.get("status") != "ok"]
    if failed_modes:
        lines += ["", "## Errors", ""]
        lines += [f"- {m}: {str(results[m].get('error')).splitlines()[0] if results[m].get('error') else 'failed'}"
                  for m in failed_modes]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def load_tokenizer(model: str):
    """(tokenizer, number of decoder layers) of an engine directory or any model source."""
    if (Path(model) / "manifest.json").is_file():
        from serve.engine_dir import load_engine_dir  # noqa: PLC0415

        loaded = load_engine_dir(model).loaded
    else:
        from serve.model_loader import load_model  # noqa: PLC0415

        loaded = load_model(model)
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
    command = "python -m serve.bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
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
    results: dict[str, dict] = {}
    interrupted = False
    for mode in modes:
        log(f"== mode {mode}: starting tritonserver (log {out_dir / f'server-{mode}.log'})")
        records, info = run_mode(mode, all_reqs, args, out_dir, num_layers, block_size, progress)
        results[mode] = assemble_result(mode, desc, records, info, args, num_layers, block_size, retok)
        write_json(out_dir / f"{mode}.json", results[mode])
        r = results[mode]
        log(f"== mode {mode}: {r['status']}, completed {r['completed']}/{r['num_requests']}, P95 TTFT "
            f"{_num(r['ttft_s']['p95'])} s, SLO violations {_pct(r['slo']['violation_rate'])}"
            + (f"; error: {str(r['error']).splitlines()[0]}" if r.get("error") else ""))
        if info.get("interrupted"):
            interrupted = True
            break
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
            from serve.plots import make_plots  # noqa: PLC0415

            plots = make_plots(results, out_dir, slo_ttft_s=args.slo_ttft)
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


if __name__ == "__main__":
    sys.exit(main())
