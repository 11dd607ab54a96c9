"""One benchmark run per mode: a fresh tritonserver, the workload replayed over gRPC streams on its schedule,
metrics sampled, the per-mode result assembled (the CLI and the whole picture: bench/triton/__main__.py).
"""


from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.triton.requests import PreparedRequest, RequestRecord, run_request
from workload import defaults
from workload.latency import by_tier, distribution, summarize
from workload.summary import config_changes, morph_summary, parse_morph_events, tokens_by_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def metrics_sample(metrics: Mapping[str, list], block_size: int) -> dict:
    """The timeline fields from one /metrics scrape (absent series read as 0)."""
    from serve.triton.client import metric_value  # noqa: PLC0415

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
        "slo_ttft_s": args.slo_ttft_s, "max_num_seqs": args.max_num_seqs, "scheduler": args.scheduler,
        "max_num_batched_tokens": args.max_num_batched_tokens, "num_threads": args.num_threads,
        "seed": args.seed, "max_tokens_limit": max(4096, max_tokens), "log_level": "info",
        "queue_timeout_s": 0,  # replays measure queueing as it is: no default queue deadline
    }
    if args.max_model_len:
        params["max_model_len"] = args.max_model_len
    if getattr(args, "device", None):
        params["device"] = args.device
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


class MetricsSampler(threading.Thread):
    """Scrapes the server's /metrics every ``interval`` seconds into ``timeline`` and updates the progress line."""

    def __init__(self, metrics_url: str, t0: float, records: Sequence[RequestRecord], interval: float, block_size: int,
                 num_layers: int, progress: Progress, mode: str, timeline: list[dict]) -> None:
        super().__init__(name="bench-sampler", daemon=True)
        self.metrics_url, self.t0, self.records, self.interval = metrics_url, t0, records, interval
        self.block_size, self.num_layers, self.progress, self.mode = block_size, num_layers, progress, mode
        self.timeline = timeline
        self.sent = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        from serve.triton.client import scrape_metrics  # noqa: PLC0415

        nxt = self.t0
        while not self._stop_event.is_set():
            now = time.perf_counter()
            if now >= nxt:
                nxt = now + self.interval
                try:
                    s = {"t": round(now - self.t0, 3),
                         **metrics_sample(scrape_metrics(self.metrics_url, timeout=2.0), self.block_size)}
                    self.timeline.append(s)
                except Exception:  # noqa: BLE001 - a dead server: keep going, the requests will fail
                    s = None
                self._report(now, s)
            self._stop_event.wait(max(0.0, min(0.05, nxt - time.perf_counter())))

    def _report(self, now: float, s: Mapping | None) -> None:
        done = sum(1 for r in self.records if r.end_s is not None)
        failed = sum(1 for r in self.records if r.end_s is not None and not r.ok)
        srv_part = (f"waiting {s['waiting']:3d} running {s['running']:3d} quantized "
                    f"{s['quantized_layers']:2d}/{self.num_layers} kv {s['kv_used_tokens']}/"
                    f"{s['kv_capacity_tokens']} tok") if s else "metrics unavailable"
        self.progress.update(f"[{self.mode}] t={now - self.t0:6.1f}s sent {self.sent}/{len(self.records)} done {done} "
                             f"failed {failed} | {srv_part}")

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


def send_and_wait(srv: Any, records: Sequence[RequestRecord], request_timeout: float, sampler: MetricsSampler) -> None:
    """Send each request at its scheduled time on a thread of its own; wait for all; fail the stuck ones."""
    threads: list[threading.Thread] = []
    for rec in records:
        delay = rec.send_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=run_request, args=(srv.grpc_url, srv.model_name, rec, request_timeout),
                              name=f"bench-{rec.req.kind}-{rec.req.index}", daemon=True)
        th.start()
        threads.append(th)
        sampler.sent += 1
    for th, rec in zip(threads, records):
        # run_request enforces the deadline itself; the margin covers a stuck close().
        th.join(timeout=max(0.0, rec.send_s + request_timeout + 30.0 - time.perf_counter()))
    for rec in records:
        if rec.end_s is None:  # still stuck: count it as failed now
            rec.ok, rec.error, rec.end_s = False, "client thread did not finish", time.perf_counter()


def run_mode(mode: str, reqs: Sequence[PreparedRequest], args: argparse.Namespace, out_dir: Path, num_layers: int,
             block_size: int, progress: Progress) -> tuple[list[RequestRecord], dict]:
    """Start a server for ``mode``, replay ``reqs`` against it, stop it. Never raises for server trouble:
    whatever went wrong is in the returned info's "error" and the affected requests are failed."""
    from serve.triton.client import GrpcStream, scrape_metrics  # noqa: PLC0415
    from serve.triton.server import TritonServer  # noqa: PLC0415

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
        sampler = MetricsSampler(srv.metrics_url, t0, records, args.sample_interval, block_size, num_layers, progress,
                                 mode, info["timeline"])
        sampler.start()
        try:
            send_and_wait(srv, records, args.request_timeout, sampler)
            try:
                final = metrics_sample(scrape_metrics(srv.metrics_url), block_size)
                final["t"] = round(time.perf_counter() - t0, 3)
                info["timeline"].append(final)
            except Exception:  # noqa: BLE001
                final = None
            info["final"] = final
        finally:
            sampler.stop()
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
    """The per-mode JSON (bench.replay's fields plus the server's side, the requests and the probes)."""
    reqs = [r for r in records if r.req.kind == "request"]
    probes = [r for r in records if r.req.kind == "probe"]
    t0 = info.get("t0")
    if t0 is not None and records:
        duration = max((r.end_s or t0) for r in records) - t0
        reqs_dur = max((r.end_s or t0) for r in reqs) - t0 if reqs else 0.0
    else:
        duration = reqs_dur = 0.0
    summary = summarize([r.timing() for r in reqs], max(0.0, reqs_dur), args.slo_ttft_s, args.slo_tpot)
    engine_defaults = defaults.ENGINE_DEFAULTS
    summary["tiers"] = by_tier(
        [r.timing() for r in reqs],
        [r.req.priority if r.req.priority is not None else engine_defaults.default_priority for r in reqs],
        [r.req.tbt_slo_s if r.req.tbt_slo_s is not None else engine_defaults.slo_tbt_s for r in reqs])
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
        "benchmark": "bench.triton.run (Triton gRPC streaming)", "model": args.engine_dir,
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


def add_quality(results: Mapping[str, dict], args: argparse.Namespace, tokenizer, num_layers: int,
                log: Callable[[str], None]) -> None:
    """Fill each result's "quality": token-weighted perplexity of the configurations it ran, probe agreement."""
    from policy.precisions import full_signature  # noqa: PLC0415
    from workload.quality import (  # noqa: PLC0415
        QualityEvaluator,
        aggregate_match,
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


def _request_row(r: RequestRecord) -> dict:
    t = r.timing()
    base = r.send_s
    return {"index": r.req.index, "arrival_s": round(r.req.scheduled_s, 4),
            "prompt_tokens": r.req.target_prompt_tokens, "sent_prompt_tokens": r.req.sent_prompt_tokens,
            "server_prompt_tokens": r.num_input_tokens, "max_tokens": r.req.max_tokens,
            "output_tokens": r.num_output_tokens, "ok": t.completed, "error": r.error if not t.completed else None,
            "finish_reason": r.finish_reason, "ttft_s": t.ttft_s, "e2el_s": t.e2el_s, "tpot_s": t.tpot_s,
            "end_s": (r.end_s - base) if r.end_s is not None and base else None}
