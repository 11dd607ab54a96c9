"""The Triton benchmark's report: target checks, markdown tables and JSON output.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from workload.latency import markdown_table


def write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)


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
        out.append({"name": "performance P95 TTFT <= default's", "value": None if not p_de or p_pe is None else p_pe
                    / p_de,
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
        f"Python {platform.python_version()}; server torch threads {args.num_threads}",
        f"- model: {args.engine_dir}; device memory {args.device_memory}; max_num_seqs {args.max_num_seqs}; "
        f"max_num_batched_tokens {args.max_num_batched_tokens}",
        f"- workload: {desc}",
        f"- prompts sent as text: {retok.get('exact')}/{retok.get('requests')} re-tokenize to the requested length "
        f"(mean |diff| {retok.get('mean_abs_diff', 0):.2f}, max {retok.get('max_abs_diff')} tokens; "
        f"{retok.get('sent_tokens')} sent vs {retok.get('requested_tokens')} requested)",
        f"- SLO: TTFT <= {args.slo_ttft_s} s" + (f", TPOT <= {args.slo_tpot} s" if args.slo_tpot else ""),
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
