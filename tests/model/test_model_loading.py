"""Loading: HF directories round-trip against transformers' own loader; GGUF tokenizer; clear load errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.model.loader import ModelLoadError, embedded_model_path, load_model, save_hf_directory
from tests.conftest import REPO_ROOT, make_tiny_model
from tests.engine.test_engine_reference import _prompt_logits, _rel_err

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.mark.parametrize("variant", [
    {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},      # Llama-3 style
    {"attention_bias": True, "tie_word_embeddings": True},       # Qwen2-style biases, tied head
])
def test_hf_directory_matches_transformers_from_pretrained(tmp_path, smollm, variant):
    from transformers import AutoModelForCausalLM

    tiny = make_tiny_model(seed=1, tokenizer=smollm.tokenizer, **variant)
    save_hf_directory(tiny, tmp_path)
    loaded = load_model(str(tmp_path))
    assert dataclasses.replace(loaded.config, name="tiny") == tiny.config
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32, attn_implementation="eager").eval()
    ids = smollm.tokenizer.encode("A prompt that is long enough to span several KV blocks of the cache. " * 3)
    engine = LLMEngine(EngineConfig(num_kv_blocks=32, block_size=4), loaded=loaded)
    with torch.inference_mode():
        ref_logits = ref(torch.tensor([ids])).logits[0]
        ref.generation_config.eos_token_id = None
        ref_tokens = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)[0, len(ids):]
    got = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]["token_ids"]
    assert got == ref_tokens.tolist()
    assert _rel_err(_prompt_logits(engine, ids), ref_logits) <= 1e-4


def test_gguf_tokenizer_matches_transformers_gguf_tokenizer(smollm):
    from transformers import AutoTokenizer

    path = embedded_model_path("smollm2-135m")
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Hello, world! The quick brown fox jumps over the lazy dog. Café déjà vu <|im_start|>user"
    assert smollm.tokenizer.encode(text) == ref.encode(text, add_special_tokens=False)
    assert smollm.tokenizer.encode("12345") == [smollm.tokenizer.backend.token_to_id(c) for c in "12345"]


def test_chat_template(smollm):
    text = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(str(bad))
    (tmp_path / "dir").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path / "dir"))
    (tmp_path / "dir" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ModelLoadError, match="not a supported"):
        load_model(str(tmp_path / "dir"))


@pytest.mark.slow
def test_generate_cli_prints_only_the_completion():
    cmd = [sys.executable, "-m", "serve.generate", "--prompt", "What is the capital of France?", "--chat",
           "--max-tokens", "16", "--threads", "2"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    js = subprocess.run(cmd + ["--json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    result = json.loads(js.stdout)
    assert out.stdout == result["text"] + "\n"
    assert "Paris" in result["text"] and result["timings"]["ttft_s"] > 0
    bad = subprocess.run(cmd[:-2] + ["--max-tokens", "0"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "max_tokens" in bad.stderr
