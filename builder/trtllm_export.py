"""TensorRT-LLM checkpoints per precision (modelopt export_tensorrt_llm_checkpoint) and the engine compile.

The checkpoint (config.json + rank0.safetensors, fused qkv / gate / fc weights with their scaling
factors) is what ``trtllm-build`` reads. The compile runs only when ``tensorrt_llm`` is importable and
``trtllm-build`` is on PATH; otherwise ``build_commands.sh`` holds the exact command for a GPU host and
the record says plainly that no engine was built.

What each precision exports as (TensorRT-LLM ``quant_algo``):
- int8 -> W8A16 (the same modelopt model the runtime int8 variants come from);
- int4 -> W4A16_AWQ with pre_quant_scale (the same AWQ model as the runtime int4 variants);
- fp8  -> FP8 from modelopt's stock FP8_DEFAULT_CFG, i.e. W8A8 with calibrated static activation
  scales, because TensorRT-LLM's FP8 GEMMs need activation scales. The e4m3 weight codes and scales are
  the same as the runtime's weight-only fp8 variant (weight amax does not depend on the data).

Two fixes applied to modelopt 0.47's config.json (recorded under ``config_patched``): with
transformers >= 5 the RoPE base lives in ``rope_parameters`` and the export omits ``rotary_base``
(TensorRT-LLM would silently use 10000); ``rotary_scaling`` likewise.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from builder.quantize import token_batches_loop
from builder.variants import captured_output
from serve.logging_setup import get_logger
from serve.model.engine_dir import file_record
from serve.model.model_config import ModelConfig

log = get_logger("builder.trtllm")

ENGINE_SUBDIR = "engine"


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


def _write_build_script(out_dir: Path, command: list[str], precision: str, skipped_reason: str | None) -> None:
    note = (f"# The compile step was SKIPPED on the build host ({skipped_reason}); run this script on a GPU\n"
            "# host with TensorRT-LLM installed." if skipped_reason else "# The builder ran this command.")
    script = (
        "#!/usr/bin/env bash\n"
        f"# Compile the TensorRT-LLM engine for the {precision} checkpoint in this directory.\n"
        f"{note}\n"
        "set -euo pipefail\n"
        'cd "$(dirname "$0")"\n'
        f"{shlex.join(command)}\n"
    )
    path = out_dir / "build_commands.sh"
    path.write_text(script)
    path.chmod(0o755)


def export_precision(model: nn.Module, precision: str, root: Path, config: ModelConfig) -> dict[str, Any]:
    """Export ``model`` (modelopt-quantized) into ``root/trtllm/<precision>/``; never raises.

    Returns the manifest record: status "exported" / "failed", files, the compile outcome."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    rel = f"trtllm/{precision}"
    out_dir = root / rel
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    record: dict[str, Any] = {"dir": rel, "decoder_type": "llama", "dtype": "float16", "inference_tensor_parallel": 1}
    try:
        with captured_output("modelopt_export_trtllm"), torch.no_grad():
            export_tensorrt_llm_checkpoint(model, decoder_type="llama", dtype=torch.float16,
                                           export_dir=out_dir, inference_tensor_parallel=1)
        record["config_patched"] = _patch_config(out_dir / "config.json", config)
        record["quant_algo"] = json.loads((out_dir / "config.json").read_text()).get("quantization", {}).get("quant_algo")
    except Exception as exc:  # noqa: BLE001 - an export failure is recorded, the build goes on
        shutil.rmtree(out_dir, ignore_errors=True)
        log.warning("trtllm_export_failed", precision=precision, error=f"{type(exc).__name__}: {exc}")
        record.update(status="failed", error=f"{type(exc).__name__}: {exc}", files=[], engine_built=False)
        return record
    command = build_command(config)
    available, reason = trtllm_available()
    record.update(status="exported", error=None, build_command=shlex.join(command))
    if available:
        record.update(_compile(out_dir, command))
    else:
        record.update(engine_built=False, compile_skipped_reason=reason)
    _write_build_script(out_dir, command, precision, None if available else reason)
    record["files"] = [file_record(root, str(p.relative_to(root))) for p in sorted(out_dir.rglob("*")) if p.is_file()]
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def _compile(out_dir: Path, command: list[str]) -> dict[str, Any]:
    """Run trtllm-build (only reached where tensorrt_llm is installed; never run on this project's hosts)."""
    proc = subprocess.run(command, cwd=out_dir, capture_output=True, text=True)
    built = proc.returncode == 0 and any((out_dir / ENGINE_SUBDIR).glob("*.engine"))
    result: dict[str, Any] = {"engine_built": built, "compile_returncode": proc.returncode}
    if not built:
        result["compile_error"] = (proc.stderr or proc.stdout)[-2000:]
    return result
