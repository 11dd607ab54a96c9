"""The CUDA path, run where a GPU is present (``make gpu-check``); skipped everywhere else.

Random models built in place (serve/model/random_model.py), so nothing needs the embedded GGUF: greedy tokens against
transformers on the same GPU, the quantized kernels against their dequantized weights, int4 layouts across
devices, seeded sampling on device generators, NVML, and the morphing engine in bfloat16 with the arena's
device memory flat across swaps.
"""

from __future__ import annotations

import pytest
import torch

from policy import FULL
from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.memory.budget import query_device_memory
from serve.model.random_model import make_tiny_model
from serve.model.rtn import quantize_linear_rtn
from tests.morph.test_morph import (
    FakeClock,
    assert_memory_exact,
    assert_swap_mid_decode_keeps_state,
    decode_with_swap_at,
    drain_and_settle,
)
from tests.morph_support import morph

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")]

CUDA = torch.device("cuda")


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(CUDA)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=5, vocab_size=257, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=32)


def test_greedy_tokens_match_transformers_on_the_gpu(model):
    from serve.model.hf_reference import hf_llama

    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [[(13 * i + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(4)]
    engine = LLMEngine(EngineConfig(device="cuda", dtype="float32", num_kv_blocks=64, block_size=16), loaded=model)
    ours = [o["token_ids"] for o in engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    hf = hf_llama(model, attn_implementation="eager", for_generation=True).to(CUDA)
    for p, got in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p], device=CUDA), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
        assert got == ref


@pytest.mark.parametrize("precision, min_cap, rtol", [("int8", (7, 0), 2e-2), ("int4", (8, 0), 2e-2),
                                                      ("fp8", (8, 9), 8e-2)])
def test_quantized_kernels_match_their_dequantized_weights(precision, min_cap, rtol):
    if _capability() < min_cap:
        pytest.skip(f"{precision} needs sm{min_cap[0]}{min_cap[1]}+")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * 0.05
    op = quantize_linear_rtn(w, precision, 128).to(CUDA)
    x = torch.randn(8, 512, generator=g).to(CUDA, torch.bfloat16)
    y = op(x)
    assert y.dtype == torch.bfloat16 and y.device.type == "cuda"  # the model's dtype, on the device
    ref = x.float() @ op.dequantize().to(CUDA).t()
    err = (y.float() - ref).norm() / ref.norm()
    assert err < rtol, f"{precision}: relative error {err:.4f}"


def test_int4_layouts_move_between_cpu_and_gpu_exactly():
    if _capability() < (8, 0):
        pytest.skip("int4 needs sm80+")
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    cpu = quantize_linear_rtn(w, "int4", 64)
    gpu = cpu.to(CUDA)
    assert gpu.layout == "cuda" and torch.equal(gpu.codes().cpu(), cpu.codes())
    staged = cpu.for_device_on_host(CUDA)  # host copy packed for the GPU kernel (the layer bank's source)
    assert staged.packed.device.type == "cpu" and staged.layout == "cuda"
    assert torch.equal(staged.to(CUDA).packed, gpu.packed)
    with pytest.raises(RuntimeError, match="host staging copy"):
        staged(torch.randn(2, 256, dtype=torch.bfloat16))


def test_seeded_sampling_uses_device_generators(model):
    engine = LLMEngine(EngineConfig(device="cuda", num_kv_blocks=32, block_size=16), loaded=model)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    a = engine.generate([[5, 6, 7]], params)[0]["token_ids"]
    b = engine.generate([[5, 6, 7]], params)[0]["token_ids"]
    assert a == b and len(a) == 12


def test_nvml_reports_the_device_memory():
    info = query_device_memory(CUDA)
    assert info is not None and info.total_bytes > info.used_bytes > 0


def test_morphing_engine_in_bfloat16_keeps_device_memory_flat(model):
    """Swaps and restores under load on the GPU: exact accounting, extent blocks in the layer's own bytes,
    and no allocation beyond the arena (torch's allocated bytes do not move while KV capacity grows)."""
    clock = FakeClock()
    engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=16, block_size=16,
                                    max_num_batched_tokens=256, max_num_seqs=16, morph_mode="performance",
                                    policy_overrides={"persist_iters": 1, "restore_persist_s": 1.0,
                                                      "cost_aware": False}),
                       loaded=model, clock=clock)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    torch.cuda.synchronize()
    allocated0 = torch.cuda.memory_allocated(CUDA)
    for i in range(10):
        engine.add_request([(7 * i + j) % 250 + 1 for j in range(60)], params)
    peak_blocks = engine.pool.num_blocks
    while engine.has_unfinished_requests():
        engine.step()
        clock.t += 0.05
        peak_blocks = max(peak_blocks, engine.pool.num_blocks)
        assert_memory_exact(engine)
    assert morph(engine).stats.swaps >= 1 and peak_blocks > engine.pool.base_blocks
    drain_and_settle(engine, clock, max_steps=1000)
    assert all(layer.precision == FULL for layer in engine.model.layers)
    torch.cuda.synchronize()
    growth = torch.cuda.memory_allocated(CUDA) - allocated0
    print(f"\nCUDA allocated bytes moved by {growth} across {morph(engine).stats.swaps} swaps "
          f"(KV capacity peaked at {peak_blocks} blocks, base {engine.pool.base_blocks})")
    assert abs(growth) < 4 * 2**20


def test_swap_mid_decode_on_the_gpu_keeps_state(model):
    def make():
        return LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=64, block_size=16,
                                      morph_mode="performance",
                                      policy_overrides={"kv_high": 1.0, "queue_delay_high_s": 1e9,
                                                        "restore_persist_s": 1e9, "cost_aware": False}), loaded=model,
                         clock=FakeClock())

    precision = "int4" if _capability() >= (8, 0) else "int8"

    def run(swap_step):
        return decode_with_swap_at(make, swap_step, precision, list(range(30, 70)))

    def reference():
        return LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=64, block_size=16), loaded=model)
    assert_swap_mid_decode_keeps_state(run, reference, model, precision, prompt=list(range(30, 70)))


def test_vmm_arena_gives_segments_back_to_the_driver_and_tokens_survive():
    """A VMM-built arena (memory_floor set): yielding 2 of 4 layers of a model with 8 MiB layers releases
    whole 4 MiB segments (NVML's used memory falls by them), reclaim maps them again, and a request decoded
    across the round trip equals one on an engine that never yielded."""
    big = make_tiny_model(seed=5, vocab_size=257, hidden_size=1024, intermediate_size=2816, num_layers=4,
                          num_heads=16, num_kv_heads=4, head_dim=64)

    def engine(floor):
        return LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=64, block_size=16,
                                      morph_mode="default", memory_floor=floor, memory_pressure_source="none",
                                      policy_overrides={"cost_aware": False}), loaded=big)

    def run(e, yield_at):
        out = []
        e.add_request(list(range(10, 60)), SamplingParams(max_tokens=12, ignore_eos=True),
                      callback=lambda o: out.extend(o.new_token_ids))
        step = 0
        while e.has_unfinished_requests():
            if step == yield_at:
                used = lambda: query_device_memory(CUDA).used_bytes  # noqa: E731
                torch.cuda.synchronize()
                before = used()
                e.request_memory_yield(1)  # the smallest request: one layer
                morph(e).before_schedule(e.scheduler)
                morph(e).complete_ready(wait=True)
                torch.cuda.synchronize()
                released = before - used()
                e.request_memory_yield(None)
                morph(e).before_schedule(e.scheduler)
                morph(e).complete_ready(wait=True)
                torch.cuda.synchronize()
                assert e.memory.arena.vmm is not None and e.ledger.yielded_slots == 0
                assert released >= e.memory.arena.vmm.segment_bytes, released
                assert abs(used() - before) < e.memory.arena.vmm.segment_bytes
            e.step()
            step += 1
        return out

    assert run(engine("0"), 3) == run(engine(None), -1)


def test_cost_aware_default_measures_this_gpu_and_serves_a_burst(model):
    """The shipped default (morph mode ``default``, cost-aware): at start it reads or measures the step costs of
    *this* CUDA device (not a CPU table), and under a burst it keeps exact accounting and returns to full
    precision. Whether it quantizes depends on the measured costs, so the swap count is printed, not asserted."""
    clock = FakeClock()
    engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=16, block_size=16,
                                    max_num_batched_tokens=256, max_num_seqs=16, morph_mode="default",
                                    policy_overrides={"persist_iters": 1, "restore_persist_s": 1.0}),
                       loaded=model, clock=clock)
    costs = morph(engine).costs
    assert costs is not None and costs.device == torch.cuda.get_device_name(CUDA), costs
    assert set(costs.precisions) == {FULL, *morph(engine).bank.precisions}  # every ladder step the mode can take
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for i in range(10):
        engine.add_request([(7 * i + j) % 250 + 1 for j in range(60)], params)
    while engine.has_unfinished_requests():
        engine.step()
        clock.t += 0.05
        assert_memory_exact(engine)
    drain_and_settle(engine, clock, max_steps=1000)
    assert all(layer.precision == FULL for layer in engine.model.layers)
    print(f"\ncost-aware default on {costs.device}: {morph(engine).stats.swaps} swaps, "
          f"ratios { {p: [round(costs.ratio(p, n), 2) for n in costs.token_counts] for p in costs.precisions} }")
