"""Reading a modelopt unified checkpoint's quantized modules (serve/model/unified_checkpoint.py, the registry's
``from_unified`` readers) against modelopt's own writers: its int4 packing (``pack_int4_in_uint8``) and its real
quantization (``to_quantized_weight``) give back the codes and scales they were made from; what this engine cannot run
is refused with the module and the reason."""

from __future__ import annotations

import pytest
import torch

from serve.model.quantized_linear.common import UnifiedTensors
from serve.model.quantized_linear.int4_packing import unpack_int4_out_pairs
from serve.model.quantized_linear.registry import REGISTRY, format_for_quant_algo
from serve.model.unified_checkpoint import UnifiedCheckpointError, module_formats, read_quantized


def test_int4_unpacking_inverts_modelopts_packing() -> None:
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    g = torch.Generator().manual_seed(0)
    n, k, block = 48, 128, 64
    codes = torch.randint(-8, 8, (n, k), generator=g)
    scales = torch.rand(n, k // block, generator=g) + 0.1
    weight = codes.float() * scales.repeat_interleave(block, dim=1)  # exactly representable: w / scale == code
    packed = pack_int4_in_uint8(weight, scales, block)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (n // 2, k)
    assert torch.equal(unpack_int4_out_pairs(packed), (codes + 8).to(torch.int32))
    layer = REGISTRY["int4"].from_unified(UnifiedTensors("m", {"weight": packed, "weight_scale": scales}),
                                          {"quant_algo": "W4A16_AWQ", "group_size": block})
    assert torch.equal(layer.codes(), (codes + 8).to(torch.int32)) and layer.pre_quant_scale is None
    assert torch.equal(layer.scales_and_zeros()[0], scales.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="group_size 128 in the config, 64 in the tensors"):
        REGISTRY["int4"].from_unified(UnifiedTensors("m", {"weight": packed, "weight_scale": scales}),
                                      {"group_size": 128})
    with pytest.raises(ValueError, match="zero point"):
        REGISTRY["int4"].from_unified(UnifiedTensors("m", {"weight": packed, "weight_scale": scales}),
                                      {"has_zero_point": True})


def test_int8_and_fp8_read_modelopts_real_quantization() -> None:
    from modelopt.torch.export.model_config import QUANTIZATION_INT8_WO
    from modelopt.torch.export.quant_utils import to_quantized_weight

    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=g)
    scale = w.abs().amax(dim=1) / 127
    codes = to_quantized_weight(w, scale, QUANTIZATION_INT8_WO)
    layer = REGISTRY["int8"].from_unified(UnifiedTensors("m", {"weight": codes, "weight_scale": scale}), {})
    assert torch.equal(layer.weight, codes) and torch.equal(layer.scales, scale.to(torch.bfloat16))
    with pytest.raises(ValueError, match="m.weight_scale is missing"):
        REGISTRY["int8"].from_unified(UnifiedTensors("m", {"weight": codes}), {})
    e4m3 = (w / 0.01).to(torch.float8_e4m3fn)
    fp8 = REGISTRY["fp8"].from_unified(UnifiedTensors("m", {"weight": e4m3, "weight_scale": torch.tensor(0.01)}), {})
    assert torch.equal(fp8.weight.view(torch.uint8), e4m3.view(torch.uint8))
    with pytest.raises(ValueError, match="static activation scale"):
        REGISTRY["fp8"].from_unified(UnifiedTensors("m", {"weight": e4m3, "weight_scale": torch.tensor(0.01),
                                                          "input_scale": torch.tensor(0.1)}), {})


def test_quant_algos_map_to_the_registry() -> None:
    assert {a: format_for_quant_algo(a).precision for a in ("W8A16", "W4A16_AWQ", "FP8")} == {
        "W8A16": "int8", "W4A16_AWQ": "int4", "FP8": "fp8"}
    assert format_for_quant_algo("NVFP4") is None and format_for_quant_algo(None) is None


def _cfg(qc: dict) -> dict:
    return {"quantization_config": {"quant_method": "modelopt", **qc}}


def test_config_forms_and_refusals() -> None:
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight",
             "model.layers.1.self_attn.q_proj.weight_scale", "lm_head.weight"]
    assert module_formats({}, names) == {}  # unquantized
    one = module_formats(_cfg({"quant_algo": "W8A16", "ignore": ["lm_head", "model.layers.0*"]}), names)
    assert {m: f.precision for m, f in one.items()} == {"model.layers.1.self_attn.q_proj": "int8"}
    mixed = _cfg({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"model.layers.1.self_attn.q_proj":
                                                                          {"quant_algo": "W4A16_AWQ"}}})
    assert module_formats(mixed, names)["model.layers.1.self_attn.q_proj"].precision == "int4"
    refusals = {
        "GPTQ": ({"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq' is not one this engine reads"),
        "kv": (_cfg({"quant_algo": "W8A16", "kv_cache_scheme": {"num_bits": 8}}), "quantizes the KV cache"),
        "unscaled": (_cfg({"quant_algo": "MIXED_PRECISION", "quantized_layers": {
            "model.layers.0.self_attn.q_proj": {"quant_algo": "W8A16"},
            "model.layers.1.self_attn.q_proj": {"quant_algo": "W8A16"}}}),
            "model.layers.0.self_attn.q_proj quantized in the config without a weight_scale tensor"),
        "ignored": (_cfg({"quant_algo": "W8A16", "ignore": ["model.layers.*"]}),
                    "model.layers.1.self_attn.q_proj hold weight scales the config does not quantize"),
        "algo": (_cfg({"quant_algo": "W8A8_SQ_PER_CHANNEL"}),
                 "model.layers.1.self_attn.q_proj: quant_algo 'W8A8_SQ_PER_CHANNEL' is not a format this engine runs"),
    }
    for case, (cfg, message) in refusals.items():
        with pytest.raises(UnifiedCheckpointError) as err:
            module_formats(cfg, names)
        assert message in str(err.value), (case, str(err.value))


def test_only_whole_decoder_layers_at_one_format_are_served() -> None:
    w = torch.zeros(32, 64, dtype=torch.int8)
    s = torch.ones(32)
    tensors = {"model.layers.0.self_attn.q_proj.weight": w, "model.layers.0.self_attn.q_proj.weight_scale": s}
    with pytest.raises(UnifiedCheckpointError, match="layer 0 mixes formats \\(q_proj W8A16, k_proj unquantized"):
        read_quantized(_cfg({"quant_algo": "W8A16"}), tensors, num_layers=2)
    head = {"lm_head.weight": w, "lm_head.weight_scale": s}
    with pytest.raises(UnifiedCheckpointError, match="lm_head is quantized \\(W8A16\\): this engine runs quantized "
                                                      "decoder projections only"):
        read_quantized(_cfg({"quant_algo": "W8A16"}), head, num_layers=2)
