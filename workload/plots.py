"""Benchmark plots (matplotlib, Agg backend, PNG): TTFT CDF per mode, a timeline per mode, P95 TTFT vs quality.

Input: ``{mode: result}`` as bench.triton.run writes them (<mode>.json): "requests" (per-request ttft_s, ok,
arrival_s), "timeline" (t, waiting, running, quantized_layers, kv_capacity_tokens, kv_used_tokens),
"ttft_s" {p95}, "quality" {ppl_loss_pct, probe_agreement}.

  .venv/bin/python -m workload.plots bench-results     # re-draw from the JSON files in a directory
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODE_COLORS = {"off": "#444444", "static-int8": "#9467bd", "static-int4": "#d62728", "accuracy": "#2ca02c",
               "default": "#1f77b4", "performance": "#ff7f0e"}


def _color(mode: str) -> str:
    return MODE_COLORS.get(mode, "#17becf")


def ttft_cdf_points(requests: Sequence[Mapping]) -> tuple[list[float], list[float]]:
    """Sorted TTFTs of completed requests and their cumulative share of ALL requests (failed ones never
    arrive, so the curve ends below 1 when some failed)."""
    ttfts = sorted(float(r["ttft_s"]) for r in requests if r.get("ok") and r.get("ttft_s") is not None)
    n = len(requests)
    return ttfts, [(i + 1) / n for i in range(len(ttfts))]


def plot_ttft_cdf(results: Mapping[str, Mapping], path: Path, slo_ttft_s: float | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, r in results.items():
        xs, ys = ttft_cdf_points(r.get("requests") or [])
        if xs:
            ax.step([0.0, *xs], [0.0, *ys], where="post", label=mode, color=_color(mode))
    if slo_ttft_s:
        ax.axvline(slo_ttft_s, color="k", ls="--", lw=1, label=f"SLO {slo_ttft_s:g} s")
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlim(left=0)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title("TTFT CDF per mode (failed requests never reach the curve)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(mode: str, r: Mapping, path: Path, bin_s: float = 1.0) -> Path:
    tl = r.get("timeline") or []
    reqs = r.get("requests") or []
    fig, axes = plt.subplots(4, 1, figsize=(8, 8), sharex=True)
    arrivals = [float(q["arrival_s"]) for q in reqs]
    if arrivals:
        end = max(max(arrivals), max((p["t"] for p in tl), default=0.0))
        nbins = max(1, int(end / bin_s) + 1)
        axes[0].hist(arrivals, bins=nbins, range=(0, nbins * bin_s), color=_color(mode), alpha=0.7)
    axes[0].set_ylabel(f"arrivals / {bin_s:g} s")
    t = [p["t"] for p in tl]
    axes[1].plot(t, [p["waiting"] for p in tl], label="waiting", color="#d62728")
    axes[1].plot(t, [p["running"] for p in tl], label="running", color="#1f77b4", alpha=0.6)
    axes[1].set_ylabel("requests")
    axes[1].legend(fontsize=8, loc="upper right")
    axes[2].step(t, [p["quantized_layers"] for p in tl], where="post", color=_color(mode))
    axes[2].set_ylabel("layers quantized")
    axes[2].set_ylim(bottom=0)
    axes[3].plot(t, [p["kv_capacity_tokens"] for p in tl], label="KV capacity", color="#2ca02c")
    axes[3].plot(t, [p["kv_used_tokens"] for p in tl], label="KV used", color="#7f7f7f", alpha=0.7)
    axes[3].set_ylabel("KV tokens")
    axes[3].set_xlabel("time since start (s)")
    axes[3].legend(fontsize=8, loc="upper right")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"{mode}: arrivals, queue, layers quantized, KV capacity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_pareto(results: Mapping[str, Mapping], path: Path) -> Path | None:
    """P95 TTFT vs quality loss (perplexity increase %, and probe disagreement %) per mode."""
    pts = []
    for mode, r in results.items():
        q = r.get("quality") or {}
        p95 = (r.get("ttft_s") or {}).get("p95")
        if p95 is None:
            continue
        agree = (q.get("probe_agreement") or {}).get("positional_match_rate")
        pts.append((mode, p95, q.get("ppl_loss_pct"), None if agree is None else (1 - agree) * 100))
    if not any(p[2] is not None or p[3] is not None for p in pts):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    for ax, k, label in ((axes[0], 2, "perplexity increase vs full precision (%)"),
                         (axes[1], 3, "probe tokens differing from full precision (%)")):
        for p in pts:
            if p[k] is None:
                continue
            ax.scatter([p[k]], [p[1]], color=_color(p[0]), s=60, zorder=3)
            ax.annotate(p[0], (p[k], p[1]), textcoords="offset points", xytext=(5, 5), fontsize=9)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("P95 TTFT (s)")
    axes[0].set_yscale("log")
    fig.suptitle("latency vs quality per mode (lower-left is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def capacity_plot(summary: Mapping[str, Mapping], ttft_target_s: float, path: Path) -> Path:
    """Median TTFT vs arrival rate, one line per SCHEDULER:MODE config (bench.capacity's summary), with the
    min-max spread over repeats and the target."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in summary.items():
        rates = sorted(float(r) for r in s["rates"])
        pts = [s["rates"][str(r)] for r in rates]
        med = [p["ttft_p50_s_median"] for p in pts]
        err = [[m - p["ttft_p50_s_min"] for m, p in zip(med, pts)], [p["ttft_p50_s_max"] - m for m, p in zip(med, pts)]]
        ax.errorbar(rates, med, yerr=err, marker="o", capsize=3,
                    label=f"{name} (capacity {s['capacity_rps'] or 'below range'})")
    ax.axhline(ttft_target_s, color="red", linestyle=":", label=f"target {ttft_target_s} s")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("median TTFT (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def make_plots(results: Mapping[str, Mapping], out_dir: Path, slo_ttft_s: float | None = None) -> list[str]:
    """Write every plot into ``out_dir``; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_ttft_cdf(results, out_dir / "ttft_cdf.png", slo_ttft_s)]
    for mode, r in results.items():
        if r.get("timeline"):
            paths.append(plot_timeline(mode, r, out_dir / f"timeline_{mode}.png"))
    pareto = plot_pareto(results, out_dir / "p95_ttft_vs_quality.png")
    if pareto is not None:
        paths.append(pareto)
    return [str(p) for p in paths]


def load_results(out_dir: Path) -> dict[str, dict]:
    """The per-mode JSON files of a bench output directory, in the order results.json lists them."""
    out_dir = Path(out_dir)
    order: list[str] = []
    combined = out_dir / "results.json"
    if combined.is_file():
        order = json.loads(combined.read_text()).get("modes", [])
    files = {p.stem: p for p in out_dir.glob("*.json") if p.stem != "results"}
    modes = [m for m in order if m in files] + sorted(m for m in files if m not in order)
    return {m: json.loads(files[m].read_text()) for m in modes}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m workload.plots OUTPUT_DIR   (re-draws the plots from <mode>.json files)")
        return 0 if args and args[0] in ("-h", "--help") else 2
    results = load_results(Path(args[0]))
    slo = next((r.get("slo", {}).get("ttft_s") for r in results.values()), None)
    for p in make_plots(results, Path(args[0]), slo):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
