"""transformers' LlamaForCausalLM holding exactly our loaded weights: the reference implementation that
tests compare tokens against, the builder hands to nvidia-modelopt, and the engine benchmark races."""

from __future__ import annotations

from typing import Any

from serve.model.loader import LoadedModel


def hf_llama(loaded: LoadedModel, attn_implementation: str | None = None, for_generation: bool = False) -> Any:
    """An eval-mode ``LlamaForCausalLM`` with ``loaded``'s fp32 weights (lm_head tied when the model ties
    it or has none). ``for_generation`` makes ``generate()`` run to max_new_tokens (no EOS, pad id 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - heavy, only when asked for

    cfg = LlamaConfig(**loaded.config.to_hf_dict())
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    model = LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    if loaded.config.tie_word_embeddings or "lm_head.weight" not in loaded.weights:
        model.lm_head.weight = model.model.embed_tokens.weight
    if for_generation:
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return model
