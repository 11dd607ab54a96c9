"""Unified Hugging Face checkpoints (modelopt ``export_hf_checkpoint``): the full model and one per morph level.

These are the directories today's engines load with nothing to compile: TensorRT-LLM's PyTorch backend
(``trtllm-serve <dir>``, ``LLM(model=<dir>)``), vLLM and SGLang, and this engine (``--engine-dir <dir>``,
serve/model/unified_checkpoint.py). Layout under the engine directory::

    hf/full/                the unquantized model
    hf/levels/<level>/      one per morph level (builder/levels.py), e.g. int4-25: the first 25 % of the swap order

each holding what modelopt writes (``model.safetensors``, ``config.json`` with ``quantization_config``,
``hf_quant_config.json``, ``generation_config.json``) plus the engine directory's tokenizer files. modelopt writes the
format; this module only chooses the model it receives: a level is the calibrated per-precision modelopt models the
runtime variants come from (no second calibration), the level's layers taken from the model of their precision and
every other layer from the full-precision model (:func:`level_model`, no copies), deep-copied once per level because
the export rewrites the modules it packs. A level mixing two formats comes out ``quant_algo: MIXED_PRECISION`` with a
per-module ``quantized_layers`` map; a level with one format comes out as that ``quant_algo`` plus the
``exclude_modules`` it leaves at full precision. Both are modelopt's own forms, left as written, and every consumer
reads both; :func:`check_checkpoint` checks that the modules and formats the checkpoint quantizes are exactly the
level's and that modelopt's own converter reads ``hf_quant_config.json`` back into config.json's
``quantization_config`` without complaint.

What the export does to a level (so what a checkpoint holds against the runtime variants in ``layers/``): modelopt
fuses the projections that share an input before it packs them. For int4 AWQ that means q/k/v (and gate/up) get the
average of their AWQ pre_quant_scales, their weights are re-smoothed and re-quantized with it, and that scale is
folded into the RMSNorm before them (input_layernorm, post_attention_layernorm), so those projections hold no
pre_quant_scale; o_proj and down_proj keep theirs. Every module is packed by modelopt's real quantization (``w /
scale`` rounded), which in rare ties rounds apart from its fake quantization (``w * (max / amax)``, the rule the
runtime variants follow), and from the checkpoint dtype's weights (below). :func:`exported_level` is the level as the
export left it in memory, as this engine runs it: the reference a served checkpoint must reproduce token for token.

Checkpoints are in the source's half precision (:func:`source_dtype`: bfloat16 for a bf16 source, float16
otherwise), the dtype the engines that load them compute in: modelopt 0.47 writes an fp32 model's unquantized tensors
as fp32 whatever ``dtype`` it is given, so the level's copy is cast first (:func:`at_dtype`) and the export packs the
quantized modules from the cast weights and calibration (the in-memory level is that same cast copy).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import shutil
import struct
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from builder import levels as lv
from builder.quantize import modelopt_format
from builder.variants import captured_output
from serve.logging_setup import get_logger
from serve.model import engine_dir as ed
from serve.model.kv_cache import kv_bytes_per_block
from serve.model.layers import PROJECTIONS, projection_key
from serve.model.loader import LoadedModel
from serve.model.model_config import ModelConfig
from serve.model.quantized_linear import QuantizedLinear
from serve.model.quantized_linear.common import UnifiedTensors
from serve.model.tokenizer import Tokenizer
from serve.model.unified_checkpoint import MIXED_PRECISION, UnifiedQuantization, module_formats

log = get_logger("builder.hf")

HF_FULL = f"{ed.HF_DIR}/full"
HF_LEVELS = f"{ed.HF_DIR}/levels"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = (ed.TOKENIZER, ed.TOKENIZER_CONFIG)
WEIGHTS_FILE = "model.safetensors"


# ------------------------------------------------------------------------------------ the level model


def source_dtype(source_path: Path, tensor_types: tuple[str, ...]) -> tuple[str, str]:
    """The checkpoint dtype: bfloat16 where the source is bf16 (a Hugging Face directory's declared dtype,
    else its stored tensor types; a GGUF's tensor types), float16 otherwise. Returns (dtype, why)."""
    config = source_path / "config.json" if source_path.is_dir() else None
    if config is not None and config.is_file():
        cfg = json.loads(config.read_text())
        declared = cfg.get("torch_dtype") or cfg.get("dtype")
        if declared in DTYPES:
            return declared, f"config.json declares {declared}"
    stored = ", ".join(tensor_types) or "unknown"
    if "BF16" in tensor_types:
        return "bfloat16", f"the source stores BF16 tensors ({stored})"
    return "float16", f"no bf16 in the source (tensor types {stored}): float16"


def at_dtype(model: nn.Module, dtype: str) -> nn.Module:
    """``model`` (a private copy) cast to the checkpoint dtype, its config saying so: what the export writes it as."""
    model.to(DTYPES[dtype])
    model.config.dtype = DTYPES[dtype]
    return model


@contextlib.contextmanager
def level_model(full: nn.Module, quantized: Mapping[str, nn.Module],
                layer_precisions: Mapping[int, str]) -> Iterator[nn.Module]:
    """A model whose layer i is ``quantized[p]``'s layer i where ``layer_precisions[i] == p`` and the
    full-precision model's layer i elsewhere: the first quantized precision's model with its decoder
    ModuleList temporarily re-pointed (no copies; the layers are put back on exit)."""
    base = quantized[next(iter(layer_precisions.values()))]
    layers = base.model.layers
    saved = list(layers)
    try:
        for i in range(len(layers)):
            precision = layer_precisions.get(i)
            layers[i] = (full if precision is None else quantized[precision]).model.layers[i]
        yield base
    finally:
        for i, layer in enumerate(saved):
            layers[i] = layer


def unquantized_model(model: nn.Module) -> nn.Module:
    """A copy of the full-precision model whose linears are modelopt's quantized modules with every quantizer off:
    the source of a level's full-precision layers. The export lists such a module as excluded from quantization;
    a plain ``nn.Linear`` it does not list at all, and a one-format level would then read as quantizing it."""
    import modelopt.torch.quantization as mtq  # noqa: PLC0415

    off = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    with captured_output("modelopt_unquantized"), torch.no_grad():
        return mtq.quantize(copy.deepcopy(model), off, forward_loop=None)


def level_copy(full: nn.Module, quantized: Mapping[str, nn.Module], layer_precisions: Mapping[int, str],
               dtype: str) -> nn.Module:
    """A private copy of the level model at the checkpoint dtype: the export packs the quantized modules it is
    given in place."""
    with level_model(full, quantized, layer_precisions) as model:
        return at_dtype(copy.deepcopy(model), dtype)


def exported_level(model: nn.Module, layer_precisions: Mapping[int, str], config: ModelConfig, tokenizer: Tokenizer,
                   name: str) -> LoadedModel:
    """The level built in memory, as this engine runs it: ``model`` (a :func:`level_copy`) as ``export_hf_checkpoint``
    left it after writing it, in memory (q/k/v and gate/up re-smoothed and folded into the norms, each quantized
    module packed by modelopt's quantization with its scales beside it). Each quantized projection's format comes
    from its modelopt module (``get_quantization_format``, never from a config file), its tensors through the format
    registry's reader; every other tensor as the model holds it."""
    modules = dict(model.named_modules())
    quantized: dict[int, dict[str, QuantizedLinear]] = {}
    formats: dict[str, str] = {}
    for layer in sorted(layer_precisions):
        for proj in PROJECTIONS:
            key = projection_key(layer, proj)
            module = modules[key]
            fmt = modelopt_format(module)
            if fmt is None:
                raise ValueError(f"{key}: not a quantized module of a format this engine runs")
            tensors = {"weight": module.weight.detach(), "weight_scale": module.weight_scale}
            pqs = getattr(module.input_quantizer, "_pre_quant_scale", None)
            if pqs is not None:
                tensors["pre_quant_scale"] = pqs
            quantized.setdefault(layer, {})[proj] = fmt.from_unified(UnifiedTensors(key, tensors), {})
            formats[key] = fmt.trtllm.quant_algo
    skip = {projection_key(layer, proj) + ".weight" for layer in layer_precisions for proj in PROJECTIONS}
    weights = {k: v.detach().float().clone() for k, v in model.named_parameters() if k not in skip}
    algos = set(formats.values())
    quant = UnifiedQuantization(MIXED_PRECISION if len(algos) > 1 else algos.pop(), formats, quantized)
    return LoadedModel(config, weights, tokenizer, f"in-memory level {name}", quantized=quant)


# --------------------------------------------------------------------------------------- checking


def safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def safetensors_tensor_bytes(path: Path) -> int:
    """Bytes of the tensors in a safetensors file (its header's data offsets; the header itself excluded)."""
    return sum(t["data_offsets"][1] - t["data_offsets"][0]
               for k, t in safetensors_header(path).items() if k != "__metadata__")


def checkpoint_formats(out_dir: Path) -> dict[str, str]:
    """``{module: precision}`` of what a written checkpoint quantizes, read as the engine reads it (config.json's
    ``quantization_config`` against the modules that hold weight scales)."""
    cfg = json.loads((out_dir / "config.json").read_text())
    names = [k for f in sorted(out_dir.glob("*.safetensors")) for k in safetensors_header(f) if k != "__metadata__"]
    return {m: fmt.precision for m, fmt in module_formats(cfg, names).items()}


def check_checkpoint(out_dir: Path, expected: Mapping[str, str]) -> str | None:
    """Raises ValueError unless modelopt's own converter reads ``hf_quant_config.json`` back into config.json's
    ``quantization_config`` without a warning and the checkpoint quantizes exactly ``expected`` (``{module:
    precision}``). Returns the checkpoint's ``quant_algo`` (None: unquantized)."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format  # noqa: PLC0415

    cfg = json.loads((out_dir / "config.json").read_text())
    qcfg_path = out_dir / "hf_quant_config.json"
    if qcfg_path.is_file():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # modelopt warns where it has no reading of an algorithm
            converted = convert_hf_quant_config_format(json.loads(qcfg_path.read_text()))
        if converted != cfg.get("quantization_config"):
            raise ValueError("config.json's quantization_config is not modelopt's reading of hf_quant_config.json")
    elif "quantization_config" in cfg:
        raise ValueError("config.json has a quantization_config but there is no hf_quant_config.json")
    got = checkpoint_formats(out_dir)
    if got != dict(expected):
        extra, missing = sorted(set(got) - set(expected)), sorted(set(expected) - set(got))
        wrong = sorted(m for m in set(got) & set(expected) if got[m] != expected[m])
        raise ValueError(f"quantized modules differ from the level: extra {extra[:4]}, missing {missing[:4]}, "
                         f"other format {wrong[:4]}")
    return (cfg.get("quantization_config") or {}).get("quant_algo")


def level_modules(layer_precisions: Mapping[int, str]) -> dict[str, str]:
    """``{"model.layers.3.self_attn.q_proj": "int4", ...}``: the modules a level's checkpoint quantizes."""
    return {projection_key(layer, proj): precision
            for layer, precision in sorted(layer_precisions.items()) for proj in PROJECTIONS}


# ---------------------------------------------------------------------------------------- exporting


def write_checkpoint(model: nn.Module, out_dir: Path) -> None:
    """modelopt's ``export_hf_checkpoint`` of ``model`` into ``out_dir``, quietly (it packs ``model`` in place)."""
    from modelopt.torch.export import export_hf_checkpoint  # noqa: PLC0415
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    out_dir.mkdir(parents=True, exist_ok=True)
    # modelopt prints, transformers draws a shard bar on stderr and warns through its own handler (modelopt reads the
    # deprecated config.torch_dtype); the builder draws its own bar
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with captured_output("modelopt_export_hf"), contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
            export_hf_checkpoint(model, export_dir=out_dir)
    finally:
        hf_logging.set_verbosity(verbosity)


def export_checkpoint(model: nn.Module, root: Path, rel: str, expected: Mapping[str, str],
                      dtype: str) -> dict[str, Any]:
    """``model`` into ``root/rel`` with modelopt's ``export_hf_checkpoint``, the engine directory's tokenizer files
    beside it, then :func:`check_checkpoint`; never raises. Returns the manifest record."""

    out_dir = root / rel
    start = time.perf_counter()
    record: dict[str, Any] = {"dir": rel, "dtype": dtype}
    try:
        write_checkpoint(model, out_dir)
        for name in TOKENIZER_FILES:
            shutil.copyfile(root / name, out_dir / name)
        record["quant_algo"] = check_checkpoint(out_dir, expected)
    except Exception as exc:  # noqa: BLE001 - an export failure is recorded, the build goes on
        shutil.rmtree(out_dir, ignore_errors=True)
        log.warning("hf_export_failed", dir=rel, error=f"{type(exc).__name__}: {exc}")
        record.update(status="failed", error=f"{type(exc).__name__}: {exc}", files=[])
        return record
    record.update(status="exported", error=None, stored_bytes=safetensors_tensor_bytes(out_dir / WEIGHTS_FILE),
                  files=[ed.file_record(root, str(p.relative_to(root))) for p in sorted(out_dir.rglob("*"))
                         if p.is_file()],
                  seconds=round(time.perf_counter() - start, 3))
    return record


def export_full(model: nn.Module, root: Path, dtype: str) -> dict[str, Any]:
    """The unquantized model into ``root/hf/full/``, at ``dtype``; never raises."""
    return export_checkpoint(at_dtype(copy.deepcopy(model), dtype), root, HF_FULL, {}, dtype)


def kv_budget(config: ModelConfig, dtype: str, block_size: int) -> dict[str, Any]:
    """The KV-block assumption the levels' ``kv_blocks_freed`` are computed under."""
    return {
        "kv_block_size": block_size,
        "kv_dtype": dtype,
        "kv_bytes_per_block": kv_bytes_per_block(config, block_size, getattr(torch, dtype)),
        "rule": "kv_blocks_freed = floor(bytes_freed / kv_bytes_per_block)",
        "assumption": (f"a fixed memory budget holding the {dtype} full checkpoint; the weight bytes a level frees "
                       f"become KV blocks of the same engine (KV cache in {dtype}, {block_size}-token blocks = "
                       "serve.config.EngineConfig.block_size; activation and workspace memory unchanged). An engine "
                       "that computes in another dtype or uses other block sizes rescales both."),
    }


def export_levels(root: Path, full: nn.Module, quantized: Mapping[str, nn.Module | None], names: list[str],
                  swap_order: list[int], config: ModelConfig, dtype: str, block_size: int,
                  baseline: dict[str, Any] | None, skipped: list[dict[str, str]],
                  progress: bool = False) -> dict[str, Any]:
    """One unified checkpoint per level into ``root/hf/levels/<level>/``; never raises.

    Returns the manifest's ``levels`` section: the budget assumption, the baseline (``hf/full``), and per level its
    segments and ``{layer: precision}``, the modes that reach it, the checkpoint record, and the bytes it frees
    against the baseline with the KV blocks they buy."""
    budget = kv_budget(config, dtype, block_size)
    full_bytes = (baseline or {}).get("stored_bytes")
    entries: dict[str, Any] = {}
    planned, skipped = lv.plan_levels(names, swap_order, skipped)
    full = unquantized_model(full) if planned else full
    for name, level, layer_precisions in tqdm(planned, desc="export levels (modelopt unified HF)", unit="level",
                                              disable=not progress):
        entry = lv.level_entry(level, layer_precisions, swap_order)
        missing = [p for p in level.precisions if quantized.get(p) is None]
        if missing:
            entry.update(dir=None, status="failed", files=[],
                         error=f"no modelopt model for {missing} (RTN fallback); nothing to export")
        else:
            log.info("exporting_hf_level", level=name, layers=len(layer_precisions))
            model = level_copy(full, quantized, layer_precisions, dtype)  # type: ignore[arg-type]
            entry.update(export_checkpoint(model, root, f"{HF_LEVELS}/{level.dirname}", level_modules(layer_precisions),
                                           dtype))
            del model
            if entry["status"] == "exported" and full_bytes is not None:
                entry["bytes_freed"] = full_bytes - entry["stored_bytes"]
                entry["kv_blocks_freed"] = entry["bytes_freed"] // budget["kv_bytes_per_block"]
        entries[name] = entry
    return {"enabled": True, "format": "modelopt unified Hugging Face checkpoint", "budget": budget,
            "baseline": {"dir": (baseline or {}).get("dir"), "stored_bytes": full_bytes},
            "entries": entries, "skipped": skipped}
