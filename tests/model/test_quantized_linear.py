"""Runtime quantized linears (serve.model.quantized_linear) vs modelopt's fake quantization (builder.quantize).

Tolerances (relative Frobenius error of a linear's output against the modelopt QuantLinear output on
the same fp32 input; measured on this machine in brackets):

- int8 / int4: 6e-3 [int8 3.0e-3, int4 3.1e-3 with torch's aten kernels]. The integer codes are exactly
  modelopt's (checked separately below); what remains is the bf16 rounding of the stored scales (up to
  2**-8 per element) and, with torch's aten kernels (the fallback), bf16 rounding of the activations and of
  the kernel's output. Our AVX2 kernels (serve.model.kernels, the default on CPU) take fp32 activations
  and accumulate in fp32; tests/model/test_qkernels.py checks them against the dequantized weight to fp32
  rounding.
- fp8: 1e-6 [0.0]. The CPU path dequantizes to the bit-identical fake-quant weight and multiplies in
  fp32, so only summation order could differ.
"""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from builder.quantize import decoder_linears, quantize_model_rtn, quantize_with_modelopt, token_batches_loop
from policy.precisions import check_quantized_precision
from serve.model import kernels
from serve.model.quantized_linear import (
    Fp8WeightOnly,
    Int4WeightOnly,
    Int8WeightOnly,
    QuantizedLinear,
    load_quantized_linear,
    pack_int4_nibbles,
    unpack_int4_nibbles,
)
from serve.model.rtn import (
    choose_int4_block_size,
    quantize_fp8_rtn,
    quantize_int4_rtn,
    quantize_int8_rtn,
    quantize_linear_rtn,
)

torch.set_num_threads(1)



@pytest.fixture(autouse=True)
def _fp32_activations(monkeypatch):
    """These tests compare the stored weights with modelopt's: fp32 activations, so only the weights' rounding
    shows (int8 activations, the GEMV default, are checked against their own reference in test_qkernels)."""
    monkeypatch.setenv("MORPHSERVE_QACTIVATIONS", "fp32")


OUTPUT_RTOL = {"int8": 6e-3, "int4": 6e-3, "fp8": 1e-6}
BF16_UNIT_ROUNDOFF = 2.0**-8
SEED = 0


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        architectures=["LlamaForCausalLM"],
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    return _tiny_llama()


@functools.cache
def _modelopt(precision: str, block_size: int | None = None):
    gen = torch.Generator().manual_seed(SEED + 1)
    batches = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(2)]
    return quantize_with_modelopt(_tiny_llama(), precision, token_batches_loop(batches), block_size=block_size)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _inputs(k: int, m: int = 5) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(SEED + 2))


# ------------------------------------------------------------------------------ modelopt round trip


@pytest.mark.parametrize("precision", ["int8", "int4", "fp8"])
def test_runtime_output_matches_modelopt_fake_quant(precision: str) -> None:
    result = _modelopt(precision)
    modules = decoder_linears(result.model)
    assert sorted(result.layers) == sorted(modules)
    assert len(result.layers) == 2 * 7
    for name, layer in result.layers.items():
        module = modules[name]
        x = _inputs(module.in_features)
        with torch.no_grad():
            expected = module(x)
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert _rel(got, expected) < OUTPUT_RTOL[precision], name


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_integer_codes_are_modelopts(precision: str) -> None:
    """Codes recovered from modelopt's fake-quant weight and its exported fp32 scale are ours, exactly."""
    from modelopt.torch.export.quant_utils import get_weight_scaling_factor

    result = _modelopt(precision)
    modules = decoder_linears(result.model)
    for name, layer in result.layers.items():
        module = modules[name]
        with torch.no_grad():
            fake = module.weight_quantizer(module.weight)
        scale = get_weight_scaling_factor(module).float()
        if precision == "int8":
            ref_codes = torch.round(fake / scale[:, None])
            codes = layer.weight.float()
        else:
            ref_codes = torch.round(fake / scale.repeat_interleave(layer.group_size, dim=1))
            codes = layer.codes().float() - 8
            assert torch.equal(layer.scales_and_zeros()[1], torch.zeros_like(scale)), "symmetric: zero 0"
        assert torch.equal(codes, ref_codes), name
        # dequantized weight differs from the fake-quant weight only by the bf16 scale rounding
        assert ((layer.dequantize() - fake).abs() <= BF16_UNIT_ROUNDOFF * fake.abs() + 1e-12).all(), name


def test_fp8_dequantize_is_bit_identical_to_fake_quant() -> None:
    result = _modelopt("fp8")
    modules = decoder_linears(result.model)
    for name, layer in result.layers.items():
        module = modules[name]
        with torch.no_grad():
            fake = module.weight_quantizer(module.weight)
        assert isinstance(layer, Fp8WeightOnly) and layer.scale.numel() == 1
        assert torch.equal(layer.dequantize(), fake), name
        assert module.input_quantizer.is_enabled is False, "weight-only: inputs are not quantized"


def test_int4_awq_keeps_pre_quant_scale() -> None:
    result = _modelopt("int4")
    modules = decoder_linears(result.model)
    for name, layer in result.layers.items():
        pqs = modules[name].input_quantizer.pre_quant_scale
        assert layer.pre_quant_scale is not None and pqs is not None, name
        assert torch.equal(layer.pre_quant_scale, pqs.float().reshape(-1)), name


def test_int4_block_size_choice_and_override() -> None:
    assert choose_int4_block_size([128, 256]) == 128
    assert choose_int4_block_size([576, 1536]) == 64  # SmolLM2-135M
    assert choose_int4_block_size([96]) == 32
    assert _modelopt("int4").block_size == 128
    assert _modelopt("int8").block_size is None
    result = _modelopt("int4", 64)
    assert result.block_size == 64
    modules = decoder_linears(result.model)
    for name, layer in result.layers.items():
        assert layer.group_size == 64
        x = _inputs(layer.in_features)
        with torch.no_grad():
            expected = modules[name](x)
        assert _rel(layer(x), expected) < OUTPUT_RTOL["int4"], name


# ---------------------------------------------------------------------------- storage / round trip


@pytest.mark.parametrize("precision", ["int8", "int4", "fp8"])
def test_safetensors_round_trip(precision: str, tmp_path) -> None:
    layers = _modelopt(precision).layers
    path = tmp_path / "layers.safetensors"
    flat: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        flat.update({f"{name}.{key}": t for key, t in layer.tensors().items()})
    meta = next(iter(layers.values())).metadata()
    save_file(flat, str(path), metadata=meta)
    loaded = load_file(str(path))
    for name, layer in layers.items():
        prefix = f"{name}."
        tensors = {k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}
        again = load_quantized_linear(tensors, meta)
        assert type(again) is type(layer) and again.nbytes == layer.nbytes
        x = _inputs(layer.in_features)
        assert torch.equal(again(x), layer(x)), name
        assert torch.equal(again.dequantize(), layer.dequantize()), name


def test_nbytes_are_exact() -> None:
    n, k, g = 64, 256, 64
    w = torch.randn(n, k)
    assert quantize_int8_rtn(w).nbytes == n * k + 2 * n
    assert quantize_int4_rtn(w, g).nbytes == n * k // 2 + (k // g) * n * 2 * 2
    assert quantize_fp8_rtn(w).nbytes == n * k + 4
    assert quantize_fp8_rtn(w, per_channel=True).nbytes == n * k + 4 * n
    pqs = torch.rand(k) + 0.5
    int4 = quantize_int4_rtn(w, g)
    scales, zeros = int4.scales_and_zeros()
    with_pqs = Int4WeightOnly.from_codes(int4.codes(), scales, g, zeros, pre_quant_scale=pqs)
    assert with_pqs.nbytes == int4.nbytes + 4 * k


@pytest.mark.parametrize("n", [16, 48, 80, 192])
def test_int4_codes_survive_kernel_packing(n: int) -> None:
    """Row counts that are not a multiple of the kernel's 32/64-row block exercise its tail layout."""
    gen = torch.Generator().manual_seed(n)
    k, g = 128, 32
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(n, k // g, generator=gen) + 0.1
    layer = Int4WeightOnly.from_codes(codes, scales, g)
    assert torch.equal(layer.codes(), codes)
    assert torch.equal(unpack_int4_nibbles(pack_int4_nibbles(codes)), codes)


@pytest.mark.parametrize("precision", ["int8", "int4", "fp8"])
def test_forward_shapes_and_to(precision: str) -> None:
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    layer = quantize_linear_rtn(w, precision, group_size=64)
    assert isinstance(layer, QuantizedLinear)
    x = torch.randn(2, 3, 128)
    y = layer(x)
    assert y.shape == (2, 3, 32) and y.dtype == torch.float32
    moved = layer.to("cpu")
    assert torch.equal(moved(x), y) and moved.nbytes == layer.nbytes
    assert _rel(y.reshape(6, 32), x.reshape(6, 128) @ w.t()) < {"int8": 0.02, "int4": 0.2, "fp8": 0.08}[precision]


def _misaligned(t: torch.Tensor, offset: int = 24) -> torch.Tensor:
    nbytes = t.numel() * t.element_size()
    buf = torch.zeros(nbytes + 128, dtype=torch.uint8)
    view = buf[offset : offset + nbytes].view(t.dtype).reshape(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("kernel", ["ours", "torch"])
def test_int8_tolerates_misaligned_tensors(kernel: str, monkeypatch) -> None:
    """aten._weight_int8pack_mm segfaults on operands that are not 16/32-byte aligned (as tensors
    from safetensors.load_file can be); the layer must copy them. Our kernel uses unaligned loads."""
    if kernel == "torch":
        monkeypatch.setattr(kernels, "ops", lambda: None)
    ref = quantize_int8_rtn(torch.randn(64, 128, generator=torch.Generator().manual_seed(5)))
    layer = Int8WeightOnly(_misaligned(ref.weight), _misaligned(ref.scales))
    x = torch.randn(5, 128).bfloat16()
    assert torch.equal(layer(_misaligned(x)), ref(x))


# -------------------------------------------------------------------------------------- plain RTN


def test_rtn_error_within_half_step() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    int8 = quantize_int8_rtn(w)
    step8 = int8.scales.float()[:, None]
    # half a step of rounding, plus |q| <= 127 times the bf16 rounding of the scale
    assert ((int8.dequantize() - w).abs() <= step8 * (0.5 + 127 * BF16_UNIT_ROUNDOFF)).all()
    int4 = quantize_int4_rtn(w, 64)
    step4 = int4.scales_and_zeros()[0].repeat_interleave(64, dim=1)
    assert ((int4.dequantize() - w).abs() <= step4 * (0.5 + 8 * BF16_UNIT_ROUNDOFF)).all()
    fp8 = quantize_fp8_rtn(w, per_channel=True)
    assert _rel(fp8.dequantize(), w) < 0.05  # e4m3 keeps 3 mantissa bits


def test_quantize_model_rtn_covers_decoder_linears(tiny_llama: LlamaForCausalLM) -> None:
    layers = quantize_model_rtn(tiny_llama, "int4")
    assert len(layers) == 14
    assert {layer.group_size for layer in layers.values()} == {128}
    assert all(isinstance(layer, Int8WeightOnly) for layer in quantize_model_rtn(tiny_llama, "int8").values())


# ------------------------------------------------------------------------------------- bad input


def test_group_size_not_dividing_k_is_rejected(tiny_llama: LlamaForCausalLM) -> None:
    w = torch.randn(32, 96)
    with pytest.raises(ValueError, match="group size 64 does not divide in_features 96"):
        quantize_int4_rtn(w, 64)
    with pytest.raises(ValueError, match="group size 64 does not divide in_features 96"):
        Int4WeightOnly.from_codes(torch.zeros(32, 96, dtype=torch.int32), torch.ones(32, 1), 64)
    with pytest.raises(ValueError, match="group size must be one of"):
        quantize_int4_rtn(torch.randn(32, 96), 48)
    with pytest.raises(ValueError, match="group size 256 does not divide in_features 128"):
        quantize_with_modelopt(tiny_llama, "int4", lambda m: None, block_size=256)
    with pytest.raises(ValueError, match="no int4 block size"):
        choose_int4_block_size([100])


def test_unknown_precision_is_rejected(tiny_llama: LlamaForCausalLM) -> None:
    for call in (
        lambda: check_quantized_precision("int3"),
        lambda: quantize_with_modelopt(tiny_llama, "int3", lambda m: None),
        lambda: quantize_linear_rtn(torch.randn(16, 32), "nf4"),
        lambda: quantize_model_rtn(tiny_llama, "bf16"),
    ):
        with pytest.raises(ValueError, match="unknown precision"):
            call()
    with pytest.raises(ValueError, match="unknown quantized linear format"):
        load_quantized_linear({}, {"format": "int3_wo"})


def test_other_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        Int8WeightOnly(torch.zeros(8, 24, dtype=torch.int8), torch.ones(8))  # the kernel would segfault
    with pytest.raises(ValueError, match="out_features divisible by 16"):
        quantize_int4_rtn(torch.randn(40, 128), 32)
    with pytest.raises(ValueError, match="codes must lie in"):
        Int4WeightOnly.from_codes(torch.full((16, 64), 16), torch.ones(16, 2), 32)
    with pytest.raises(ValueError, match="expects 128"):
        quantize_int8_rtn(torch.randn(16, 128))(torch.randn(2, 64))
    with pytest.raises(ValueError, match="per-tensor"):
        Fp8WeightOnly(torch.zeros(8, 16, dtype=torch.float8_e4m3fn), torch.ones(3))
