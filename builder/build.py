"""One engine-directory build: load, calibrate, quantize per layer, profile importance, export, commit.

Order of work (all inside a staging directory, see serve/model/engine_dir.py; the manifest is written last):
model files -> for each precision: modelopt calibration + per-layer variant files -> layer-importance profile on
the int4 variants -> profile.json -> the unified Hugging Face checkpoints (builder/hf_export.py): the full model and
one per morph level (builder/levels.py; they need the swap order) -> with ``legacy_trtllm`` only, the legacy
TensorRT-LLM checkpoints (builder/trtllm_export.py) -> manifest.json -> rename.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from builder import defaults, hf_export, importance
from builder import levels as lv
from builder.calibration import CalibrationData, calibration_text, load_calibration, text_sha256
from builder.errors import BuildError
from builder.forward import DenseLlama
from builder.hf_export import source_dtype
from builder.summary import summary
from builder.trtllm_export import (
    export_full,
    export_levels,
    export_precision,
    fp8_w8a8_model,
    trtllm_available,
)
from builder.variants import VariantResult, build_variants
from policy.precisions import QUANTIZED_PRECISIONS as PRECISIONS
from serve.logging_setup import get_logger
from serve.model import engine_dir as ed
from serve.model.hf_reference import hf_llama
from serve.model.loader import EMBEDDED_MODELS, LoadedModel, ModelLoadError, load_model, resolve_model_source
from serve.model.model_config import ModelConfig
from serve.model.quantized_linear import INT4_GROUP_SIZES
from serve.model.rtn import choose_int4_block_size

log = get_logger("builder")

PROFILE_PRECISION = "int4"


@dataclass
class BuildOptions:
    model: str = defaults.MODEL
    output: str | None = None
    precisions: tuple[str, ...] = PRECISIONS
    group_size: int | None = None
    calib_text: str | None = None
    calib_tokens: int = defaults.CALIB_TOKENS
    profile_tokens: int = defaults.PROFILE_TOKENS
    seq_len: int = defaults.SEQ_LEN
    seed: int = 0
    force: bool = False
    hf_export: bool = True
    """The unified Hugging Face checkpoints (hf/full, hf/levels/<level>)."""
    legacy_trtllm: bool = False
    """Also the legacy TensorRT-LLM checkpoints (trtllm/) and their trtllm-build commands, for old deployments."""
    levels: tuple[str, ...] | None = None
    """Morph levels to export (builder/levels.py names); None = lv.default_levels(), () = none."""
    kv_block_size: int = defaults.KV_BLOCK_SIZE
    progress: bool = True


@dataclass
class BuildOutcome:
    path: Path
    skipped: bool
    manifest: dict[str, Any]
    seconds: float
    messages: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------- input checks


def model_name(source: str) -> str:
    if source in EMBEDDED_MODELS:
        return source
    path = Path(source).resolve()
    return path.stem if path.is_file() else path.name


def default_output(source: str) -> Path:
    return Path("engines") / model_name(source)


def check_precisions(precisions: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown or not precisions:
        raise BuildError(f"unknown precision {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(PRECISIONS)}")
    return tuple(dict.fromkeys(precisions))


def resolve_levels(opts: BuildOptions) -> tuple[tuple[str, ...], list[dict[str, str]]]:
    """The level names this build exports and the ones it leaves out (with why).

    Explicit levels must use built precisions (BuildError otherwise); default levels whose precision is
    not built are left out and reported."""
    if opts.levels is not None:
        try:
            names = tuple(dict.fromkeys(lv.parse_level(n).name for n in opts.levels))
        except lv.LevelSpecError as exc:
            raise BuildError(str(exc)) from exc
        for name in names:
            missing = [p for p in lv.parse_level(name).precisions if p not in opts.precisions]
            if missing:
                raise BuildError(f"level {name} needs the {', '.join(missing)} variants; add them to --precisions "
                                 f"(building {', '.join(opts.precisions)})")
    else:
        names = lv.default_levels()
    if not opts.hf_export and not opts.legacy_trtllm:
        return (), ([{"level": n, "reason": "the checkpoint export is disabled (--no-hf-export)"} for n in names])
    keep = tuple(n for n in names if all(p in opts.precisions for p in lv.parse_level(n).precisions))
    left = [{"level": n, "reason": f"its precisions are not built (--precisions {','.join(opts.precisions)})"}
            for n in names if n not in keep]
    return keep, left


def check_output_writable(final: Path) -> None:
    if final.exists() and not final.is_dir():
        raise BuildError(f"output {final} exists and is not a directory")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=final.parent, prefix=f".{final.name}.probe-"):
            pass
    except OSError as exc:
        raise BuildError(f"output directory {final} is not writable: {exc.strerror or exc}") from exc


def source_record(source: str) -> dict[str, Any]:
    """Path, kind and sha256 of the model source (a directory hashes its files' names and digests)."""
    try:
        path = resolve_model_source(source)
    except ModelLoadError as exc:
        raise BuildError(str(exc)) from exc
    if path.is_dir():
        digest = hashlib.sha256()
        for f in sorted(p for p in path.iterdir() if p.is_file()):
            digest.update(f"{f.name}\0{ed.sha256_file(f)}\n".encode())
        return {"path": str(path), "kind": "hf-directory", "sha256": digest.hexdigest()}
    kind = "embedded-gguf" if source in EMBEDDED_MODELS else ("gguf" if path.suffix == ".gguf" else "file")
    return {"path": str(path), "kind": kind, "name": source if source in EMBEDDED_MODELS else None,
            "sha256": ed.sha256_file(path)}


def requested_params(opts: BuildOptions) -> dict[str, Any]:
    """Everything that determines the build output besides the source (compared for idempotency)."""
    source, text = calibration_text(opts.calib_text)
    levels, _ = resolve_levels(opts)
    return {
        "format_version": ed.FORMAT_VERSION,
        "precisions": list(opts.precisions),
        "group_size": opts.group_size if opts.group_size is not None else "auto",
        "calibration": {"source": source, "sha256": text_sha256(text), "tokens": opts.calib_tokens,
                        "seq_len": opts.seq_len},
        "profile_tokens": opts.profile_tokens,
        "profile_precision": PROFILE_PRECISION,
        "seed": opts.seed,
        "hf_export": opts.hf_export,
        "legacy_trtllm": opts.legacy_trtllm,
        "levels": {"names": list(levels), "kv_block_size": opts.kv_block_size},
    }


def up_to_date(final: Path, source: dict[str, Any], params: dict[str, Any]) -> dict[str, Any] | None:
    """The existing manifest when it was built from the same source with the same parameters."""
    try:
        manifest = ed.read_manifest(final)
        ed.check_files(final, manifest)
    except ed.EngineDirError:
        return None
    same = (manifest.get("source", {}).get("sha256") == source["sha256"]
            and manifest.get("build", {}).get("params") == params)
    return manifest if same else None


def resolve_group_size(loaded: LoadedModel, requested: int | None) -> tuple[int, str]:
    cfg = loaded.config
    dims = sorted({cfg.hidden_size, cfg.q_size, cfg.intermediate_size})
    if requested is None:
        try:
            group = choose_int4_block_size(dims)
        except ValueError as exc:
            raise BuildError(str(exc)) from exc
        why = ("128 divides every linear's in_features" if group == 128
               else f"128 does not divide every in_features {dims}; {group} is the largest that does")
        return group, f"default: {why}"
    if requested not in INT4_GROUP_SIZES:
        raise BuildError(f"group size {requested} is not supported; the int4 CPU kernel takes "
                         f"{', '.join(map(str, INT4_GROUP_SIZES))}")
    bad = [d for d in dims if d % requested]
    if bad:
        raise BuildError(f"group size {requested} does not divide the input dimension(s) {', '.join(map(str, bad))} "
                         f"of {loaded.config.name}; choose one that divides {dims} (e.g. {choose_group_hint(dims)})")
    return requested, "requested with --group-size"


def choose_group_hint(dims: list[int]) -> str:
    good = [g for g in INT4_GROUP_SIZES if all(d % g == 0 for d in dims)]
    return " or ".join(map(str, good)) if good else "none of the supported sizes fits"


def _versions() -> dict[str, str]:
    def version(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {"python": platform.python_version(), "torch": torch.__version__, "modelopt": version("nvidia-modelopt"),
            "transformers": version("transformers"), "safetensors": version("safetensors"),
            "project": version("morphserve")}


# ------------------------------------------------------------------------------------------ build


def build_engine(opts: BuildOptions) -> BuildOutcome:
    start = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    opts = dataclasses.replace(opts, precisions=check_precisions(tuple(opts.precisions)))
    if opts.kv_block_size < 1:
        raise BuildError(f"--kv-block-size must be positive, got {opts.kv_block_size}")
    source = source_record(opts.model)
    final = Path(opts.output) if opts.output else default_output(opts.model)
    check_output_writable(final)
    if opts.profile_tokens > opts.calib_tokens:
        raise BuildError(f"--profile-tokens ({opts.profile_tokens}) cannot exceed --calib-tokens ({opts.calib_tokens})")
    params = requested_params(opts)
    for stale in ed.clean_stale_builds(final):
        log.info("removed_stale_build", path=str(stale))
    if not opts.force and (manifest := up_to_date(final, source, params)) is not None:
        log.info("up_to_date", path=str(final))
        return BuildOutcome(final, True, manifest, time.perf_counter() - start,
                            [f"{final} is up to date (same source sha256 and build parameters); nothing to do "
                             "(use --force to rebuild)"])

    torch.manual_seed(opts.seed)
    log.info("loading_model", source=source["path"])
    try:
        loaded = load_model(opts.model)
    except ModelLoadError as exc:
        raise BuildError(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - a corrupt file can fail anywhere in a third-party reader
        raise BuildError(f"model file {source['path']} is corrupt or unreadable ({type(exc).__name__}: {exc})") from exc
    group_size, group_reason = resolve_group_size(loaded, opts.group_size)
    calib = load_calibration(loaded.tokenizer, opts.calib_text, opts.calib_tokens, opts.seq_len)
    with ed.staged_build(final) as stage:
        manifest = _build_into(stage, loaded, opts, source, params, calib, group_size, group_reason)
        manifest["build"]["started"] = started
        manifest["build"]["seconds"] = round(time.perf_counter() - start, 3)
        ed.write_json(stage / ed.MANIFEST, manifest)
    seconds = time.perf_counter() - start
    log.info("built", path=str(final), seconds=round(seconds, 1))
    return BuildOutcome(final, False, manifest, seconds, summary(final, manifest, seconds))


def _build_into(stage: Path, loaded: LoadedModel, opts: BuildOptions, source: dict[str, Any], params: dict[str, Any],
                calib: CalibrationData, group_size: int, group_reason: str) -> dict[str, Any]:
    cfg = loaded.config
    log.info("writing_model_files")
    files = ed.write_model_files(stage, loaded)
    hf = hf_llama(loaded)
    batches = calib.batches()
    level_names, levels_left_out = resolve_levels(opts)
    level_precisions = {p for n in level_names for p in lv.parse_level(n).precisions}
    models: dict[str, VariantResult] = {}  # the modelopt models the exports need, by precision
    needed = list(opts.precisions) + ([PROFILE_PRECISION] if PROFILE_PRECISION not in opts.precisions else [])
    layers: list[dict[str, Any]] = [{"layer": i, "full_nbytes": _full_layer_bytes(loaded, i), "variants": {}}
                                    for i in range(cfg.num_layers)]
    quantization: dict[str, Any] = {}
    profile_variants, profile_method = None, ""
    for precision in tqdm(needed, desc="quantize (modelopt)", unit="precision", disable=not opts.progress):
        log.info("quantizing", precision=precision, calib_tokens=len(calib.token_ids))
        result = build_variants(hf, precision, batches, group_size)
        if precision == PROFILE_PRECISION:
            profile_variants, profile_method = result.layers, result.method
        if precision not in opts.precisions:
            continue
        quantization[precision] = result.describe()
        for i in tqdm(range(cfg.num_layers), desc=f"write {precision} layers", unit="layer", leave=False,
                      disable=not opts.progress):
            layers[i]["variants"][precision] = ed.write_layer_variant(stage, i, precision, result.layers[i])
        if precision in level_precisions or opts.legacy_trtllm:  # the exports need the swap order: after the profile
            models[precision] = result
        else:
            result.quantized_model = None
    assert profile_variants is not None
    log.info("profiling_layers", tokens=opts.profile_tokens)
    dense = DenseLlama(cfg, loaded.weights, max_positions=max(opts.profile_tokens, 16))
    profile = importance.profile_layers(dense, profile_variants, calib.profile_ids(opts.profile_tokens),
                                        show_progress=opts.progress)
    profile_json = {
        "metric_precision": PROFILE_PRECISION, "group_size": group_size,
        "calibration": {**calib.describe(), "profile_tokens": opts.profile_tokens},
        "method": ("runtime int4 variants dequantized to fp32 (AWQ pre_quant_scale folded in), dense fp32 forward; "
                   "cosines per token averaged over tokens; MDS on logits via the lm_head Gram matrix"),
        "variants_method": profile_method,
        "lis_weights": {"lts": 0.25, "lrs": 0.25, "mds": 0.5},
        **profile.to_json(),
    }
    ed.write_json(stage / ed.PROFILE, profile_json)
    files[ed.PROFILE] = ed.file_record(stage, ed.PROFILE)
    level_models = {p: r.quantized_model for p, r in models.items()}
    hf_section: dict[str, Any] = {"enabled": opts.hf_export, "format": "modelopt unified Hugging Face checkpoint",
                                  "full": None}
    levels: dict[str, Any] = {"enabled": False, "entries": {}, "skipped": levels_left_out}
    if opts.hf_export:  # first: it copies the models, the legacy export re-smooths them in place
        dtype, dtype_reason = source_dtype(Path(source["path"]), loaded.source_tensor_types)
        hf_section.update(dtype=dtype, dtype_reason=dtype_reason)
        log.info("exporting_hf_full", dtype=dtype)
        hf_section["full"] = hf_export.export_full(hf, stage, dtype)
        if level_names:
            levels = hf_export.export_levels(stage, hf, level_models, list(level_names), profile_json["order"], cfg,
                                             dtype, opts.kv_block_size, hf_section["full"], levels_left_out,
                                             opts.progress)
    trtllm = (_export_legacy(stage, hf, models, batches, cfg, source, loaded, level_names, levels_left_out,
                             profile_json["order"], group_size, opts.kv_block_size)
              if opts.legacy_trtllm else {"enabled": False})
    models.clear()
    return {
        "format_version": ed.FORMAT_VERSION,
        "model": {"name": cfg.name, "config": cfg.to_hf_dict(), "num_layers": cfg.num_layers},
        "source": source,
        "tokenizer": {"files": [ed.TOKENIZER, ed.TOKENIZER_CONFIG]},
        "files": files,
        "full": files[ed.FULL_WEIGHTS],
        "swap_order": profile_json["order"],
        "front_to_back": profile_json["front_to_back"],
        "back_to_front": profile_json["back_to_front"],
        "importance": {"file": ed.PROFILE, "precision": PROFILE_PRECISION, "tokens": opts.profile_tokens,
                       "profile_seconds": profile_json["profile_seconds"]},
        "precisions": list(opts.precisions),
        "int4": {"group_size": group_size, "reason": group_reason},
        "quantization": quantization,
        "layers": layers,
        "hf": hf_section,
        "levels": levels,
        "trtllm": trtllm,
        "build": {"params": params, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "host": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}},
        "versions": _versions(),
    }


def _export_legacy(stage: Path, hf: torch.nn.Module, models: dict[str, VariantResult], batches: list[torch.Tensor],
                   cfg: ModelConfig, source: dict[str, Any], loaded: LoadedModel, level_names: tuple[str, ...],
                   left_out: list[dict[str, str]], order: list[int], group_size: int,
                   block_size: int) -> dict[str, Any]:
    """The legacy TensorRT-LLM checkpoints (``--legacy-trtllm``): per precision, full precision and per level."""
    dtype, dtype_reason = source_dtype(Path(source["path"]), loaded.source_tensor_types)
    precisions = {p: _export_trtllm(stage, hf, r, batches, cfg, dtype) for p, r in models.items()}
    log.info("exporting_trtllm_full", dtype=dtype)
    full = {**export_full(hf, stage, cfg, dtype), "dtype_reason": dtype_reason}
    levels = (export_levels(stage, hf, {p: r.quantized_model for p, r in models.items()}, list(level_names), order,
                            cfg, dtype, group_size, block_size, full, left_out) if level_names else None)
    available, reason = trtllm_available()
    return {"enabled": True, "legacy": True, "tensorrt_llm_available": available,
            "compile_skipped_reason": None if available else reason, "full": full, "precisions": precisions,
            "levels": levels}


def _export_trtllm(stage: Path, hf: torch.nn.Module, result: VariantResult, batches: list[torch.Tensor],
                   cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    if result.quantized_model is None:
        return {"dir": None, "status": "failed", "files": [], "engine_built": False,
                "error": f"no modelopt model to export (RTN fallback: {result.fallback_reason})"}
    model = result.quantized_model
    if result.precision == "fp8":
        try:
            model = fp8_w8a8_model(hf, batches)
        except Exception as exc:  # noqa: BLE001 - recorded, the build goes on
            return {"dir": None, "status": "failed", "files": [], "engine_built": False,
                    "error": f"fp8 W8A8 calibration failed: {type(exc).__name__}: {exc}"}
    log.info("exporting_trtllm", precision=result.precision)
    return export_precision(model, result.precision, stage, cfg, dtype)


def _full_layer_bytes(loaded: LoadedModel, i: int) -> int:
    prefix = f"model.layers.{i}."
    return sum(t.numel() * t.element_size() for k, t in loaded.weights.items() if k.startswith(prefix) and "_proj."
               in k)
