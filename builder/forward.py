"""A dense (no KV cache) Llama forward over swappable decoder layers, for profiling and evaluation.

Each decoder layer is a :class:`DenseLayer` whose seven projections are plain callables, so the same
forward runs full-precision weights, dequantized runtime weights (fp32 matmul) or the runtime
quantized kernels themselves. Hidden states are ``[batch, tokens, hidden]`` fp32; attention is causal
over each row. Checked against transformers' LlamaForCausalLM in tests/builder/test_builder.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serve.model.kv_format import dequantize, quantize
from serve.model.layers import PROJECTIONS, projection_key
from serve.model.linear import DenseLinear
from serve.model.llama import rms_norm
from serve.model.model_config import ModelConfig
from serve.model.quantized_linear import QuantizedLinear
from serve.model.rope import RotaryEmbedding

Projection = Callable[[torch.Tensor], torch.Tensor]


class KernelProjection:
    """A runtime quantized linear (its own aten kernel) plus the full-precision bias, if any."""

    def __init__(self, layer: QuantizedLinear, bias: torch.Tensor | None = None) -> None:
        self.layer = layer
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        return y + self.bias if self.bias is not None else y


def dequantized_weight(layer: QuantizedLinear) -> torch.Tensor:
    """fp32 weight equivalent to the runtime layer (AWQ's pre_quant_scale folded in)."""
    return layer.dequantize_folded()


@dataclass
class DenseLayer:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    projs: dict[str, Projection]


class DenseLlama:
    """Embedding, final norm, lm_head and RoPE tables of one model; layers are passed per call."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor], max_positions: int = 4096) -> None:
        self.config = config
        self.weights = weights
        self.embed_weight = weights["model.embed_tokens.weight"].float()
        self.norm_weight = weights["model.norm.weight"].float()
        self.lm_head_weight = weights.get("lm_head.weight", self.embed_weight).float()
        if config.tie_word_embeddings:
            self.lm_head_weight = self.embed_weight
        self.rope = RotaryEmbedding(config, max_positions, torch.device("cpu"), torch.float32)
        self.full_layers = [self.full_layer(i) for i in range(config.num_layers)]

    def _bias(self, layer: int, proj: str) -> torch.Tensor | None:
        bias = self.weights.get(projection_key(layer, proj) + ".bias")
        return None if bias is None else bias.float()

    def _norms(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = f"model.layers.{i}."
        w = self.weights
        return w[p + "input_layernorm.weight"].float(), w[p + "post_attention_layernorm.weight"].float()

    def full_layer(self, i: int) -> DenseLayer:
        projs = {n: DenseLinear(self.weights[projection_key(i, n) + ".weight"].float(), self._bias(i, n)) for n
                 in PROJECTIONS}
        return DenseLayer(*self._norms(i), projs)

    def quantized_layer(self, i: int, variant: Mapping[str, QuantizedLinear], kernels: bool = False) -> DenseLayer:
        """Layer ``i`` with its projections replaced by ``variant`` (dequantized fp32, or the kernels)."""
        if kernels:
            projs: dict[str, Projection] = {n: KernelProjection(variant[n], self._bias(i, n)) for n in PROJECTIONS}
        else:
            projs = {n: DenseLinear(dequantized_weight(variant[n]), self._bias(i, n)) for n in PROJECTIONS}
        return DenseLayer(*self._norms(i), projs)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_weight)

    def layer_forward(self, layer: DenseLayer, h: torch.Tensor, kv_cache_dtype: str = "auto") -> torch.Tensor:
        """``kv_cache_dtype`` int8 / fp8: attention reads K/V as the engine's 8-bit KV blocks hold them (each row and
        head rounded to its codes and scale, serve/model/kv_format.py), its own tokens' too, as the engine does."""
        cfg = self.config
        b, t, _ = h.shape
        x = self._rms_norm(h, layer.input_norm)
        positions = torch.arange(t)
        q = self.rope.apply(layer.projs["q_proj"](x).view(b, t, cfg.num_heads, cfg.head_dim), positions)
        k = self.rope.apply(layer.projs["k_proj"](x).view(b, t, cfg.num_kv_heads, cfg.head_dim), positions)
        v = layer.projs["v_proj"](x).view(b, t, cfg.num_kv_heads, cfg.head_dim)
        if kv_cache_dtype != "auto":
            k, v = (kv_round_trip(x, kv_cache_dtype) for x in (k, v))
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, enable_gqa=cfg.num_heads != cfg.num_kv_heads,
        )
        h = h + layer.projs["o_proj"](attn.transpose(1, 2).reshape(b, t, cfg.q_size))
        x = self._rms_norm(h, layer.post_attention_norm)
        return h + layer.projs["down_proj"](F.silu(layer.projs["gate_proj"](x)) * layer.projs["up_proj"](x))

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(h, self.norm_weight)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.final_hidden(h), self.lm_head_weight)

    def forward(self, input_ids: torch.Tensor, layers: list[DenseLayer] | None = None,
                kv_cache_dtype: str = "auto") -> torch.Tensor:
        """Logits ``[B, T, V]``; ``layers`` default to the full-precision ones; K/V stored as ``kv_cache_dtype``."""
        h = self.embed(input_ids)
        for layer in layers if layers is not None else self.full_layers:
            h = self.layer_forward(layer, h, kv_cache_dtype)
        return self.logits(h)


def kv_round_trip(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """``x [..., kv_heads, head_dim]`` as an 8-bit KV block gives it back (codes times per row-and-head scales)."""
    codes, scales = quantize(x.reshape(-1, *x.shape[-2:]), kv_cache_dtype)
    return dequantize(codes, scales, kv_cache_dtype, x.dtype).view(x.shape)
