"""``tensorrt_llm/1/model.yaml``: the configuration of the LLM-API model in TensorRT-LLM's own layout.

TensorRT-LLM's LLM-API Triton model reads ``model.yaml`` next to its ``model.py``: every top-level key but
``triton_config`` is an argument of ``LLM()``, and ``triton_config`` holds the Triton side (``max_batch_size``,
``decoupled``, ``cancellation_check_period_ms``). This file keeps that layout. The LLM() arguments this engine
has an equivalent for are read with upstream's names and meanings; everything MorphServe adds sits under its own
key, ``morphserve``::

    model: engines/smollm2-135m          # LLM(model=...): an engine directory, a .gguf file or a HF directory
    backend: pytorch                     # the only backend upstream still has
    tensor_parallel_size: 1
    max_batch_size: 32                   # running sequences (EngineConfig.max_num_seqs)
    kv_cache_config:
      enable_block_reuse: true           # prefix caching
      dtype: auto                        # auto | int8 | fp8
    speculative_config: null             # null: no speculation (this engine drafts with its own layers)
    morphserve:
      morph_mode: default                # any EngineConfig field, plus the BLS model's settings below
      stop_by_request_id: true           # a request with stop=true ends the in-flight request of its id
    triton_config:
      max_batch_size: 0
      decoupled: true

A key this module does not know fails the load, naming it (upstream hands unknown keys to ``LLM()``, which
refuses them too). The engine model (``morphserve``) serves the engine for every model of the repository; it
reads this file when its ``llmapi_config`` parameter names it, and the values here win over its config.pbtxt
(``python -m serve.triton`` writes both from the same settings, so they agree unless someone edits one).

Pure (stdlib + PyYAML): read by the Triton models and written by the repository writer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import yaml

ENGINE_MODEL = "morphserve"
DEFAULT_MAX_TOKENS = 32
"""What ``sampling_param_max_tokens`` is when a request sends none: TensorRT-LLM's SamplingParams default."""

# LLM() argument -> EngineConfig field, where the meaning is the same.
LLM_ARGS = {"model": "model", "max_batch_size": "max_num_seqs", "max_num_tokens": "max_num_batched_tokens",
            "max_seq_len": "max_model_len", "dtype": "dtype"}
# kv_cache_config key -> EngineConfig field.
KV_CACHE_ARGS = {"enable_block_reuse": "enable_prefix_caching", "dtype": "kv_cache_dtype",
                 "free_gpu_memory_fraction": "device_memory"}
# LLM() arguments accepted only at the value this engine runs with.
FIXED_ARGS: dict[str, tuple[Any, str]] = {
    "backend": ("pytorch", "the engine behind this model is MorphServe's PyTorch engine (TensorRT-LLM removed its "
                           "TensorRT-engine backend)"),
    "tensor_parallel_size": (1, "one device per engine; scale out with replicas (make serve-dynamo)"),
    "pipeline_parallel_size": (1, "one device per engine; scale out with replicas (make serve-dynamo)"),
}
# Keys of the ``morphserve`` section the BLS model reads (everything else there is an EngineConfig field).
FRONT_KEYS = ("engine_model", "stop_by_request_id")
TRITON_KEYS = ("max_batch_size", "decoupled", "cancellation_check_period_ms")
TOP_KEYS = (*LLM_ARGS, *FIXED_ARGS, "kv_cache_config", "speculative_config", "morphserve", "triton_config")


class ModelYamlError(ValueError):
    """model.yaml is not valid for this server; the message names the key."""


@dataclasses.dataclass(frozen=True)
class BlsSettings:
    """What the ``tensorrt_llm`` model itself does with a request (not the engine's configuration)."""

    engine_model: str = ENGINE_MODEL   # the Triton model that hosts the engine
    stop_by_request_id: bool = True    # stop=true ends the in-flight request of the same id (docs/hardening.md)
    decoupled: bool = True             # triton_config.decoupled: streaming needs it
    cancellation_check_period_ms: int = 100


@dataclasses.dataclass(frozen=True)
class LlmApiConfig:
    engine: dict[str, Any]             # EngineConfig field -> value (only the keys the file sets)
    bls: BlsSettings


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ModelYamlError(f"model.yaml: {key} must be true or false, got {value!r}")
    return value


def _int(value: Any, key: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ModelYamlError(f"model.yaml: {key} must be an integer >= {low}, got {value!r}")
    return value


def _section(value: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ModelYamlError(f"model.yaml: {key} must be a mapping, got {type(value).__name__}")
    return value


def _unknown(keys: Any, known: tuple[str, ...], where: str) -> None:
    bad = sorted(str(k) for k in keys if k not in known)
    if bad:
        raise ModelYamlError(f"model.yaml: unknown key(s) {', '.join(where + k for k in bad)}; known here: "
                             f"{', '.join(known)}")


def parse_model_yaml(text: str, engine_fields: tuple[str, ...]) -> LlmApiConfig:
    """model.yaml's text -> the engine settings it makes and the BLS model's; ModelYamlError names a bad key.
    ``engine_fields``: EngineConfig's field names (a ``morphserve`` key may set any of them)."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ModelYamlError(f"model.yaml is not valid YAML: {exc}") from None
    doc = _section(raw if raw is not None else {}, "the document")
    _unknown(doc, TOP_KEYS, "")
    engine: dict[str, Any] = {}
    for key, (value, why) in FIXED_ARGS.items():
        if key in doc and doc[key] != value:
            raise ModelYamlError(f"model.yaml: {key} must be {value!r}, got {doc[key]!r}: {why}")
    for key, field in LLM_ARGS.items():
        if key in doc and doc[key] is not None:
            engine[field] = doc[key]
    if doc.get("dtype") == "auto":
        engine.pop("dtype")
    kv = _section(doc.get("kv_cache_config") or {}, "kv_cache_config")
    _unknown(kv, tuple(KV_CACHE_ARGS), "kv_cache_config.")
    for key, field in KV_CACHE_ARGS.items():
        if key in kv and kv[key] is not None:
            engine[field] = str(kv[key]) if key == "free_gpu_memory_fraction" else kv[key]
    if "speculative_config" in doc:
        if doc["speculative_config"] is not None:
            raise ModelYamlError("model.yaml: speculative_config takes no draft model (Eagle, MTP, Draft_Target, "
                                 "NGram are not supported): this engine drafts with its own quantized layers. Write "
                                 "speculative_config: null for no speculation, or set morphserve.speculation "
                                 "(off | auto | always)")
        engine["speculation"] = "off"
    own = _section(doc.get("morphserve") or {}, "morphserve")
    _unknown(own, (*FRONT_KEYS, *engine_fields), "morphserve.")
    for key, value in own.items():
        if key in FRONT_KEYS:
            continue
        if key in engine:
            raise ModelYamlError(f"model.yaml: morphserve.{key} repeats a setting made above with TensorRT-LLM's "
                                 "name; keep one")
        engine[key] = value
    triton = _section(doc.get("triton_config") or {}, "triton_config")
    _unknown(triton, TRITON_KEYS, "triton_config.")
    if _int(triton.get("max_batch_size", 0), "triton_config.max_batch_size", 0) != 0:
        raise ModelYamlError("model.yaml: triton_config.max_batch_size must be 0 (one prompt per request, as "
                             "upstream's model: the engine batches requests itself)")
    engine_model = own.get("engine_model", ENGINE_MODEL)
    if not isinstance(engine_model, str) or not engine_model:
        raise ModelYamlError(f"model.yaml: morphserve.engine_model must be a model name, got {engine_model!r}")
    bls = BlsSettings(
        engine_model=engine_model,
        stop_by_request_id=_bool(own.get("stop_by_request_id", True), "morphserve.stop_by_request_id"),
        decoupled=_bool(triton.get("decoupled", True), "triton_config.decoupled"),
        cancellation_check_period_ms=_int(triton.get("cancellation_check_period_ms", 100),
                                          "triton_config.cancellation_check_period_ms", 1))
    return LlmApiConfig(engine, bls)


# EngineConfig field -> where overlay_model_yaml writes it (the inverse of the tables above).
_WRITE_AT = {**{f: (k,) for k, f in LLM_ARGS.items()},
             **{f: ("kv_cache_config", k) for k, f in KV_CACHE_ARGS.items() if k != "free_gpu_memory_fraction"}}
_HEADER = ("# TensorRT-LLM's LLM-API model configuration (serve/triton/llmapi_config.py): LLM() arguments by their\n"
           "# upstream names, MorphServe's own settings under `morphserve`, the Triton side under `triton_config`.\n")


def _drop(doc: dict[str, Any], field: str) -> None:
    """Remove every place ``field`` may be set in ``doc``."""
    for key, f in LLM_ARGS.items():
        if f == field:
            doc.pop(key, None)
    kv = doc.get("kv_cache_config")
    if isinstance(kv, dict):
        for key, f in KV_CACHE_ARGS.items():
            if f == field:
                kv.pop(key, None)
        if not kv:
            doc.pop("kv_cache_config")
    if field == "speculation":
        doc.pop("speculative_config", None)
    own = doc.get("morphserve")
    if isinstance(own, dict):
        own.pop(field, None)


def overlay_model_yaml(text: str, engine: Mapping[str, Any], bls: BlsSettings | None = None) -> str:
    """``text`` (a model.yaml) with ``engine``'s settings (EngineConfig field -> value; None or "" removes the
    setting, so the engine's default applies) and, when given, ``bls``'s written over it: TensorRT-LLM's names
    where they exist, the rest under ``morphserve``. What ``engine`` does not name is kept as it was."""
    raw = yaml.safe_load(text) if text.strip() else {}
    doc: dict[str, Any] = dict(_section(raw if raw is not None else {}, "the document"))
    for field, value in engine.items():
        _drop(doc, field)
        if value is None or value == "":
            continue
        if field == "speculation" and value == "off":
            doc["speculative_config"] = None
            continue
        where = _WRITE_AT.get(field)
        if where is None:
            doc.setdefault("morphserve", {})[field] = value
        elif len(where) == 1:
            doc[where[0]] = value
        else:
            doc.setdefault(where[0], {})[where[1]] = value
    doc.setdefault("backend", "pytorch")
    doc.setdefault("tensor_parallel_size", 1)
    if bls is not None:
        own = doc.setdefault("morphserve", {})
        if bls.engine_model != ENGINE_MODEL:
            own["engine_model"] = bls.engine_model
        own["stop_by_request_id"] = bls.stop_by_request_id
        doc["triton_config"] = {**(doc.get("triton_config") or {}), "max_batch_size": 0, "decoupled": bls.decoupled,
                                "cancellation_check_period_ms": bls.cancellation_check_period_ms}
    order = [*LLM_ARGS, *FIXED_ARGS, "kv_cache_config", "speculative_config", "morphserve", "triton_config"]
    ordered = {k: doc[k] for k in sorted(doc, key=lambda k: order.index(k) if k in order else len(order))}
    return _HEADER + yaml.safe_dump(ordered, sort_keys=False, default_flow_style=False)
