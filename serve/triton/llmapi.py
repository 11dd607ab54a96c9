"""TensorRT-LLM's LLM-API Triton model (``tensorrt_llm``, upstream's ``triton_backend/all_models/llmapi``): its
inputs and outputs, their meanings and defaults, and the translation to and from the engine model's.

Pure numpy: used by ``triton_models/tensorrt_llm/1/model.py`` (a thin model over the engine model).

Upstream's meanings kept here:
- ``text_input`` holds one prompt; ``streaming`` asks for one response per token group (a decoupled model only),
  each carrying the text generated so far (cumulative, as upstream's ``CompletionOutput.text``), never the prompt;
- ``sampling_param_*`` are TensorRT-LLM SamplingParams: absent ones keep its defaults (greedy unless a
  temperature > 0, a top_k > 1 or a top_p < 1 asks for sampling, then at temperature 1; ``max_tokens`` 32;
  ``exclude_input_from_output`` false: a non-streaming answer starts with the prompt);
- ``return_finish_reason`` / ``return_stop_reason`` / ``return_cumulative_logprob`` add those outputs, one
  string / number per answer ("None" while unfinished, as upstream); ``sampling_param_return_perf_metrics`` adds
  the request's perf metrics (times in ns of CLOCK_MONOTONIC, upstream's steady clock; KV blocks; speculation),
  and with them this server's quality outputs (``QUALITY_OUTPUTS``, not upstream's);
- ``stop`` = true with a request id ends the in-flight request of that id (the BLS model does it).

Where this server differs, it says so: outputs carry their declared types (upstream fills its numeric outputs with
decimal strings); a request for something the engine lacks (``sampling_param_best_of`` > 1, LoRA, a logits
post-processor, images) is refused by name, never ignored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from serve.triton.input_error import InputError
from serve.triton.llmapi_config import DEFAULT_MAX_TOKENS
from serve.triton.request_inputs import scalar

InputGetter = Callable[[str], "np.ndarray | None"]

# The inputs of upstream's config.pbtxt -> (engine model input or a role, kind). Kept equal to
# triton_models/tensorrt_llm/config.pbtxt by a test.
SAMPLING_INPUTS: dict[str, str] = {
    "sampling_param_temperature": "temperature", "sampling_param_top_k": "top_k", "sampling_param_top_p": "top_p",
    "sampling_param_frequency_penalty": "frequency_penalty", "sampling_param_presence_penalty": "presence_penalty",
    "sampling_param_max_tokens": "max_tokens", "sampling_param_stop": "stop", "sampling_param_seed": "seed",
    "sampling_param_exclude_input_from_output": "exclude_input_in_output",
    "sampling_param_return_perf_metrics": "return_perf_metrics",
}
OUTPUT_FLAGS = ("return_finish_reason", "return_stop_reason", "return_cumulative_logprob")
REFUSED: dict[str, tuple[Callable[[np.ndarray], bool], str]] = {
    "sampling_param_best_of": (lambda a: a.size > 0 and int(a.reshape(-1)[0]) != 1,
                               "this engine returns one sequence per request; send 1 (or leave it out)"),
    "sampling_param_logits_post_processor_name": (
        lambda a: any(v not in (b"", "") for v in a.reshape(-1)),
        "no logits post-processors are registered on this server (model.yaml has no logits_post_processors)"),
    "lora_id": (lambda a: a.size > 0, "LoRA adapters are not supported"),
    "lora_name": (lambda a: a.size > 0, "LoRA adapters are not supported"),
    "lora_path": (lambda a: a.size > 0, "LoRA adapters are not supported"),
    "lora_ckpt_source": (lambda a: a.size > 0, "LoRA adapters are not supported"),
    "image_url": (lambda a: any(v not in (b"", "") for v in a.reshape(-1)),
                  "images are not supported: this is a text-only engine"),
}
LLMAPI_INPUTS = ("text_input", "streaming", *SAMPLING_INPUTS, *OUTPUT_FLAGS, "stop", *REFUSED)

PERF_OUTPUTS = ("kv_cache_reused_block", "kv_cache_missed_block", "kv_cache_alloc_new_blocks",
                "kv_cache_alloc_total_blocks", "kv_cache_hit_rate", "arrival_time_ns", "first_scheduled_time_ns",
                "first_token_time_ns", "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens",
                "total_draft_tokens")
"""The perf-metric outputs, named as upstream's; the engine model answers them under the same names."""
QUALITY_OUTPUTS = ("quantized_layer_tokens", "kv_8bit_tokens", "quality_samples", "quality_agreement")
"""This server's own per-request quality outputs (docs/quality.md), answered with the perf metrics under
``RequestMetrics.quality_fields``' names (Dynamo's ``engine_data`` keys): output tokens served while some layer was
quantized and while the request read 8-bit KV (of ``num_output_tokens``), the positions the quality meter sampled
and their top-1 agreement with full precision, which is left out until the meter sampled the request."""
ENGINE_OUTPUTS = ("text_output", "finish_reason", "stop_reason", "cum_log_probs", *PERF_OUTPUTS, *QUALITY_OUTPUTS)
ALLOWED_PARAMETERS = frozenset({"Streaming"})
"""Request parameters upstream's own client sends and its model reads nothing of (``llmapi_client.py -S``)."""


@dataclasses.dataclass(frozen=True)
class OutputOptions:
    """Which optional outputs a request asked for, and how its answers are shaped."""

    stream: bool = False
    finish_reason: bool = False
    stop_reason: bool = False
    cumulative_logprob: bool = False
    perf_metrics: bool = False


def _flag(get_input: InputGetter, name: str) -> bool:
    v = scalar(get_input, name, "BOOL")
    return bool(v) if v is not None else False


def is_stop_request(get_input: InputGetter) -> bool:
    """A request with ``stop`` = true: it asks to end the in-flight request of its id, not to generate."""
    return _flag(get_input, "stop")


def check_parameters(parameters: Mapping[str, Any], internal: frozenset[str]) -> None:
    """Request parameters: upstream's model reads none; the ones its own client sends pass, Triton's (``triton_*``)
    and the server's internal ones pass, anything else is refused by name (a sampling option sent under another
    name would otherwise be ignored)."""
    unknown = sorted(k for k in parameters if k not in ALLOWED_PARAMETERS and k not in internal
                     and not k.startswith("triton_"))
    if unknown:
        raise InputError(f"unknown request parameter(s) {unknown[:8]}: the tensorrt_llm model takes its options as "
                         f"inputs (e.g. sampling_param_max_tokens, sampling_param_temperature, streaming); inputs: "
                         f"{', '.join(LLMAPI_INPUTS)}")


def llmapi_to_engine(get_input: InputGetter) -> tuple[dict[str, np.ndarray], OutputOptions]:
    """An LLM-API request -> the engine model's input arrays (upstream's defaults made explicit) and the output
    options the BLS model applies. InputError names a bad or refused input."""
    for name, (asks, why) in REFUSED.items():
        arr = get_input(name)
        if arr is not None and asks(arr):
            raise InputError(f"{name}: {why}")
    text = get_input("text_input")
    if text is None:
        raise InputError("missing required input 'text_input' (TYPE_STRING, shape [1]): the prompt text")
    if text.ndim != 1 or text.size != 1:
        raise InputError(f"text_input must hold one prompt (shape [1]), got shape {list(text.shape)}: send one "
                         "request per prompt")
    out: dict[str, np.ndarray] = {"text_input": text.reshape(1)}
    for name, target in SAMPLING_INPUTS.items():
        arr = get_input(name)
        if arr is None:
            continue
        if target != "stop" and arr.size != 1:
            raise InputError(f"{name} must hold exactly one value, got a tensor of shape {list(arr.shape)}")
        out[target] = arr.reshape(-1)
    _check_ranges(out)
    temperature = float(out["temperature"][0]) if "temperature" in out else None
    top_k = int(out["top_k"][0]) if "top_k" in out else None
    top_p = float(out["top_p"][0]) if "top_p" in out else None
    if top_p == 0.0:  # upstream: 0 means no top-p filter
        out.pop("top_p")
        top_p = None
    samples = (temperature is not None and temperature > 0) or (top_k is not None and top_k > 1) or \
              (top_p is not None and top_p < 1.0)
    if not samples or top_k == 1:
        out["temperature"] = np.array([0.0], dtype=np.float32)
    elif temperature is None:
        out["temperature"] = np.array([1.0], dtype=np.float32)
    out.setdefault("max_tokens", np.array([DEFAULT_MAX_TOKENS], dtype=np.int32))
    out.setdefault("exclude_input_in_output", np.array([False]))
    options = OutputOptions(stream=_flag(get_input, "streaming"),
                            finish_reason=_flag(get_input, "return_finish_reason"),
                            stop_reason=_flag(get_input, "return_stop_reason"),
                            cumulative_logprob=_flag(get_input, "return_cumulative_logprob"),
                            perf_metrics="return_perf_metrics" in out and bool(out["return_perf_metrics"][0]))
    out["stream"] = np.array([options.stream])
    if options.cumulative_logprob:
        out["return_log_probs"] = np.array([True])
    if options.stop_reason:
        out["return_stop_reason"] = np.array([True])
    return out, options


# engine input -> its allowed range: what SamplingParams would refuse, refused here under the LLM-API input's name
_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, math.inf), "top_k": (0, math.inf), "top_p": (0.0, 1.0), "max_tokens": (1, math.inf),
    "frequency_penalty": (-math.inf, math.inf), "presence_penalty": (-math.inf, math.inf),
}
_LLMAPI_NAME = {target: name for name, target in SAMPLING_INPUTS.items()}


def _check_ranges(out: Mapping[str, np.ndarray]) -> None:
    for target, (low, high) in _RANGES.items():
        if target not in out:
            continue
        v = float(out[target][0])
        if not (low <= v <= high) or math.isnan(v) or (math.isinf(v) and target != "top_k"):
            bound = (f"in [{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}" if math.isfinite(low)
                     else "finite")
            raise InputError(f"{_LLMAPI_NAME[target]} must be {bound}, got {v:g}")


FINISH_REASONS = {"length": "length", "stop": "stop", "abort": "cancelled"}
"""The engine model's finish_reason -> upstream's (``CompletionOutput.finish_reason``)."""


def _text(value: str) -> np.ndarray:
    return np.array([value.encode("utf-8")], dtype=np.object_)


def engine_to_llmapi(outs: Mapping[str, np.ndarray], text: str, options: OutputOptions,
                     declared: frozenset[str]) -> dict[str, np.ndarray]:
    """One engine-model response (its output arrays) -> the LLM-API outputs the request asked for. ``text``: what
    ``text_output`` carries (the BLS model accumulates it when streaming); ``declared``: the outputs the
    tensorrt_llm model's config declares."""
    reason = _first_text(outs.get("finish_reason"))
    result: dict[str, np.ndarray] = {"text_output": _text(text)}
    if options.finish_reason:
        result["finish_reason"] = _text(FINISH_REASONS.get(reason, reason) if reason else "None")
    if options.stop_reason:
        result["stop_reason"] = _text(_first_text(outs.get("stop_reason")) or "None")
    if options.cumulative_logprob:
        cum = outs.get("cum_log_probs")
        result["cumulative_logprob"] = np.asarray(cum, dtype=np.float32).reshape(1) if cum is not None else \
            np.array([0.0], dtype=np.float32)
    if options.perf_metrics:
        for name in (*PERF_OUTPUTS, *QUALITY_OUTPUTS):
            if name in outs:
                result[name] = np.asarray(outs[name]).reshape(1)
    return {k: v for k, v in result.items() if k in declared}


def _first_text(arr: np.ndarray | None) -> str:
    if arr is None or arr.size == 0:
        return ""
    v = arr.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, (bytes, np.bytes_)) else str(v)


PERF_DTYPES = {name: np.int64 if name.endswith("_ns") else np.float32 if name
               in ("kv_cache_hit_rate", "acceptance_rate")
               else np.int32 for name in PERF_OUTPUTS}
"""Each perf-metric output's declared type (upstream's config.pbtxt)."""


QUALITY_DTYPES = {name: np.float32 if name == "quality_agreement" else np.int32 for name in QUALITY_OUTPUTS}
"""Each quality output's declared type (the morphserve and tensorrt_llm models' config.pbtxt)."""


def perf_metric_arrays(m: Any, final: bool) -> dict[str, np.ndarray]:
    """A request's ``RequestMetrics`` (serve/engine/outputs.py, read by duck type) -> the perf-metric outputs with
    their declared types (``RequestMetrics.perf_fields`` names them and gives the units), then the quality outputs
    (``quality_fields``; an unsampled request's agreement, None, is left out)."""
    arrays = {name: np.array([v], dtype=PERF_DTYPES[name]) for name, v in m.perf_fields(final).items()}
    arrays.update({name: np.array([v], dtype=QUALITY_DTYPES[name]) for name, v in m.quality_fields().items()
                   if v is not None})
    return arrays
