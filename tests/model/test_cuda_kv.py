"""8-bit KV on CUDA (fp8 e4m3 and int8 codes with fp32 scales, read by the dense path: gathered, dequantized to the
engine's dtype, SDPA), run where a GPU is present (``make gpu-check`` runs tests/model); skipped everywhere else.
Written against documented torch APIs (``torch.float8_e4m3fn`` casts, ``index_copy_`` on int8 views) and not yet
run on a GPU (2026-12-05)."""

from __future__ import annotations

import pytest
import torch

from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.model.kv_cache import PagedKVCache
from serve.model.random_model import make_tiny_model
from tests.engine.test_engine_reference import _prompt_logits, _rel_err

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=5, vocab_size=257, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=32)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_the_round_trip_on_the_gpu_is_the_cpus(fmt):
    """The same K/V written on the GPU and on the CPU read back identically (the format is the device's and the
    host's alike), within the format's rounding of the input."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=32, kv_size=64)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(10, 2, 32, generator=g), torch.randn(10, 2, 32, generator=g)
    slots = torch.tensor([0, 3, 5, 6, 9, 12, 13, 17, 20, 23])
    got = {}
    for dev in ("cpu", "cuda"):
        kv = PagedKVCache.standalone(cfg, 6, 4, torch.device(dev), torch.float32, fmt)
        kv.write(1, kv.locate(slots.to(dev)), k.to(dev), v.to(dev))
        got[dev] = [t.cpu() for t in kv.read_blocks(1, torch.arange(6, device=dev).view(1, -1))]
    assert all(torch.equal(a, b) for a, b in zip(got["cpu"], got["cuda"]))


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_8bit_kv_serves_on_the_gpu_and_a_prompt_in_two_chunks_attends_as_in_one(model, fmt):
    """A bf16 engine with 8-bit KV (smaller blocks than bf16's); greedy generation runs; a prompt in two chunks (the
    second reading the first's 8-bit blocks) gives the logits of one chunk up to bf16 noise; and the rounding is real
    (the logits differ from bf16 KV's)."""
    e = LLMEngine(EngineConfig(device="cuda", num_kv_blocks=64, block_size=16, kv_cache_dtype=fmt), loaded=model)
    bf16 = LLMEngine(EngineConfig(device="cuda", num_kv_blocks=64, block_size=16), loaded=model)
    assert e.kv.is_quantized and e.ledger.slot_bytes < bf16.ledger.slot_bytes
    prompts = [[(13 * i + j) % 250 + 1 for j in range(5 + 11 * i)] for i in range(4)]
    outs = e.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert all(len(o["token_ids"]) == 12 for o in outs)
    ids = prompts[3]
    whole = _prompt_logits(e, ids)
    assert _rel_err(_prompt_logits(e, ids, split=len(ids) // 3), whole) <= 2e-2  # bf16 activations
    assert _rel_err(_prompt_logits(bf16, ids), whole) > 0
