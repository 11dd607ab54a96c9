"""Models the planner knows by their config alone (no weights): shapes, and the bytes each layer takes per precision.

``--model`` is a built-in name (``llama-2-7b``, ``llama-2-13b`` written here from the public configs;
``llama-3.1-8b``, ``llama-3.1-70b`` from aiconfigurator-core's copies), a Hugging Face ``config.json`` or a
directory holding one.

Bytes per decoder layer (what the arena holds; norms live outside it, as in the engine), per projection of
``n x k`` weights, each tensor rounded up to the arena's 64-byte alignment: full precision (bf16) ``2nk``; a
quantized precision its weights, scales and pre-quant scale as TensorRT-LLM holds them in a bf16 engine, from the
format registry (serve/model/quantized_linear/registry.py, :func:`trtllm_tensor_bytes`): int8 weight-only
``nk`` + a bf16 scale per output channel; int4 AWQ ``nk/2`` + a bf16 scale per group of 128 + a bf16 pre-quant
scale per input channel; fp8 ``nk`` + one fp32 scale.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from policy import FULL
from serve.memory.arena import align_up
from serve.model.kv_cache import kv_bytes_per_block
from serve.model.model_config import ModelConfig
from serve.model.quantized_linear.registry import trtllm_tensor_bytes
from sim.kernel_tables import package_root

HERE = Path(__file__).with_name("model_configs")
PACKAGE_CONFIGS = {"llama-3.1-8b": "meta-llama--Meta-Llama-3.1-8B_config.json",
                   "llama-3.1-70b": "meta-llama--Meta-Llama-3.1-70B_config.json"}
BF16_BYTES = 2


def builtin_names() -> list[str]:
    return sorted([p.stem for p in HERE.glob("*.json")] + list(PACKAGE_CONFIGS))


def config_path(model: str) -> Path:
    """The config.json behind ``--model``: a built-in name, a file, or a directory with config.json."""
    if (HERE / f"{model}.json").is_file():
        return HERE / f"{model}.json"
    if model in PACKAGE_CONFIGS:
        return package_root().parent / "model_configs" / PACKAGE_CONFIGS[model]
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file():
        return path
    raise ValueError(f"--model {model!r}: not a built-in model ({', '.join(builtin_names())}), a config.json, or a "
                     "directory holding one")


def load_model_config(model: str) -> ModelConfig:
    path = config_path(model)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {model!r}: cannot read {path}: {exc}") from None
    arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        raise ValueError(f"--model {model!r} is a {arch}; the planner models Llama-family dense decoders")
    return ModelConfig.from_hf_dict(raw, name=Path(model).name if path.parent != HERE else model)


@dataclass(frozen=True)
class Projection:
    name: str
    n: int   # output features
    k: int   # input features


def projections(cfg: ModelConfig) -> list[Projection]:
    """The layer's GEMMs as the engine (and TensorRT-LLM) run them: fused QKV, O, fused gate/up, down."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return [Projection("qkv", q + 2 * kv, h), Projection("o", h, q), Projection("gate_up", 2 * inter, h),
            Projection("down", h, inter)]


def projection_nbytes(p: Projection, precision: str) -> int:
    if precision == FULL:
        return align_up(BF16_BYTES * p.n * p.k)
    return sum(align_up(b) for b in trtllm_tensor_bytes(precision, p.n, p.k, BF16_BYTES))


def layer_nbytes(cfg: ModelConfig, precision: str) -> int:
    return sum(projection_nbytes(p, precision) for p in projections(cfg))


def non_layer_nbytes(cfg: ModelConfig) -> int:
    """Embedding, LM head (unless tied), final norm and the layers' norms, in bf16: outside the arena."""
    emb = 2 * cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else emb
    return emb + head + 2 * cfg.hidden_size * (1 + 2 * cfg.num_layers)


def kv_block_nbytes(cfg: ModelConfig, block_size: int) -> int:
    """K and V of every layer for one block in bf16: the engine's own formula."""
    return kv_bytes_per_block(cfg, block_size, torch.bfloat16)
