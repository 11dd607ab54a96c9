"""A decoder layer whose projections are quantized runtime layers: the morph runtime's variants (the layer bank
builds them over a full-precision layer's norms) and a static checkpoint's quantized layers (a modelopt unified
checkpoint, serve/model/unified_checkpoint.py), both assembled by the one rule here so that they run the same ops."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from serve.model.layers import PROJECTIONS, projection_key
from serve.model.linear import ConcatLinear, LinearOp
from serve.model.llama import DecoderLayer, LlamaModel
from serve.model.loader import LoadedModel
from serve.model.quantized_linear import fuse_quantized


def fuse_ops(ops: list, bias: torch.Tensor | None) -> LinearOp:
    """One kernel call where the ops' format has a fusion rule that accepts them (the format registry: int8
    always, int4 in our CPU kernel's layout); otherwise run each op."""
    fused = fuse_quantized(ops) if bias is None else None
    return fused if fused is not None else ConcatLinear(ops, bias)


def assemble(input_norm: torch.Tensor, post_attention_norm: torch.Tensor, linears: Mapping[str, LinearOp],
             precision: str, qkv_bias: torch.Tensor | None = None) -> DecoderLayer:
    missing = [p for p in PROJECTIONS if p not in linears]
    if missing:
        raise ValueError(f"{precision} variant lacks projections {missing}")
    return DecoderLayer(
        input_norm=input_norm, post_attention_norm=post_attention_norm,
        qkv=fuse_ops([linears["q_proj"], linears["k_proj"], linears["v_proj"]], qkv_bias),
        o=linears["o_proj"],
        gate_up=fuse_ops([linears["gate_proj"], linears["up_proj"]], None),
        down=linears["down_proj"],
        precision=precision,
    )


def quantized_layer(full: DecoderLayer, linears: Mapping[str, LinearOp], precision: str) -> DecoderLayer:
    """``full``'s layer with its projections at ``precision`` (the norms and any q/k/v bias are full's)."""
    return assemble(full.input_norm, full.post_attention_norm, linears, precision, getattr(full.qkv, "bias", None))


def static_layers(loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> dict[int, DecoderLayer]:
    """The quantized layers of a static checkpoint on ``device``: its norms and biases at ``dtype``, its
    projections as stored (an int4 layer repacked for the device's kernel)."""
    if loaded.quantized is None:
        return {}
    out = {}
    for i, linears in loaded.quantized.layers.items():
        p = f"model.layers.{i}."
        norm = lambda name: loaded.weights[p + name].to(device=device, dtype=dtype)  # noqa: E731
        biases = [loaded.weights.get(projection_key(i, q) + ".bias") for q in ("q_proj", "k_proj", "v_proj")]
        bias = None if biases[0] is None else torch.cat(biases).to(device=device, dtype=dtype)
        out[i] = assemble(norm("input_layernorm.weight"), norm("post_attention_layernorm.weight"),
                          {q: op.to(device) for q, op in linears.items()}, loaded.quantized.precisions[i], bias)
    return out


def build_model(loaded: LoadedModel, device: torch.device, dtype: torch.dtype, max_positions: int) -> LlamaModel:
    """The model on ``device``: every layer from the full-precision weights, a static checkpoint's quantized layers
    from its runtime layers."""
    return LlamaModel(loaded.config, loaded.weights, device, dtype, max_positions,
                      layers=static_layers(loaded, device, dtype))
