"""Legacy TensorRT-LLM checkpoints (modelopt export_tensorrt_llm_checkpoint) and the engine compile: only with
``python -m builder --legacy-trtllm``, for deployments that still run ``trtllm-build`` engines. Upstream deprecated
that path (TensorRT-LLM's ``convert_checkpoint.py`` / ``trtllm-build``; modelopt's legacy export from 0.48, removed in
0.49); the default build writes unified Hugging Face checkpoints instead (builder/hf_export.py).

Three kinds, all under ``trtllm/`` of the engine directory:
- ``trtllm/fp16/`` (``bf16/`` for a bf16 source): the full-precision model, the level-0 baseline;
- ``trtllm/<precision>/``: the whole model at int8 / int4 / fp8 (the static modes);
- ``trtllm/levels/<level>/``: one mixed-precision checkpoint per morph level (builder/levels.py): the
  level's layers from the same modelopt models the runtime variants come from, every other layer the
  full-precision module, exported as ``quant_algo: MIXED_PRECISION`` with a per-module
  ``quantized_layers`` map in ``quant_cfg.json`` (TensorRT-LLM's PretrainedConfig reads it next to
  config.json for MIXED_PRECISION).

A checkpoint (config.json + rank0.safetensors, fused qkv / gate / fc weights with their scaling
factors) is what ``trtllm-build`` reads. The compile runs only when ``tensorrt_llm`` is importable and
``trtllm-build`` is on PATH; otherwise ``build_commands.sh`` holds the exact command for a GPU host and
the record says plainly that no engine was built.

What each precision exports as (TensorRT-LLM ``quant_algo``):
- int8 -> W8A16 (the same modelopt model the runtime int8 variants come from);
- int4 -> W4A16_AWQ with pre_quant_scale (the same AWQ model as the runtime int4 variants);
- fp8  -> FP8 from modelopt's stock FP8_DEFAULT_CFG, i.e. W8A8 with calibrated static activation
  scales, because TensorRT-LLM's FP8 GEMMs need activation scales. The e4m3 weight codes and scales are
  the runtime's weight-only fp8 variant's (weight amax does not depend on the data) except where modules
  are fused: q/k/v and gate/up then share the largest of their per-tensor scales (modelopt 0.47's
  QKVConfig / preprocess_linear_fusion; one GEMM takes one scale), so those codes are re-rounded.

Fixes applied to modelopt 0.47's output (recorded under ``config_patched``): with transformers >= 5 the
RoPE base lives in ``rope_parameters`` and the export omits ``rotary_base`` (TensorRT-LLM would silently
use 10000); ``rotary_scaling`` likewise. modelopt writes MIXED_PRECISION only when a model mixes two
quantized formats; a level with one quantized format plus full-precision layers comes out as that format
with ``exclude_modules``, which is rewritten to the equivalent MIXED_PRECISION form ("mixed_precision"),
so every level has one layout.

What modelopt's export does to a quantized model (so what a checkpoint holds): q/k/v are fused into one
``attention.qkv`` GEMM with one ``prequant_scaling_factor``; for int4 AWQ modelopt averages the three
pre_quant_scales and re-quantizes q/k/v with it (in place on the modelopt model), so the fused int4 qkv
codes are a deterministic function of the full weights and the q/k/v variants' pre_quant_scales, not
the q/k/v variants' codes; o/gate/up/down and all int8 modules hold the runtime variants' codes.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from builder import levels as lv
from builder.hf_export import DTYPES, level_model, safetensors_header, safetensors_tensor_bytes
from builder.quantize import token_batches_loop
from builder.variants import captured_output
from serve.logging_setup import get_logger
from serve.model.engine_dir import file_record
from serve.model.kv_cache import kv_bytes_per_block
from serve.model.model_config import ModelConfig
from serve.model.quantized_linear.registry import REGISTRY

log = get_logger("builder.trtllm")

ENGINE_SUBDIR = "engine"
LEVELS_SUBDIR = "trtllm/levels"
MIXED_PRECISION = "MIXED_PRECISION"
QUANT_ALGO_PRECISION = {REGISTRY[p].trtllm.quant_algo: p for p in lv.LEVEL_PRECISIONS}
"""TensorRT-LLM quant_algo of a level's quantized module -> our precision (the format registry's names)."""
DTYPE_DIRS = {"float16": "fp16", "bfloat16": "bf16"}


def trtllm_available() -> tuple[bool, str]:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return False, "tensorrt_llm is not importable on this host"
    if shutil.which("trtllm-build") is None:
        return False, "trtllm-build is not on PATH"
    return True, ""


def build_command(config: ModelConfig) -> list[str]:
    max_seq = min(config.max_position_embeddings, 4096)
    return [
        "trtllm-build", "--checkpoint_dir", ".", "--output_dir", ENGINE_SUBDIR,
        "--gemm_plugin", "auto", "--max_batch_size", "16",
        "--max_input_len", str(max_seq // 2), "--max_seq_len", str(max_seq), "--max_num_tokens", "8192",
    ]


def fp8_w8a8_model(model: nn.Module, batches: list[torch.Tensor]) -> nn.Module:
    """A copy of the full-precision model quantized with modelopt's stock FP8_DEFAULT_CFG (W8A8)."""
    import modelopt.torch.quantization as mtq

    with captured_output("modelopt_quantize_fp8_w8a8"), torch.no_grad():
        return mtq.quantize(copy.deepcopy(model), copy.deepcopy(mtq.FP8_DEFAULT_CFG), token_batches_loop(batches))


def _patch_config(path: Path, config: ModelConfig) -> list[str]:
    cfg = json.loads(path.read_text())
    patched = []
    if not cfg.get("rotary_base"):
        cfg["rotary_base"] = config.rope_theta
        patched.append("rotary_base")
    if config.rope_scaling and not cfg.get("rotary_scaling"):
        scaling = dict(config.rope_scaling)
        scaling.setdefault("type", scaling.get("rope_type"))
        cfg["rotary_scaling"] = scaling
        patched.append("rotary_scaling")
    if patched:
        path.write_text(json.dumps(cfg, indent=4))
    return patched


def _write_build_script(out_dir: Path, command: list[str], what: str, skipped_reason: str | None) -> None:
    note = (f"# The compile step was SKIPPED on the build host ({skipped_reason}); run this script on a GPU\n"
            "# host with TensorRT-LLM installed." if skipped_reason else "# The builder ran this command.")
    script = (
        "#!/usr/bin/env bash\n"
        f"# Compile the TensorRT-LLM engine for the {what} checkpoint in this directory.\n"
        f"{note}\n"
        "set -euo pipefail\n"
        'cd "$(dirname "$0")"\n'
        f"{shlex.join(command)}\n"
    )
    path = out_dir / "build_commands.sh"
    path.write_text(script)
    path.chmod(0o755)


def _export(model: nn.Module, rel: str, root: Path, config: ModelConfig, dtype: str, what: str,
            check: Any = None) -> dict[str, Any]:
    """Export ``model`` into ``root/rel``; never raises. ``check(out_dir)`` post-processes and validates
    the export (raising marks it failed). Returns the manifest record."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    out_dir = root / rel
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    record: dict[str, Any] = {"dir": rel, "decoder_type": "llama", "dtype": dtype, "inference_tensor_parallel": 1}
    try:
        with captured_output("modelopt_export_trtllm"), torch.no_grad():
            export_tensorrt_llm_checkpoint(model, decoder_type="llama", dtype=DTYPES[dtype],
                                           export_dir=out_dir, inference_tensor_parallel=1)
        record["config_patched"] = _patch_config(out_dir / "config.json", config)
        if check is not None:
            record["config_patched"] += check(out_dir)
        written = json.loads((out_dir / "config.json").read_text())
        record["quant_algo"] = written.get("quantization", {}).get("quant_algo")
    except Exception as exc:  # noqa: BLE001 - an export failure is recorded, the build goes on
        shutil.rmtree(out_dir, ignore_errors=True)
        log.warning("trtllm_export_failed", what=what, error=f"{type(exc).__name__}: {exc}")
        record.update(status="failed", error=f"{type(exc).__name__}: {exc}", files=[], engine_built=False)
        return record
    command = build_command(config)
    available, reason = trtllm_available()
    record.update(status="exported", error=None, build_command=shlex.join(command),
                  weight_bytes=safetensors_tensor_bytes(out_dir / "rank0.safetensors"))
    if available:
        record.update(_compile(out_dir, command))
    else:
        record.update(engine_built=False, compile_skipped_reason=reason)
    _write_build_script(out_dir, command, what, None if available else reason)
    record["files"] = [file_record(root, str(p.relative_to(root))) for p in sorted(out_dir.rglob("*")) if p.is_file()]
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def export_precision(model: nn.Module, precision: str, root: Path, config: ModelConfig,
                     dtype: str = "float16") -> dict[str, Any]:
    """Export ``model`` (modelopt-quantized, every layer) into ``root/trtllm/<precision>/``; never raises.

    Returns the manifest record: status "exported" / "failed", files, the compile outcome."""
    return _export(model, f"trtllm/{precision}", root, config, dtype, precision)


def export_full(model: nn.Module, root: Path, config: ModelConfig, dtype: str) -> dict[str, Any]:
    """The unquantized model into ``root/trtllm/fp16/`` (``bf16/``); never raises."""
    return _export(model, f"trtllm/{DTYPE_DIRS[dtype]}", root, config, dtype, f"full-precision ({dtype})")


# ------------------------------------------------------------------------------------------- levels


def _module_order(name: str) -> tuple[int, int]:
    parts = name.split(".")
    return int(parts[2]), list(lv.TRTLLM_LINEARS).index(".".join(parts[3:]))


def as_mixed_precision(out_dir: Path, expected: Mapping[str, str], group_size: int) -> list[str]:
    """Make ``out_dir`` a MIXED_PRECISION checkpoint and check it quantizes exactly ``expected``
    (``{module: precision}``); returns what was patched. Raises ValueError on any mismatch."""
    cfg_path, qcfg_path = out_dir / "config.json", out_dir / "quant_cfg.json"
    cfg = json.loads(cfg_path.read_text())
    quant = cfg.get("quantization") or {}
    patched = []
    if quant.get("quant_algo") != MIXED_PRECISION:
        if not quant.get("quant_algo"):
            raise ValueError("modelopt exported no quantized layer")
        per_layer = {k: quant[k] for k in ("quant_algo", "group_size", "has_zero_point", "pre_quant_scale") if k
                     in quant}
        modules = sorted((k[: -len(".weights_scaling_factor")] for k
                          in safetensors_header(out_dir / "rank0.safetensors")
                          if k.endswith(".weights_scaling_factor")), key=_module_order)
        qcfg = {"quant_algo": MIXED_PRECISION, "kv_cache_quant_algo": quant.get("kv_cache_quant_algo"),
                "quantized_layers": {m: dict(per_layer) for m in modules}}
        qcfg_path.write_text(json.dumps(qcfg, indent=4))
        cfg["quantization"] = {"quant_algo": MIXED_PRECISION, "kv_cache_quant_algo": quant.get("kv_cache_quant_algo")}
        cfg_path.write_text(json.dumps(cfg, indent=4))
        patched.append("mixed_precision")
    qcfg = json.loads(qcfg_path.read_text())
    got = {}
    for module, layer_cfg in qcfg["quantized_layers"].items():
        algo = layer_cfg.get("quant_algo")
        if algo not in QUANT_ALGO_PRECISION:
            raise ValueError(f"{module}: unexpected quant_algo {algo!r}")
        if REGISTRY[QUANT_ALGO_PRECISION[algo]].grouped and layer_cfg.get("group_size") != group_size:
            raise ValueError(f"{module}: group_size {layer_cfg.get('group_size')} != {group_size}")
        got[module] = QUANT_ALGO_PRECISION[algo]
    if got != dict(expected):
        extra, missing = sorted(set(got) - set(expected)), sorted(set(expected) - set(got))
        raise ValueError(f"quantized modules differ from the level: extra {extra[:4]}, missing {missing[:4]}, "
                         "precision mismatches "
                         f"{sorted(m for m in set(got) & set(expected) if got[m] != expected[m])[:4]}")
    return patched


def kv_budget(config: ModelConfig, dtype: str, block_size: int) -> dict[str, Any]:
    """The KV-block assumption the levels' ``kv_blocks_freed`` are computed under."""
    return {
        "kv_block_size": block_size,
        "kv_dtype": dtype,
        "kv_bytes_per_block": kv_bytes_per_block(config, block_size, DTYPES[dtype]),
        "rule": "kv_blocks_freed = floor(bytes_freed / kv_bytes_per_block)",
        "assumption": (f"a fixed device-memory budget holding the {dtype} checkpoint; the weight bytes a level frees "
                       "become KV blocks of the same engine (KV cache in the checkpoint dtype, no kv_cache_quant_algo; "
                       f"{block_size}-token blocks = serve.config.EngineConfig.block_size; activation and workspace "
                       "memory unchanged). TensorRT-LLM's own tokens_per_block may differ: rescale by block size."),
    }


def export_levels(root: Path, full: nn.Module, quantized: Mapping[str, nn.Module | None], names: list[str],
                  swap_order: list[int], config: ModelConfig, dtype: str, group_size: int, block_size: int,
                  baseline: dict[str, Any] | None, skipped: list[dict[str, str]]) -> dict[str, Any]:
    """One MIXED_PRECISION checkpoint per level into ``root/trtllm/levels/<level>/``; never raises.

    Returns the manifest's ``levels`` section: the budget assumption, the baseline (full-precision
    checkpoint), and per level its layers and precisions, the checkpoint record, expected and measured
    weight bytes, bytes freed against the baseline and the KV blocks they buy."""
    elt = torch.empty((), dtype=DTYPES[dtype]).element_size()
    budget = kv_budget(config, dtype, block_size)
    full_bytes = lv.checkpoint_weight_bytes(config, {}, elt, group_size)
    entries: dict[str, Any] = {}
    planned, skipped = lv.plan_levels(names, swap_order, skipped)
    for name, level, layer_precisions in planned:
        expected = lv.checkpoint_weight_bytes(config, layer_precisions, elt, group_size)
        entry: dict[str, Any] = {
            **lv.level_entry(level, layer_precisions, swap_order),
            "expected_weight_bytes": expected,
            "bytes_freed": full_bytes - expected,
            "kv_blocks_freed": (full_bytes - expected) // budget["kv_bytes_per_block"],
        }
        missing = [p for p in level.precisions if quantized.get(p) is None]
        if missing:
            entry.update(dir=None, status="failed", files=[], engine_built=False,
                         error=f"no modelopt model for {missing} (RTN fallback); nothing to export")
        else:
            log.info("exporting_trtllm_level", level=name, layers=len(layer_precisions))
            modules = lv.quantized_modules(layer_precisions)
            with level_model(full, quantized, layer_precisions) as model:  # type: ignore[arg-type]
                entry.update(_export(model, f"{LEVELS_SUBDIR}/{level.dirname}", root, config, dtype,
                                     f"morph level {name} (mixed precision)",
                                     check=lambda out: as_mixed_precision(out, modules, group_size)))
        entries[name] = entry
    return {"enabled": True, "budget": budget,
            "baseline": {"dir": baseline.get("dir") if baseline else None, "dtype": dtype,
                         "expected_weight_bytes": full_bytes,
                         "weight_bytes": baseline.get("weight_bytes") if baseline else None},
            "entries": entries, "skipped": skipped}


def _compile(out_dir: Path, command: list[str]) -> dict[str, Any]:
    """Run trtllm-build (only reached where tensorrt_llm is installed; never run on this project's hosts)."""
    proc = subprocess.run(command, cwd=out_dir, capture_output=True, text=True)
    built = proc.returncode == 0 and any((out_dir / ENGINE_SUBDIR).glob("*.engine"))
    result: dict[str, Any] = {"engine_built": built, "compile_returncode": proc.returncode}
    if not built:
        result["compile_error"] = (proc.stderr or proc.stdout)[-2000:]
    return result
