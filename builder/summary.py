"""What ``python -m builder`` prints after a build: where everything went, what was skipped and why."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def summary(final: Path, manifest: dict[str, Any], seconds: float) -> list[str]:
    lines = [
        f"built {final} in {seconds:.1f} s (layer profile {manifest['importance']['profile_seconds']:.1f} s); "
        f"{_dir_bytes(final) / 2**20:.1f} MiB on disk",
        f"precisions: {', '.join(manifest['precisions'])}; int4 group size {manifest['int4']['group_size']} "
        f"({manifest['int4']['reason']})",
        f"swap order (LIS): {' '.join(map(str, manifest['swap_order']))}",
    ]
    for precision, q in manifest["quantization"].items():
        if q["fallback_reason"]:
            lines.append(f"WARNING: {precision} used the RTN fallback: {q['fallback_reason']}")
    lines += _hf_lines(final, manifest)
    lines += _legacy_lines(final, manifest["trtllm"])
    return lines


def _hf_lines(final: Path, manifest: dict[str, Any]) -> list[str]:
    hf, levels = manifest["hf"], manifest["levels"]
    if not hf["enabled"]:
        return ["unified Hugging Face checkpoints: export disabled (--no-hf-export)"]
    full = hf["full"]
    lines = [f"full model: {full['status']} -> {final / full['dir']}" if full["status"] == "exported"
             else f"full model: export FAILED ({full['error']})"]
    if levels["enabled"]:
        budget = levels["budget"]
        lines.append(f"morph levels as unified HF checkpoints ({len(levels['entries'])}; load with trtllm-serve, vLLM, "
                     f"SGLang or --engine-dir; KV blocks of {budget['kv_block_size']} tokens, "
                     f"{budget['kv_bytes_per_block'] / 2**10:.0f} KiB each at {budget['kv_dtype']}):")
        for name, rec in levels["entries"].items():
            if rec["status"] != "exported":
                lines.append(f"  {name}: export FAILED ({rec['error']})")
                continue
            freed = (f", frees {rec['bytes_freed'] / 2**20:.1f} MiB = {rec['kv_blocks_freed']} KV blocks"
                     if "bytes_freed" in rec else "")
            lines.append(f"  {name}: {rec['num_quantized']} layers, {rec['quant_algo']} -> {final / rec['dir']} "
                         f"({rec['stored_bytes'] / 2**20:.1f} MiB{freed}; modes: "
                         f"{', '.join(rec['reached_by_modes']) or 'none'})")
    for left in levels["skipped"]:
        lines.append(f"  level {left['level']} not exported: {left['reason']}")
    return lines


def _legacy_lines(final: Path, trt: dict[str, Any]) -> list[str]:
    if not trt["enabled"]:
        return []
    lines = ["legacy TensorRT-LLM checkpoints (--legacy-trtllm; trtllm-build is deprecated upstream):"]
    exports = {f"full precision ({trt['full']['dtype']})": trt["full"], **trt["precisions"],
               **{f"level {n}": r for n, r in ((trt.get("levels") or {}).get("entries") or {}).items()}}
    for what, rec in exports.items():
        if rec["status"] != "exported":
            lines.append(f"  {what}: export FAILED ({rec['error']})")
        elif rec.get("engine_built"):
            lines.append(f"  {what}: checkpoint exported and engine built in {final / rec['dir']}/engine")
        else:
            reason = rec.get("compile_skipped_reason") or rec.get("compile_error", "compile failed")
            lines.append(f"  {what}: checkpoint exported to {final / rec['dir']}; compile step SKIPPED ({reason}) -- "
                         f"NO engine was built; run {final / rec['dir']}/build_commands.sh on a GPU host")
    return lines
