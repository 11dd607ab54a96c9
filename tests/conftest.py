"""Session-wide fixtures: one loaded embedded model, a tiny random Llama, and HF reference helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("MORPHSERVE_TEST_THREADS", "2")))

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct, loaded once (HF-named fp32 weights + tokenizer)."""
    from serve.model.loader import load_model

    return load_model("smollm2-135m")


def make_tiny_model(seed: int = 0, tokenizer=None, **overrides):
    """A random 2-layer Llama with the SmolLM tokenizer: fast enough for randomized engine tests."""
    from serve.model.loader import LoadedModel
    from serve.model.model_config import ModelConfig

    cfg = dict(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
               tie_word_embeddings=False, eos_token_ids=tokenizer.eos_token_ids, bos_token_id=tokenizer.bos_token_id,
               name="tiny")
    cfg.update(overrides)
    config = ModelConfig(**cfg)
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: (torch.randn(*shape, generator=g) * 0.08)  # noqa: E731
    w = {"model.embed_tokens.weight": r(config.vocab_size, config.hidden_size),
         "model.norm.weight": 1 + r(config.hidden_size)}
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = r(config.vocab_size, config.hidden_size)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + r(config.hidden_size)
        w[p + "post_attention_layernorm.weight"] = 1 + r(config.hidden_size)
        w[p + "self_attn.q_proj.weight"] = r(config.q_size, config.hidden_size)
        w[p + "self_attn.k_proj.weight"] = r(config.kv_size, config.hidden_size)
        w[p + "self_attn.v_proj.weight"] = r(config.kv_size, config.hidden_size)
        w[p + "self_attn.o_proj.weight"] = r(config.hidden_size, config.q_size)
        w[p + "mlp.gate_proj.weight"] = r(config.intermediate_size, config.hidden_size)
        w[p + "mlp.up_proj.weight"] = r(config.intermediate_size, config.hidden_size)
        w[p + "mlp.down_proj.weight"] = r(config.hidden_size, config.intermediate_size)
        if config.attention_bias:
            for n, size in (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size)):
                w[p + f"self_attn.{n}_proj.bias"] = r(size)
    return LoadedModel(config, w, tokenizer, "tiny-random")


@pytest.fixture(scope="session")
def tiny(smollm):
    return make_tiny_model(tokenizer=smollm.tokenizer)


def hf_reference_model(loaded):
    """transformers' LlamaForCausalLM holding exactly the same fp32 weights (the reference implementation)."""
    from serve.model.hf_reference import hf_llama

    return hf_llama(loaded, attn_implementation="eager", for_generation=True)


@pytest.fixture(scope="session")
def smollm_hf(smollm):
    return hf_reference_model(smollm)
