"""TensorRT-LLM's Triton contract (tensorrtllm_backend's ``ensemble`` and ``tensorrt_llm_bls`` models):
input names and types, request parameters, the inputs this engine cannot honour, and the translation
between a TRT-LLM request (``[batch, ...]`` tensors, TRT-LLM defaults) and the morphserve model's.

Pure numpy: used by the morphserve model (parameters, unsupported inputs) and by the thin BLS models
that serve TensorRT-LLM's names (``triton_models/tensorrt_llm_bls``, ``triton_models/ensemble``).

TensorRT-LLM semantics kept here:
- greedy unless ``top_k`` or ``top_p`` is given (> 0); then ``temperature`` defaults to 1 and a
  ``top_p`` of 0 means "no top-p";
- ``exclude_input_in_output`` defaults to false: a non-streaming answer starts with the prompt;
  streaming answers never repeat it;
- ``random_seed``, ``stop_words``, ``bad_words``, ``min_length``, ``end_id`` (replaces EOS), ``pad_id``
  (no padding with one sequence per request), penalties, ``return_log_probs``, ``guided_decoding_guide_type``
  and ``guided_decoding_guide`` (structured output: json, json_schema, regex, ebnf_grammar, structural_tag);
- ``num_draft_tokens``: TensorRT-LLM's BLS model drafts only when it is > 0, so an explicit 0 opts the request
  out of this engine's self-speculative decoding (as the morphserve input ``speculate`` = false does); a positive
  value asks for a client-chosen draft length, which this engine does not take (docs/speculation.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from serve.request_values import INT32, UINT64, BadValue, check_text, integer, real
from serve.triton.controls import INTERNAL_PARAMETERS, refuse_operator_controls
from serve.triton.input_error import InputError as ContractError

InputGetter = Callable[[str], "np.ndarray | None"]

# Every input the morphserve model declares -> its kind: str, strs (list of strings), int, uint, float,
# bool, tensor (no JSON form). Kept equal to triton_models/morphserve/config.pbtxt by a test.
MORPHSERVE_INPUTS: dict[str, str] = {
    "text_input": "str", "max_tokens": "int", "temperature": "float", "top_p": "float", "top_k": "int",
    "seed": "uint", "stop": "strs", "stream": "bool", "ignore_eos": "bool",
    "ttft_slo_s": "float", "tbt_slo_s": "float", "priority": "int",   # SLO-aware scheduling (README)
    "timeout_s": "float",                                             # per-request deadline (Hardening)
    "speculate": "bool",                                              # false: no speculation (speculation.md)
    "return_stop_reason": "bool",                                     # the final response's stop_reason
    "random_seed": "uint", "stop_words": "strs", "bad_words": "strs", "repetition_penalty": "float",
    "presence_penalty": "float", "frequency_penalty": "float", "length_penalty": "float", "min_length": "int",
    "beam_width": "int", "num_return_sequences": "int", "exclude_input_in_output": "bool",
    "return_log_probs": "bool", "end_id": "int", "pad_id": "int",
    # declared so that a TensorRT-LLM client asking for them gets a clear refusal (UNSUPPORTED)
    "return_context_logits": "bool", "return_generation_logits": "bool", "return_perf_metrics": "bool",
    "lora_task_id": "uint", "lora_weights": "tensor", "lora_config": "tensor",
    "guided_decoding_guide_type": "str", "guided_decoding_guide": "str", "num_draft_tokens": "int",
    "use_draft_logits": "bool", "embedding_bias_words": "strs", "embedding_bias_weights": "tensor",
    "prompt_embedding_table": "tensor", "prompt_vocab_size": "int", "prompt_table_extra_id": "uint",
    "decoder_text_input": "str",
}
# The morphserve-only inputs; every other name is TensorRT-LLM's (what the BLS models declare).
MORPHSERVE_ONLY = ("seed", "stop", "ignore_eos", "ttft_slo_s", "tbt_slo_s", "priority", "timeout_s", "speculate",
                   "return_stop_reason")
TRTLLM_INPUTS = [n for n in MORPHSERVE_INPUTS if n not in MORPHSERVE_ONLY]
# Request-parameter names that mean an input (other names: see MORPHSERVE_INPUTS).
PARAMETER_ALIASES = {"min_tokens": "min_length", "logprobs": "return_log_probs", "max_new_tokens": "max_tokens"}


def _flag(a: np.ndarray) -> bool:
    return bool(a.size) and bool(np.asarray(a).reshape(-1).astype(bool).any())


def _nonempty(a: np.ndarray) -> bool:
    return any(v not in (b"", "") for v in np.asarray(a).reshape(-1)) if a.dtype == np.object_ else a.size > 0


def _positive(a: np.ndarray) -> bool:
    return bool(a.size) and bool((np.asarray(a).reshape(-1) > 0).any())


# input -> (asks for something when, what to tell the client)
UNSUPPORTED: dict[str, tuple[Callable[[np.ndarray], bool], str]] = {
    "return_context_logits": (_flag, "context logits are not returned by this engine"),
    "return_generation_logits": (_flag, "generation logits are not returned by this engine"),
    "lora_task_id": (lambda a: a.size > 0, "LoRA adapters are not supported"),
    "lora_weights": (lambda a: a.size > 0, "LoRA adapters are not supported"),
    "lora_config": (lambda a: a.size > 0, "LoRA adapters are not supported"),
    "num_draft_tokens": (_positive, "a client-chosen draft length is not supported: this engine drafts with its own "
                         "quantized layers and picks the length itself; send 0 (or the morphserve input "
                         "speculate=false) to decode this request without speculation"),
    "use_draft_logits": (_flag, "speculative decoding (draft logits) is not supported"),
    "embedding_bias_words": (_nonempty, "embedding bias is not supported"),
    "embedding_bias_weights": (lambda a: a.size > 0, "embedding bias is not supported"),
    "prompt_embedding_table": (lambda a: a.size > 0, "prompt tuning tables are not supported"),
    "prompt_vocab_size": (_positive, "prompt tuning tables are not supported"),
    "prompt_table_extra_id": (lambda a: a.size > 0, "prompt tuning tables are not supported"),
    "decoder_text_input": (_nonempty, "encoder-decoder models are not supported (decoder-only engine)"),
}


def check_unsupported(get_input: InputGetter) -> None:
    """Refuse, with the reason, any request that asks for a feature the engine cannot honour."""
    for name, (asks, why) in UNSUPPORTED.items():
        arr = get_input(name)
        if arr is not None and asks(arr):
            raise ContractError(f"{name}: {why}")


def _json_to_array(name: str, kind: str, value: Any) -> np.ndarray:
    """One request parameter (a JSON value) -> the array its input would have carried: text checked, integers
    range-checked against the input's type before numpy narrows them (serve/request_values.py), aliases alike."""
    bad = ContractError(f"request parameter {name!r} must be {kind_text(kind)}, got {_short(value)}")
    try:
        if kind == "str":
            if not isinstance(value, str):
                raise bad
            return np.array([check_text(value, name).encode("utf-8")], dtype=np.object_)
        if kind == "strs":
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
                raise bad
            return np.array([check_text(v, name).encode("utf-8") for v in items], dtype=np.object_)
        if kind == "bool":
            if not isinstance(value, bool):
                raise bad
            return np.array([value], dtype=bool)
        if kind in ("int", "uint"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad
            v = integer(value, f"request parameter {name!r}", UINT64 if kind == "uint" else INT32)
            return np.array([v], dtype=np.uint64 if kind == "uint" else np.int32)
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad
            return np.array([real(value, f"request parameter {name!r}")], dtype=np.float32)
    except BadValue as exc:
        raise ContractError(str(exc)) from None
    raise ContractError(f"{name} cannot be sent as a request parameter; send it as an input tensor")


def _short(v: Any) -> str:
    try:
        text = repr(v)
    except ValueError:  # an int too long to print
        return "an integer too long to print"
    return text if len(text) <= 60 else text[:57] + "..."


def kind_text(kind: str) -> str:
    return {"str": "a string", "strs": "a string or a list of strings", "bool": "true or false",
            "int": "an integer", "uint": "an integer >= 0", "float": "a number"}.get(kind, "a tensor")


def parse_parameters(parameters: str | Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    """A request's parameters -> input arrays, by input name. Unknown names and operator controls are refused;
    Triton's own (``triton_*``, e.g. triton_enable_empty_final_response) and the model's internal controls
    (serve/triton/controls.py) are not inputs and are skipped."""
    if not parameters:
        return {}
    params = json.loads(parameters) if isinstance(parameters, str) else dict(parameters)
    for key in params:
        try:
            check_text(key, "a request parameter's name")
        except BadValue as exc:
            raise ContractError(str(exc)) from None
    refuse_operator_controls(params)
    out: dict[str, np.ndarray] = {}
    unknown = []
    for key, value in params.items():
        if key.startswith("triton_") or key in INTERNAL_PARAMETERS:
            continue
        name = PARAMETER_ALIASES.get(key, key)
        if name not in MORPHSERVE_INPUTS:
            unknown.append(key)
            continue
        if name in out:
            raise ContractError(f"request parameter {key!r} repeats {name!r}")
        out[name] = _json_to_array(key, MORPHSERVE_INPUTS[name], value)
    if unknown:
        known = sorted((set(MORPHSERVE_INPUTS) - set(UNSUPPORTED)) | set(PARAMETER_ALIASES))
        raise ContractError(f"unknown request parameter(s) {sorted(unknown)}; known: {', '.join(known)}")
    return out


def with_parameters(get_input: InputGetter, parameters: str | Mapping[str, Any] | None) -> InputGetter:
    """``get_input`` that also sees the request's parameters; an option given both ways is refused."""
    extra = parse_parameters(parameters)
    for name in extra:
        if get_input(name) is not None:
            raise ContractError(f"{name} was given both as an input tensor and as a request parameter")
    if not extra:
        return get_input
    return lambda name: extra[name] if name in extra else get_input(name)


def trtllm_to_morphserve(get_input: InputGetter, parameters: str | Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    """A TensorRT-LLM request (``[1, ...]`` tensors) -> the morphserve model's input arrays, with
    TensorRT-LLM's defaults made explicit (greedy rule, temperature, top_p = 0, exclude_input_in_output)."""
    text = get_input("text_input")
    if text is None:
        raise ContractError("missing required input 'text_input' (TYPE_STRING, shape [1, 1]): the prompt text")
    if text.ndim < 1 or text.shape[0] != 1:
        raise ContractError(f"batch size {text.shape[0] if text.ndim else 0} is not supported: send one prompt "
                            "per request (text_input of shape [1, 1])")

    def unbatched(name: str) -> np.ndarray | None:
        arr = get_input(name)
        if arr is None:
            return None
        if arr.ndim < 1 or arr.shape[0] != 1:
            raise ContractError(f"{name} must have batch size 1 like text_input, got shape {list(arr.shape)}")
        return arr[0]

    full = with_parameters(unbatched, parameters)
    perf = full("return_perf_metrics")
    if perf is not None and _flag(perf):
        raise ContractError("return_perf_metrics: per-request perf metrics are answered by the tensorrt_llm model "
                            "(sampling_param_return_perf_metrics) and the morphserve model, not by the legacy "
                            f"{'/'.join(('ensemble', 'tensorrt_llm_bls'))} models")
    out = {n: a for n in MORPHSERVE_INPUTS if (a := full(n)) is not None}
    top_k = int(out["top_k"].reshape(-1)[0]) if "top_k" in out and out["top_k"].size else 0
    top_p = float(out["top_p"].reshape(-1)[0]) if "top_p" in out and out["top_p"].size else 0.0
    if top_k <= 0 and top_p <= 0.0:  # TensorRT-LLM: no top-k and no top-p means greedy
        out["temperature"] = np.array([0.0], dtype=np.float32)
        out.pop("top_k", None)
        out.pop("top_p", None)
    else:
        out.setdefault("temperature", np.array([1.0], dtype=np.float32))
        if top_p <= 0.0:
            out.pop("top_p", None)
    out.setdefault("exclude_input_in_output", np.array([False]))
    return out


def batched(outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The morphserve model's output arrays -> TensorRT-LLM's shapes: a leading batch dimension of 1,
    output_log_probs also the beam dimension ([1, 1, n]); text_output stays [1] (batch x beams, flat,
    as TensorRT-LLM's postprocessing answers and its client script reads it); batch_index and
    sequence_index added."""
    out = {name: (arr if name == "text_output" else arr[None]) for name, arr in outputs.items()}
    if "output_log_probs" in out:
        out["output_log_probs"] = out["output_log_probs"][None]
    out["batch_index"] = np.zeros((1, 1), dtype=np.int32)
    out["sequence_index"] = np.zeros((1, 1), dtype=np.int32)
    return out
