"""The Hugging Face-style directory a worker registers with Dynamo: the frontend tokenizes prompts, applies
the chat template, detokenizes the streamed token ids and enforces stop strings from it.

Only what the frontend reads is written (``config.json``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json``), from the tokenizer the engine itself uses, so the frontend's token ids are the
engine's. No weights: the worker already holds them, and a remote frontend receives these files through
the model card.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from serve.model.model_config import ModelConfig
from serve.model.tokenizer import Tokenizer

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def tokenizer_config(tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    """tokenizer_config.json as transformers' PreTrainedTokenizerFast reads it (chat template included)."""
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tokenizer.add_bos,
        "add_eos_token": False,
        "model_max_length": max_model_len,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
    if tokenizer.bos_token_id is not None:
        cfg["bos_token"] = tokenizer.token_to_str(tokenizer.bos_token_id)
    if tokenizer.eos_token_ids:
        cfg["eos_token"] = tokenizer.token_to_str(tokenizer.eos_token_ids[0])
    return cfg


def write_model_card_dir(root: str | os.PathLike, tokenizer: Tokenizer, config: ModelConfig,
                         max_model_len: int) -> Path:
    """Write the four files into ``root`` (created if needed) and return it."""
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf_dict()
    hf["max_position_embeddings"] = max_model_len  # what this engine serves, not what the model could
    eos = list(tokenizer.eos_token_ids) or list(config.eos_token_ids)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}
    _write_json(path / "config.json", hf)
    _write_json(path / "generation_config.json", generation)
    _write_json(path / "tokenizer_config.json", tokenizer_config(tokenizer, max_model_len))
    tokenizer.backend.save(str(path / "tokenizer.json"))
    return path


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
