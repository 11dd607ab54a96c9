"""Session-wide fixtures: one loaded embedded model, a tiny random Llama, and HF reference helpers."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from serve.model.random_model import make_tiny_model  # noqa: F401 - the tests' random Llama (shared with bench.gpu_check)

# under CI=true a skip outside a short allow-list fails the session (tests/ci_skip_policy.py)
pytest_plugins = ["tests.ci_skip_policy"]

torch.set_num_threads(int(os.environ.get("MORPHSERVE_TEST_THREADS", "2")))
# Measured step costs (cost-aware morph modes) go to a per-user test cache, not ~/.cache; servers inherit it.
os.environ.setdefault("MORPHSERVE_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"morphserve-test-cache-{os.getuid()}"))

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures"  # committed trace excerpts (tests/fixtures/README.md)


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


# ------------------------------------------------------------------- one tiny engine directory build

BUILD_FAST = {"calib_tokens": 64, "profile_tokens": 32, "progress": False}
BUILD_NUM_LAYERS = 3
BUILD_LEVELS = ("int4@34", "int8@67", "int4@34+int8@67")
"""Morph levels of the shared tiny build: 1 layer at int4, 2 at int8 (one quantized format + full-precision
layers: rewritten to MIXED_PRECISION) and 1 int4 + 1 int8 (modelopt's own MIXED_PRECISION)."""


@pytest.fixture(scope="session")
def tiny_model(smollm):
    """A random 3-layer Llama (hidden 64) with the SmolLM tokenizer, for builder tests."""
    return make_tiny_model(seed=1, tokenizer=smollm.tokenizer, num_layers=BUILD_NUM_LAYERS)


@pytest.fixture(scope="session")
def tiny_dir(tiny_model, tmp_path_factory) -> Path:
    from serve.model.loader import save_hf_directory

    return save_hf_directory(tiny_model, tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="session")
def built(tiny_dir, tmp_path_factory):
    """One full build (all precisions, unified Hugging Face checkpoints, three morph levels) shared by read-only
    tests."""
    from builder.build import BuildOptions, build_engine

    return build_engine(BuildOptions(model=str(tiny_dir), output=str(tmp_path_factory.mktemp("eng") / "tiny"),
                                     levels=BUILD_LEVELS, **BUILD_FAST))


@pytest.fixture(scope="session")
def legacy_built(tiny_dir, tmp_path_factory):
    """A build with only the legacy TensorRT-LLM checkpoints (--legacy-trtllm --no-hf-export), three morph levels."""
    from builder.build import BuildOptions, build_engine

    return build_engine(BuildOptions(model=str(tiny_dir), output=str(tmp_path_factory.mktemp("legacy") / "tiny"),
                                     levels=BUILD_LEVELS, hf_export=False, legacy_trtllm=True, **BUILD_FAST))
