"""EngineConfig fields as command-line flags, in one place.

Every entry point that exposes engine settings (``python -m serve.triton``, ``python -m serve.dynamo``,
``python -m bench.replay``, ``python -m serve.generate``) adds them with :func:`add_engine_flags` and reads them
back with :func:`engine_kwargs`. The flag name (``--max-num-seqs`` for ``max_num_seqs``), its type (from the
field's annotation: ``int | None`` -> int, ``bool`` -> ``--x/--no-x``), its choices and its help text live here
once; an entry point picks the fields it exposes and may give a default of its own (bench.replay runs 2 threads)
or an older spelling kept for the commands in the docs (``--threads``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from policy.precisions import KV_CACHE_DTYPES
from policy.speculation import SPECULATION_MODES
from serve.config import EMBEDDED_MODEL, PREFIX_CACHE_ACROSS_MORPH, SCHEDULERS, EngineConfig, without_none

ENGINE_FLAG_HELP: dict[str, str] = {
    "model": f"engine directory, embedded model name ({EMBEDDED_MODEL!r}), .gguf file or Hugging Face directory",
    "level": "serve one morph level of the engine directory given as the model (its name, e.g. int4@25, or its "
             "directory under hf/levels/): its unified checkpoint, static (morph mode off)",
    "device": "cpu, cuda, cuda:N or auto (CUDA when available)",
    "dtype": "model dtype",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "fixed KV pool size in blocks (overrides --kv-cache-memory)",
    "kv_cache_memory": "KV pool size when no memory budget is given; set, it also keeps device_memory=auto off the "
                       "pool",
    "kv_cache_dtype": "KV-cache storage: auto (the model dtype), int8 (int8 codes + per token-head scales, ~3.75x "
                      "the KV tokens of fp32 in the same memory) or fp8 (e4m3 codes + scales, CUDA only)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "token budget of one engine step",
    "enable_prefix_caching": "reuse the KV of prompt prefixes seen before (vLLM's automatic prefix caching)",
    "prefix_cache_across_morph": "after a layer changes precision, serve cached prefixes only under the configuration "
                                 "that computed them (exact) or under any (preserve); docs/morphing.md",
    "max_model_len": "longest prompt + output in tokens",
    "num_threads": "torch intra-op threads",
    "morph_mode": "layer-morphing mode: off, static-int8, static-int4, accuracy, default, performance",
    "device_memory": "memory budget for weights + KV cache + reserve: a size (600MiB), on CUDA a fraction of the "
                     "device (0.9), or auto; sizes the KV pool with morphing",
    "memory_floor": "yield: below this much free memory outside the engine (NVML on CUDA, the host on CPU) quantize "
                    "layers and give the bytes back; 0 arms only the operator's yield control (Triton: the operator "
                    "port's /engine/control/memory_yield; Dynamo: the system port's) (docs/memory-yield.md)",
    "memory_reclaim_mark": "take yielded bytes back only while this much stays free after",
    "memory_pressure_source": "where outside free memory is read (auto: NVML on CUDA, the host on CPU)",
    "slo_ttft_s": "TTFT service-level objective in seconds (the morph controller's target and the default "
                  "per-request target)",
    "scheduler": "scheduling policy: fcfs (vLLM-style) or slai (SLO-aware)",
    "slai_theta": "fixed theta for slai",
    "max_num_waiting": "admitted requests not yet running; past it a new one is refused at once: 503 + Retry-After "
                       "\"overloaded ... retry later\"",
    "queue_timeout_s": "a request without its first token this many seconds after arrival is shed: 503 + Retry-After "
                       "\"overloaded ... retry later\" (0: no queue deadline)",
    "shed_on_arrival": "with a queue deadline, refuse at once (503 + Retry-After) a request that the measured start "
                       "rate says cannot start within it",
    "speculation": "self-speculative decoding with the engine's own quantized layers as the draft, output from full "
                   "precision: auto (the controller drafts when the measured step costs and the acceptance rate say "
                   "it pays, never under KV pressure or with prefill in the batch), always, or off "
                   "(docs/speculation.md)",
    "quality_meter": "most fraction of measured step time the quality meter spends comparing sampled positions with "
                     "full precision while layers are quantized or KV is 8-bit (0: off) (docs/quality.md)",
    "request_timeout_s": "deadline in seconds of a request that names no timeout_s: past it the request ends with "
                         "deadline exceeded (HTTP 504)",
}

UNSET_MEANS: dict[str, str] = {
    "level": "the model itself",
    "dtype": "float32 on CPU, bfloat16 on CUDA",
    "enable_prefix_caching": "on",
    "kv_cache_dtype": "auto",
    "kv_cache_memory": "1GiB",
    "prefix_cache_across_morph": "exact",
    "max_model_len": "the model's context length",
    "num_threads": "torch's choice",
    "memory_floor": "off",
    "memory_reclaim_mark": "the floor",
    "memory_pressure_source": "auto",
    "slai_theta": "dynamic, slai_theta_low / slai_theta_high",
    "shed_on_arrival": "on",
    "max_num_waiting": "unbounded",
    "request_timeout_s": "none",
    "speculation": "auto",
}
"""What leaving a flag out means, where the entry point has no default of its own (EngineConfig's, or the
model config's for serve.triton)."""

ENGINE_FLAG_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("float32", "bfloat16", "float16"),
    "scheduler": SCHEDULERS,
    "prefix_cache_across_morph": PREFIX_CACHE_ACROSS_MORPH,
    "memory_pressure_source": ("auto", "nvml", "host", "none"),
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "speculation": SPECULATION_MODES,
}


def flag_name(field: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + field.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, fields: Iterable[str], *,
                     defaults: Mapping[str, Any] | None = None, aliases: Mapping[str, Iterable[str]] | None = None,
                     help_suffix: str = "", help_overrides: Mapping[str, str] | None = None) -> None:
    """Add one flag per EngineConfig field in ``fields``; its value lands in ``args.<field>``.

    defaults: the entry point's own defaults (else None: the field is left to EngineConfig or config.pbtxt).
    aliases: older flag spellings that still work. help_suffix: appended to every help, with ``{field}`` filled
    (serve.triton adds "(parameter {field})"). help_overrides: where an entry point's meaning of the field differs.
    """
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    hints = typing.get_type_hints(EngineConfig)
    defaults, aliases, help_overrides = defaults or {}, aliases or {}, help_overrides or {}
    for field in fields:
        if field not in known:
            raise ValueError(f"{field!r} is not an EngineConfig field")
        text = help_overrides.get(field, ENGINE_FLAG_HELP.get(field, field.replace("_", " ")))
        if defaults.get(field) is not None:
            text += " (default: %(default)s)"
        elif field in UNSET_MEANS:
            text += f" (default: {UNSET_MEANS[field]})"
        kwargs: dict[str, Any] = {"dest": field, "default": defaults.get(field),
                                  "help": text + help_suffix.format(field=field)}
        typ = without_none(hints[field])
        if typ is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = typ if typ in (int, float) else str
            if field in ENGINE_FLAG_CHOICES:
                kwargs["choices"] = ENGINE_FLAG_CHOICES[field]
        parser.add_argument(flag_name(field), *aliases.get(field, ()), **kwargs)


def engine_kwargs(args: argparse.Namespace, fields: Iterable[str]) -> dict[str, Any]:
    """The EngineConfig keyword arguments the command line set (fields left at None are omitted)."""
    return {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
