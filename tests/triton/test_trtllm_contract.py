"""TensorRT-LLM's contract without a server: declared inputs, request translation, parameters, refusals."""

from __future__ import annotations

import re

import numpy as np
import pytest

from serve.triton.repository import DEFAULT_MODEL_REPOSITORY
from serve.triton.request_inputs import InputError, parse_request
from serve.triton.trtllm import (
    MORPHSERVE_INPUTS,
    TRTLLM_INPUTS,
    UNSUPPORTED,
    batched,
    parse_parameters,
    trtllm_to_morphserve,
)

# Input names of tensorrtllm_backend's all_models/inflight_batcher_llm/ensemble/config.pbtxt (v0.19),
# without the multimodal ones this engine does not declare.
TRTLLM_ENSEMBLE_INPUTS = {
    "text_input", "decoder_text_input", "max_tokens", "num_return_sequences", "bad_words", "stop_words",
    "exclude_input_in_output", "end_id", "pad_id", "top_k", "top_p", "temperature", "length_penalty",
    "repetition_penalty", "min_length", "presence_penalty", "frequency_penalty", "random_seed",
    "return_log_probs", "return_context_logits", "return_generation_logits", "return_perf_metrics",
    "beam_width", "stream", "prompt_embedding_table", "prompt_table_extra_id", "prompt_vocab_size",
    "embedding_bias_words", "embedding_bias_weights", "lora_task_id", "lora_weights", "lora_config",
    "guided_decoding_guide_type", "guided_decoding_guide",
}
_TYPES = {"str": "TYPE_STRING", "strs": "TYPE_STRING", "int": "TYPE_INT32", "uint": "TYPE_UINT64",
          "float": "TYPE_FP32", "bool": "TYPE_BOOL"}


def _declared(model: str) -> dict[str, str]:
    text = (DEFAULT_MODEL_REPOSITORY / model / "config.pbtxt").read_text()
    block = text[text.index("input ["):text.index("output [")]
    return dict(re.findall(r'name:\s*"([^"]+)"\s*data_type:\s*(\w+)', block))


def test_configs_declare_the_contract() -> None:
    morph = _declared("morphserve")
    assert set(morph) == set(MORPHSERVE_INPUTS)
    for name, kind in MORPHSERVE_INPUTS.items():
        if kind in _TYPES:
            assert morph[name] == _TYPES[kind], name
    for model in ("ensemble", "tensorrt_llm_bls"):
        declared = _declared(model)
        assert set(declared) == set(TRTLLM_INPUTS)
        assert {k: v for k, v in declared.items()} == {k: morph[k] for k in TRTLLM_INPUTS}
        assert TRTLLM_ENSEMBLE_INPUTS <= set(declared), sorted(TRTLLM_ENSEMBLE_INPUTS - set(declared))
        assert "max_batch_size: 64" in (DEFAULT_MODEL_REPOSITORY / model / "config.pbtxt").read_text()


def _req(**arrays: np.ndarray) -> dict[str, np.ndarray]:
    base = {"text_input": np.array([["hi"]]).astype(object), "max_tokens": np.array([[5]], dtype=np.int32)}
    return {**base, **arrays}


@pytest.mark.parametrize(("extra", "temperature", "top_k", "top_p"), [
    ({}, 0.0, 0, 1.0),                                                                    # greedy
    ({"temperature": np.array([[0.7]], dtype=np.float32)}, 0.0, 0, 1.0),                  # still greedy
    ({"top_k": np.array([[5]], dtype=np.int32)}, 1.0, 5, 1.0),                            # sampling, T=1
    ({"top_p": np.array([[0.9]], dtype=np.float32), "temperature": np.array([[0.5]], dtype=np.float32)}, 0.5, 0, 0.9),
    ({"top_k": np.array([[3]], dtype=np.int32), "top_p": np.array([[0.0]], dtype=np.float32)}, 1.0, 3, 1.0),
])
def test_trtllm_sampling_defaults(extra, temperature, top_k, top_p) -> None:
    arrays = trtllm_to_morphserve(_req(**extra).get, None)
    assert all(a.shape[0] >= 1 and (a.ndim == 1) for a in arrays.values())
    parsed = parse_request(arrays.get, 64, 16)
    assert (parsed.temperature, parsed.top_k) == (temperature, top_k) and parsed.top_p == pytest.approx(top_p)
    assert parsed.exclude_input_in_output is False  # TensorRT-LLM's default


def test_translation_keeps_options_and_parameters() -> None:
    arrays = trtllm_to_morphserve(_req(stop_words=np.array([[".", ""]]).astype(object),
                                       bad_words=np.array([["x"]]).astype(object),
                                       random_seed=np.array([[9]], dtype=np.uint64),
                                       end_id=np.array([[2]], dtype=np.int32),
                                       return_log_probs=np.array([[True]])).get, '{"min_tokens": 3, "triton_x": 1}')
    p = parse_request(arrays.get, 64, 16)
    kw = p.sampling_kwargs()
    assert kw["stop"] == (".",) and kw["include_stop_str_in_output"] and kw["bad_words"] == ("x",)
    assert kw["seed"] == 9 and kw["stop_token_ids"] == (2,) and kw["ignore_eos"] and kw["logprobs"]
    assert kw["min_tokens"] == 3


@pytest.mark.parametrize(("extra", "parameters", "speculate"), [
    ({}, None, True),
    ({"speculate": np.array([[False]])}, None, False),            # the morphserve input
    ({"speculate": np.array([[True]])}, None, True),
    ({"num_draft_tokens": np.array([[0]], dtype=np.int32)}, None, False),  # TensorRT-LLM: 0 drafts, no speculation
    ({}, '{"speculate": false}', False),                           # a request parameter (HTTP generate key)
    ({}, '{"num_draft_tokens": 0}', False),
])
def test_per_request_speculation_opt_out(extra, parameters, speculate) -> None:
    arrays = trtllm_to_morphserve(_req(**extra).get, parameters)
    assert parse_request(arrays.get, 64, 16).sampling_kwargs()["speculate"] is speculate


@pytest.mark.parametrize(("extra", "message"), [
    ({"num_draft_tokens": np.array([[3]], dtype=np.int32)}, "num_draft_tokens: a client-chosen draft length"),
    ({"num_draft_tokens": np.array([[-1]], dtype=np.int32)}, "num_draft_tokens must be 0"),
    ({"num_draft_tokens": np.array([[0]], dtype=np.int32), "speculate": np.array([[True]])}, "contradict"),
])
def test_bad_speculation_inputs_are_refused(extra, message) -> None:
    with pytest.raises(InputError, match=message):
        parse_request(trtllm_to_morphserve(_req(**extra).get, None).get, 64, 16)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_every_unsupported_input_is_refused_by_name(name: str) -> None:
    kind = MORPHSERVE_INPUTS[name]
    value = {"bool": np.array([True]), "int": np.array([2], dtype=np.int32), "uint": np.array([2], dtype=np.uint64),
             "str": np.array([b"x"], dtype=np.object_), "strs": np.array([b"x"], dtype=np.object_)}.get(
        kind, np.ones((2, 3), dtype=np.float32))
    arrays = {"text_input": np.array([b"hi"], dtype=np.object_), name: value}
    with pytest.raises(InputError, match=name):
        parse_request(arrays.get, 64, 16)
    off = {"bool": np.array([False]), "int": np.array([0], dtype=np.int32)}.get(kind)
    if off is not None and name not in ("lora_task_id",):  # "not asked for" values pass
        parse_request({"text_input": arrays["text_input"], name: off}.get, 64, 16)


@pytest.mark.parametrize(("params", "message"), [
    ({"frobnicate": 1}, "unknown request parameter"), ({"min_tokens": "two"}, "min_tokens"),
    ({"seed": -1}, "seed"), ({"stop": [1]}, "stop"), ({"lora_weights": [1.0]}, "input tensor"),
])
def test_bad_parameters(params, message) -> None:
    with pytest.raises(InputError, match=message):
        parse_parameters(params)


def test_single_sequence_limits_and_batch() -> None:
    for name, value in (("beam_width", 2), ("num_return_sequences", 2)):
        with pytest.raises(InputError, match=name):
            parse_request({"text_input": np.array([b"hi"], dtype=np.object_),
                           name: np.array([value], dtype=np.int32)}.get, 64, 16)
    with pytest.raises(InputError, match="batch size 2"):
        trtllm_to_morphserve({"text_input": np.array([["a"], ["b"]]).astype(object)}.get, None)
    with pytest.raises(InputError, match="both"):
        parse_request({"text_input": np.array([b"hi"], dtype=np.object_)}.get, 64, 16, {"stop": "a", "stop_words": "b"})


def test_batched_outputs_have_trtllm_shapes() -> None:
    out = batched({"text_output": np.array([b"x"], dtype=np.object_), "cum_log_probs": np.array([-1.0]),
                   "output_log_probs": np.array([-0.5, -0.5])})
    assert out["text_output"].shape == (1,) and out["cum_log_probs"].shape == (1, 1)
    assert out["output_log_probs"].shape == (1, 1, 2) and out["batch_index"].shape == (1, 1)


def test_controls_no_client_can_use() -> None:
    """Cancellation only of a server-made inner id (an empty, malformed or client-chosen id is refused); memory
    control refused on the inference path; the internal parameters are never inputs (serve/triton/controls.py)."""
    from serve.triton.controls import cancel_target, front_end_arrival, new_inner_request_id
    from serve.triton.input_error import InputError

    inner = new_inner_request_id()
    assert cancel_target({"morphserve_cancel": inner}) == inner and cancel_target(None) is None
    assert cancel_target('{"max_tokens": 4}') is None and new_inner_request_id() != inner
    for bad in ("", "bls-1", "client-7", inner.upper(), inner + "0", 5, [inner]):
        with pytest.raises(InputError, match="morphserve_cancel"):
            cancel_target({"morphserve_cancel": bad})
    for memory in ("yield 512MiB", "reclaim", "yield 999999999999999999999B"):
        with pytest.raises(InputError, match="operator control"):
            parse_parameters({"morphserve_memory": memory, "max_tokens": 4})
    assert set(parse_parameters({"morphserve_cancel": inner, "morphserve_arrival_s": 5.0, "max_tokens": 4})) == {
        "max_tokens"}
    assert front_end_arrival({"morphserve_arrival_s": 12.5}) == 12.5 and front_end_arrival({}) is None
    for bad in ("now", True, float("nan")):
        with pytest.raises(InputError, match="morphserve_arrival_s"):
            front_end_arrival({"morphserve_arrival_s": bad})
