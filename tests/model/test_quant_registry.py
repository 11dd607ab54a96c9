"""The quantization-format registry (serve/model/quantized_linear/registry.py): one row per format, and the
lookups that replaced the per-format branches (RTN dispatch, loading, modelopt recipes, fusion, host packing,
CUDA capability)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policy.precisions import PRECISION_CODE, QUANTIZED_PRECISIONS
from serve.model import kernels
from serve.model.linear import DenseLinear
from serve.model.quantized_linear import (
    FORMATS,
    REGISTRY,
    Calibration,
    Fp8WeightOnly,
    Int4WeightOnly,
    Int8WeightOnly,
    format_of,
    fuse_quantized,
    host_packed,
    load_quantized_linear,
    quant_format,
    registry,
)
from serve.model.rtn import quantize_fp8_rtn, quantize_int4_rtn, quantize_int8_rtn, quantize_linear_rtn
from serve.morph.plan import MIN_CUDA_CAPABILITY

torch.set_num_threads(1)

CLASSES = {"int8": Int8WeightOnly, "int4": Int4WeightOnly, "fp8": Fp8WeightOnly}


def _weight(n: int = 64, k: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_the_registry_names_policy_precisions_in_order_with_their_classes_and_codes() -> None:
    assert tuple(REGISTRY) == QUANTIZED_PRECISIONS
    for precision, fmt in REGISTRY.items():
        assert fmt.linear is CLASSES[precision]
        assert FORMATS[fmt.format] is fmt.linear
        assert fmt.code == PRECISION_CODE[precision]
    assert [f.grouped for f in REGISTRY.values()] == [False, True, False]


def test_the_registry_check_catches_a_format_policy_does_not_know(monkeypatch) -> None:
    monkeypatch.setitem(REGISTRY, "int3", REGISTRY["int4"])
    with pytest.raises(RuntimeError, match="differs from policy"):
        registry.check_registry()


def test_unknown_precisions_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown precision"):
        quant_format("int3")
    with pytest.raises(ValueError, match="unknown precision"):
        quantize_linear_rtn(_weight(), "int3")


def test_trtllm_tensor_bytes_are_the_deployment_formats() -> None:
    """Weights, scales and AWQ pre-quant scale of one [4096, 11008] linear as TensorRT-LLM holds it in a bf16 engine
    (the planner's) and in modelopt's checkpoint (fp32 scaling factors, the builder's), per format."""
    n, k = 4096, 11008
    assert registry.trtllm_tensor_bytes("int8", n, k, 2) == (n * k, 2 * n, 0)
    assert registry.trtllm_tensor_bytes("int4", n, k, 2) == (n * k // 2, 2 * n * (k // 128), 2 * k)
    assert registry.trtllm_tensor_bytes("fp8", n, k, 2) == (n * k, 4, 0)
    assert registry.trtllm_tensor_bytes("int4", n, k, 2, group_size=64, scale_bytes=4) == (
        n * k // 2, 4 * n * (k // 64), 2 * k)
    assert registry.trtllm_tensor_bytes("int8", n, k, 2, scale_bytes=4) == (n * k, 4 * n, 0)
    assert [f.trtllm.quant_algo for f in REGISTRY.values()] == ["W8A16", "W4A16_AWQ", "FP8"]
    with pytest.raises(ValueError, match="unknown precision"):
        registry.trtllm_tensor_bytes("int3", n, k, 2)


def test_the_registry_check_catches_grouping_that_disagrees_with_the_trtllm_scales(monkeypatch) -> None:
    int8 = REGISTRY["int8"]
    monkeypatch.setitem(REGISTRY, "int8",
                        dataclasses.replace(int8, trtllm=dataclasses.replace(int8.trtllm, scales="group")))
    with pytest.raises(RuntimeError, match="TensorRT-LLM scales"):
        registry.check_registry()


def test_cuda_capabilities_come_from_the_registry() -> None:
    assert MIN_CUDA_CAPABILITY == {"int8": (7, 0), "int4": (8, 0), "fp8": (8, 9)}


@pytest.mark.parametrize("precision", QUANTIZED_PRECISIONS)
def test_rtn_dispatch_and_safetensors_round_trip_through_the_registry(precision: str) -> None:
    w = _weight()
    q = quantize_linear_rtn(w, precision, 64)
    assert format_of(q) is REGISTRY[precision]
    again = load_quantized_linear(q.tensors(), q.metadata())
    assert type(again) is type(q) and again.nbytes == q.nbytes
    assert torch.equal(again.dequantize(), q.dequantize())


def test_each_format_rebuilds_rtn_codes_from_a_calibration() -> None:
    """A calibration with the amax and bounds RTN uses gives RTN's layer exactly (what the builder relies on to
    rebuild modelopt's codes)."""
    w = _weight()
    row_amax = w.abs().amax(dim=1)
    int8 = quant_format("int8").from_calibration(Calibration(w, row_amax, 127.0, -128.0))
    assert torch.equal(int8.dequantize(), quantize_int8_rtn(w).dequantize())
    group_amax = w.reshape(64, 2, 64).abs().amax(dim=2)
    int4 = quant_format("int4").from_calibration(Calibration(w, group_amax, 7.0, -8.0, block_size=64))
    assert torch.equal(int4.dequantize(), quantize_int4_rtn(w, 64).dequantize())
    fp8 = quant_format("fp8").from_calibration(Calibration(w, w.abs().amax().reshape(1), 448.0, -448.0))
    assert torch.equal(fp8.dequantize(), quantize_fp8_rtn(w).dequantize())


def test_dequantize_folded_folds_only_awqs_activation_scale() -> None:
    w = _weight()
    for q in (quantize_int8_rtn(w), quantize_fp8_rtn(w)):
        assert torch.equal(q.dequantize_folded(), q.dequantize())
    q4 = quantize_int4_rtn(w, 64)
    pqs = torch.linspace(0.5, 2.0, 128)
    scales, zeros = q4.scales_and_zeros()
    awq = Int4WeightOnly.from_codes(q4.codes(), scales, 64, zeros, pre_quant_scale=pqs)
    assert torch.equal(awq.dequantize_folded(), awq.dequantize() * pqs[None, :])


def test_fusion_rules() -> None:
    w = [_weight(64, 128, s) for s in range(3)]
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9))
    int8 = [quantize_int8_rtn(t) for t in w]
    fused = fuse_quantized(int8)
    assert isinstance(fused, Int8WeightOnly) and fused.out_features == 192
    assert torch.equal(fused.dequantize(), torch.cat([q.dequantize() for q in int8]))
    assert fuse_quantized([quantize_fp8_rtn(t) for t in w]) is None  # fp8 has no fusion rule
    assert fuse_quantized([int8[0], quantize_fp8_rtn(w[1])]) is None  # mixed formats
    assert fuse_quantized([DenseLinear(t) for t in w]) is None  # not quantized
    int4 = [quantize_int4_rtn(t, 64) for t in w]
    fused4 = fuse_quantized(int4)
    if kernels.ops() is None:  # torch's CPU layout: rows are not independent, so no fusion
        assert fused4 is None
    else:
        assert isinstance(fused4, Int4WeightOnly)
        assert torch.equal(fused4(x), torch.cat([q(x) for q in int4], dim=-1))  # rows are independent


def test_host_packing_rules() -> None:
    w = _weight()
    cpu = torch.device("cpu")
    int8 = quantize_int8_rtn(w)
    assert host_packed(int8, cpu) is int8
    dense = DenseLinear(w)
    assert host_packed(dense, cpu) is dense
    int4 = host_packed(quantize_int4_rtn(w, 64), cpu)
    assert isinstance(int4, Int4WeightOnly) and int4.packed.device.type == "cpu"
    assert torch.equal(int4.codes(), quantize_int4_rtn(w, 64).codes())


def test_modelopt_recipes_name_real_presets_and_formats() -> None:
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import model_config as mc

    for fmt in REGISTRY.values():
        assert isinstance(getattr(mtq, fmt.modelopt.preset), dict)
        assert all(isinstance(getattr(mc, name), str) for name in fmt.modelopt.export_formats)
