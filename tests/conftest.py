"""Session-wide fixtures: one loaded embedded model, a tiny random Llama, and HF reference helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bench.tiny_model import make_tiny_model  # noqa: F401 - the tests' random Llama (shared with bench.gpu_check)

torch.set_num_threads(int(os.environ.get("MORPHSERVE_TEST_THREADS", "2")))

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct, loaded once (HF-named fp32 weights + tokenizer)."""
    from serve.model.loader import load_model

    return load_model("smollm2-135m")


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
