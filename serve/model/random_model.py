"""A random Llama and a byte-level tokenizer built in place: models for tests, smoke checks of the bench tools and
device checks that must not depend on downloaded or embedded weights (the GPU check runs where the embedded GGUF is
absent). In serve/model so that tests and bench/ share it without the tests importing bench."""

from __future__ import annotations

import torch

from serve.model.tokenizer import Tokenizer

EOS = "<|endoftext|>"


def byte_level_tokenizer() -> Tokenizer:
    """256 byte tokens (GPT-2 byte-level alphabet, no merges) + one end-of-text token (id 256)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers  # noqa: PLC0415
    from tokenizers import Tokenizer as HFTokenizer  # noqa: PLC0415

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab[EOS] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    return Tokenizer(backend, None, None, [vocab[EOS]])


def make_tiny_model(seed: int = 0, tokenizer=None, **overrides):
    """A random 2-layer Llama (by default) with ``tokenizer`` (default: a byte-level one, so nothing needs
    the embedded GGUF): fast enough for randomized engine tests, and runnable on any machine."""
    tokenizer = tokenizer or byte_level_tokenizer()
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
