"""TensorRT-LLM's LLM-API model contract without a server: declared inputs and outputs, request translation,
upstream's defaults, refusals by name, and model.yaml."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from serve.config import EngineConfig
from serve.triton.input_error import InputError
from serve.triton.llmapi import (
    LLMAPI_INPUTS,
    PERF_OUTPUTS,
    QUALITY_OUTPUTS,
    OutputOptions,
    check_parameters,
    engine_to_llmapi,
    is_stop_request,
    llmapi_to_engine,
    perf_metric_arrays,
)
from serve.triton.llmapi_config import BlsSettings, ModelYamlError, overlay_model_yaml, parse_model_yaml
from serve.triton.model_params import engine_config_kwargs
from serve.triton.repository import DEFAULT_MODEL_REPOSITORY, engine_settings, read_config_parameters
from serve.triton.trtllm import MORPHSERVE_INPUTS

# Upstream's triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt (TensorRT-LLM, 2026): name -> (type, dims).
UPSTREAM_INPUTS = {
    "text_input": ("TYPE_STRING", "-1"), "streaming": ("TYPE_BOOL", "1"),
    "sampling_param_best_of": ("TYPE_INT32", "1"), "sampling_param_temperature": ("TYPE_FP32", "1"),
    "sampling_param_top_k": ("TYPE_INT32", "1"), "sampling_param_top_p": ("TYPE_FP32", "1"),
    "sampling_param_frequency_penalty": ("TYPE_FP32", "1"), "sampling_param_presence_penalty": ("TYPE_FP32", "1"),
    "sampling_param_max_tokens": ("TYPE_INT32", "1"), "sampling_param_stop": ("TYPE_STRING", "-1"),
    "sampling_param_seed": ("TYPE_UINT64", "1"), "sampling_param_exclude_input_from_output": ("TYPE_BOOL", "1"),
    "sampling_param_return_perf_metrics": ("TYPE_BOOL", "1"),
    "sampling_param_logits_post_processor_name": ("TYPE_STRING", "1"),
    "return_finish_reason": ("TYPE_BOOL", "1"), "return_stop_reason": ("TYPE_BOOL", "1"),
    "return_cumulative_logprob": ("TYPE_BOOL", "1"), "stop": ("TYPE_BOOL", "1"),
    "lora_id": ("TYPE_UINT64", "1"), "lora_name": ("TYPE_STRING", "1"), "lora_path": ("TYPE_STRING", "1"),
    "lora_ckpt_source": ("TYPE_STRING", "1"),
}
UPSTREAM_OUTPUTS = {
    "text_output": ("TYPE_STRING", "-1"), "finish_reason": ("TYPE_STRING", "-1"), "stop_reason": ("TYPE_STRING", "-1"),
    "cumulative_logprob": ("TYPE_FP32", "-1"), "kv_cache_reused_block": ("TYPE_INT32", "-1"),
    "kv_cache_missed_block": ("TYPE_INT32", "-1"), "kv_cache_alloc_new_blocks": ("TYPE_INT32", "-1"),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", "-1"), "kv_cache_hit_rate": ("TYPE_FP32", "-1"),
    "arrival_time_ns": ("TYPE_INT64", "1"), "first_scheduled_time_ns": ("TYPE_INT64", "1"),
    "first_token_time_ns": ("TYPE_INT64", "1"), "last_token_time_ns": ("TYPE_INT64", "1"),
    "acceptance_rate": ("TYPE_FP32", "1"), "total_accepted_draft_tokens": ("TYPE_INT32", "1"),
    "total_draft_tokens": ("TYPE_INT32", "1"),
}
# This server's own quality outputs (docs/quality.md), declared by both models beside upstream's.
OUR_OUTPUTS = {"quantized_layer_tokens": ("TYPE_INT32", "1"), "kv_8bit_tokens": ("TYPE_INT32", "1"),
               "quality_samples": ("TYPE_INT32", "1"), "quality_agreement": ("TYPE_FP32", "1")}
FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def _declared(model: str, block: str) -> dict[str, tuple[str, str]]:
    text = (DEFAULT_MODEL_REPOSITORY / model / "config.pbtxt").read_text()
    part = text[text.index("input ["):text.index("output [")] if block == "input" else text[text.index("output ["):]
    found = re.findall(r'name:\s*"([^"]+)"\s*data_type:\s*(\w+)\s*dims:\s*\[\s*(-?\d+)\s*\]', part)
    return {n: (t, d) for n, t, d in found}


def test_the_model_declares_upstreams_inputs_and_outputs() -> None:
    inputs = _declared("tensorrt_llm", "input")
    assert {k: v for k, v in inputs.items() if k in UPSTREAM_INPUTS} == UPSTREAM_INPUTS
    assert set(inputs) == set(LLMAPI_INPUTS) == {*UPSTREAM_INPUTS, "image_url"}
    assert _declared("tensorrt_llm", "output") == {**UPSTREAM_OUTPUTS, **OUR_OUTPUTS}
    assert tuple(OUR_OUTPUTS) == QUALITY_OUTPUTS
    morph_outputs = _declared("morphserve", "output")
    for name in PERF_OUTPUTS:  # the engine model answers them under the same names and types
        assert morph_outputs[name] == UPSTREAM_OUTPUTS[name], name
    for name in QUALITY_OUTPUTS:
        assert morph_outputs[name] == OUR_OUTPUTS[name], name
    assert "max_batch_size: 0" in (DEFAULT_MODEL_REPOSITORY / "tensorrt_llm" / "config.pbtxt").read_text()


def _get(**arrays: np.ndarray):
    base = {"text_input": np.array([b"What is ML?"], dtype=np.object_)}
    merged = {**base, **arrays}
    return lambda name: merged.get(name)


def test_upstream_defaults_made_explicit() -> None:
    arrays, options = llmapi_to_engine(_get())
    assert arrays["max_tokens"].tolist() == [32]           # TensorRT-LLM SamplingParams.max_tokens
    assert arrays["exclude_input_in_output"].tolist() == [False]  # the Triton model's default: the prompt is echoed
    assert arrays["temperature"].tolist() == [0.0]         # nothing asks for sampling: greedy
    assert arrays["stream"].tolist() == [False]
    assert set(arrays) <= set(MORPHSERVE_INPUTS)
    assert options == OutputOptions()


@pytest.mark.parametrize("given, temperature", [
    ({"sampling_param_top_k": np.array([1], dtype=np.int32), "sampling_param_temperature": np.array([0.8], np.float32)},
     0.0),
    ({"sampling_param_top_k": np.array([40], dtype=np.int32)}, 1.0),
    ({"sampling_param_top_p": np.array([0.9], dtype=np.float32)}, 1.0),
    ({"sampling_param_top_p": np.array([0.0], dtype=np.float32)}, 0.0),
    ({"sampling_param_temperature": np.array([0.7], dtype=np.float32)}, pytest.approx(0.7)),
    ({"sampling_param_temperature": np.array([0.0], dtype=np.float32)}, 0.0),
])
def test_greedy_unless_sampling_is_asked_for(given, temperature) -> None:
    arrays, _ = llmapi_to_engine(_get(**given))
    assert arrays["temperature"][0] == temperature
    if "sampling_param_top_p" in given and given["sampling_param_top_p"][0] == 0.0:
        assert "top_p" not in arrays  # 0: no top-p filter


def test_inputs_map_to_the_engine_models() -> None:
    arrays, options = llmapi_to_engine(_get(
        sampling_param_max_tokens=np.array([7], dtype=np.int32), sampling_param_seed=np.array([5], dtype=np.uint64),
        sampling_param_stop=np.array([b"\n", b"stop"], dtype=np.object_), streaming=np.array([True]),
        sampling_param_exclude_input_from_output=np.array([True]), return_cumulative_logprob=np.array([True]),
        sampling_param_return_perf_metrics=np.array([True]),
        sampling_param_presence_penalty=np.array([0.5], np.float32),
        return_finish_reason=np.array([True]), return_stop_reason=np.array([True])))
    assert arrays["max_tokens"].tolist() == [7] and arrays["seed"].tolist() == [5]
    assert arrays["stop"].tolist() == [b"\n", b"stop"] and arrays["stream"].tolist() == [True]
    assert arrays["exclude_input_in_output"].tolist() == [True] and arrays["return_log_probs"].tolist() == [True]
    assert arrays["return_perf_metrics"].tolist() == [True] and arrays["presence_penalty"].tolist() == [0.5]
    assert arrays["return_stop_reason"].tolist() == [True]
    assert options == OutputOptions(stream=True, finish_reason=True, stop_reason=True, cumulative_logprob=True,
                                    perf_metrics=True)


@pytest.mark.parametrize("name, value", [
    ("sampling_param_best_of", np.array([2], dtype=np.int32)),
    ("lora_id", np.array([0], dtype=np.uint64)),
    ("lora_name", np.array([b"x"], dtype=np.object_)),
    ("lora_path", np.array([b"/tmp"], dtype=np.object_)),
    ("lora_ckpt_source", np.array([b"hf"], dtype=np.object_)),
    ("image_url", np.array([b"http://127.0.0.1/x.png"], dtype=np.object_)),
    ("sampling_param_logits_post_processor_name", np.array([b"ban"], dtype=np.object_)),
])
def test_what_the_engine_lacks_is_refused_by_name(name, value) -> None:
    with pytest.raises(InputError, match=name):
        llmapi_to_engine(_get(**{name: value}))


def test_best_of_one_and_empty_names_are_accepted() -> None:
    llmapi_to_engine(_get(sampling_param_best_of=np.array([1], dtype=np.int32),
                          sampling_param_logits_post_processor_name=np.array([b""], dtype=np.object_)))


def test_one_prompt_per_request() -> None:
    with pytest.raises(InputError, match="one prompt"):
        llmapi_to_engine(_get(text_input=np.array([b"a", b"b"], dtype=np.object_)))
    with pytest.raises(InputError, match="text_input"):
        llmapi_to_engine(lambda name: None)


def test_stop_and_parameters() -> None:
    assert is_stop_request(_get(stop=np.array([True]))) and not is_stop_request(_get())
    check_parameters({"Streaming": True, "triton_enable_empty_final_response": True, "morphserve_arrival_s": 1.0},
                     frozenset({"morphserve_arrival_s"}))
    with pytest.raises(InputError, match="max_tokens"):
        check_parameters({"max_tokens": 16}, frozenset())


def test_engine_outputs_map_back() -> None:
    outs = {"text_output": np.array([b"x"], dtype=np.object_), "finish_reason": np.array([b"abort"], dtype=np.object_),
            "stop_reason": np.array([b"\n"], dtype=np.object_), "cum_log_probs": np.array([-1.5], dtype=np.float32),
            "kv_cache_reused_block": np.array([3], dtype=np.int32), "arrival_time_ns": np.array([10], dtype=np.int64)}
    declared = frozenset(n for n in UPSTREAM_OUTPUTS)
    got = engine_to_llmapi(outs, "so far", OutputOptions(finish_reason=True, stop_reason=True, cumulative_logprob=True,
                                                         perf_metrics=True), declared)
    assert got["text_output"].tolist() == [b"so far"]
    assert got["finish_reason"].tolist() == [b"cancelled"] and got["stop_reason"].tolist() == [b"\n"]
    assert got["cumulative_logprob"].tolist() == [-1.5] and got["kv_cache_reused_block"].tolist() == [3]
    assert got["arrival_time_ns"].dtype == np.int64
    plain = engine_to_llmapi({"text_output": outs["text_output"]}, "x", OutputOptions(finish_reason=True), declared)
    assert plain["finish_reason"].tolist() == [b"None"]  # unfinished, as upstream says it
    assert set(engine_to_llmapi(outs, "x", OutputOptions(), declared)) == {"text_output"}


def test_quality_outputs_are_the_requests_counts_with_their_declared_types() -> None:
    """The engine model's arrays from a request's RequestMetrics: the counts under RequestMetrics' names with the
    declared types, the agreement only once sampled; the LLM-API model passes them on with the perf metrics."""
    from serve.engine.outputs import RequestMetrics

    sampled = perf_metric_arrays(RequestMetrics(1.0, quantized_layer_tokens=6, kv_8bit_tokens=2, quality_samples=4,
                                                quality_agreed=3), final=True)
    assert {n: (a.tolist(), a.dtype) for n, a in sampled.items() if n in QUALITY_OUTPUTS} == {
        "quantized_layer_tokens": ([6], np.int32), "kv_8bit_tokens": ([2], np.int32),
        "quality_samples": ([4], np.int32), "quality_agreement": ([0.75], np.float32)}
    unsampled = perf_metric_arrays(RequestMetrics(1.0, quantized_layer_tokens=6), final=False)
    assert "quality_agreement" not in unsampled and unsampled["quality_samples"].tolist() == [0]
    declared = frozenset({*UPSTREAM_OUTPUTS, *OUR_OUTPUTS})
    got = engine_to_llmapi({"text_output": np.array([b"x"], dtype=np.object_), **sampled}, "x",
                           OutputOptions(perf_metrics=True), declared)
    assert got["quality_agreement"].tolist() == [0.75] and got["quantized_layer_tokens"].tolist() == [6]
    assert not set(engine_to_llmapi(sampled, "x", OutputOptions(), declared)) & set(QUALITY_OUTPUTS)


def test_model_yaml_round_trip() -> None:
    engine = {"model": "/m", "max_num_seqs": 8, "enable_prefix_caching": False, "kv_cache_dtype": "int8",
              "morph_mode": "default", "device_memory": "auto", "speculation": "off",
              "policy_overrides": {"kv_high": 0.7}}
    bls = BlsSettings(stop_by_request_id=False, decoupled=False, cancellation_check_period_ms=50)
    text = overlay_model_yaml("", engine, bls)
    assert "max_batch_size: 8" in text and "enable_block_reuse: false" in text and "speculative_config: null" in text
    parsed = parse_model_yaml(text, FIELDS)
    assert parsed.engine == engine and parsed.bls == bls
    # written over: the settings named change (a cleared one goes), the rest stays
    again = parse_model_yaml(overlay_model_yaml(text, {"max_num_seqs": 4, "kv_cache_dtype": None,
                                                       "speculation": "auto"}), FIELDS)
    assert again.engine == {**{k: v for k, v in engine.items() if k != "kv_cache_dtype"}, "max_num_seqs": 4,
                            "speculation": "auto"}
    assert again.bls == bls


def test_the_shipped_model_yaml_says_what_the_engine_models_config_says() -> None:
    """The tensorrt_llm model's model.yaml and the morphserve model's config.pbtxt, as shipped, configure the same
    engine (model.yaml wins where both set a value, so they must agree)."""
    shipped = parse_model_yaml((DEFAULT_MODEL_REPOSITORY / "tensorrt_llm" / "1" / "model.yaml").read_text(), FIELDS)
    params = read_config_parameters((DEFAULT_MODEL_REPOSITORY / "morphserve" / "config.pbtxt").read_text())
    pbtxt, _ = engine_config_kwargs(params, EngineConfig, DEFAULT_MODEL_REPOSITORY.parent)
    for field, value in shipped.engine.items():
        assert pbtxt.get(field, getattr(EngineConfig(), field)) == value, field
    assert shipped.bls.decoupled  # the shipped model streams (its config.pbtxt is decoupled)
    assert "decoupled: true" in (DEFAULT_MODEL_REPOSITORY / "tensorrt_llm" / "config.pbtxt").read_text()
    assert engine_settings({"engine_dir": "x", "max_num_seqs": 4, "max_tokens_limit": 9, "scheduler": ""}) == {
        "model": "x", "max_num_seqs": 4, "scheduler": None}


@pytest.mark.parametrize("text, named", [
    ("modle: x\n", "modle"),
    ("kv_cache_config:\n  enable_blok_reuse: true\n", "kv_cache_config.enable_blok_reuse"),
    ("morphserve:\n  morph_mod: default\n", "morphserve.morph_mod"),
    ("triton_config:\n  decoupld: true\n", "triton_config.decoupld"),
    ("backend: tensorrt\n", "backend"),
    ("tensor_parallel_size: 2\n", "tensor_parallel_size"),
    ("speculative_config:\n  decoding_type: Eagle\n", "speculative_config"),
    ("triton_config:\n  max_batch_size: 8\n", "max_batch_size"),
    ("triton_config:\n  decoupled: yes please\n", "decoupled"),
    ("max_batch_size: 4\nmorphserve:\n  max_num_seqs: 8\n", "max_num_seqs"),
    ("model: [unclosed\n", "YAML"),
])
def test_a_bad_model_yaml_key_is_named(text, named) -> None:
    with pytest.raises(ModelYamlError, match=re.escape(named)):
        parse_model_yaml(text, FIELDS)


@pytest.mark.parametrize("name, value", [
    ("sampling_param_top_p", np.array([1.5], dtype=np.float32)),
    ("sampling_param_temperature", np.array([-1.0], dtype=np.float32)),
    ("sampling_param_top_k", np.array([-2], dtype=np.int32)),
    ("sampling_param_max_tokens", np.array([0], dtype=np.int32)),
    ("sampling_param_presence_penalty", np.array([np.nan], dtype=np.float32)),
])
def test_out_of_range_values_name_the_input(name, value) -> None:
    with pytest.raises(InputError, match=name):
        llmapi_to_engine(_get(**{name: value}))
