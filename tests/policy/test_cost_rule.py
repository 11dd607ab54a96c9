"""The cost-aware controller with fake measured costs (policy/costs.py, policy/cost_rule.py), the cost
measurement and its per-machine cache (serve/model/step_costs.py), and repeated-run summaries."""

from __future__ import annotations

import math

import pytest
import torch

from policy import MorphController, PolicyConfig, StepCosts
from policy.cost_rule import cost_ladder, requests_admitted
from serve.model import step_costs as sc
from tests.morph_support import morph
from tests.policy.test_policy import EXTENT, SWAP_ORDER, FakeEngine, step
from workload.repeats import cell, spread, summarize_runs
from workload.replay import parse_mode

COUNTS = (1, 8, 32, 128, 512)
FULL_MS = (1.0, 1.5, 3.0, 8.0, 30.0)  # one layer's linears at full precision, ms per step


def costs(int4: float, int8: float = 1.0, rest: float = 10.0) -> StepCosts:
    """Fake measurements: each quantized precision a constant multiple of full precision's time."""
    ms = lambda f: tuple(v * f / 1e3 for v in FULL_MS)  # noqa: E731
    return StepCosts("fake device", COUNTS, {"full": ms(1.0), "int8": ms(int8), "int4": ms(int4)},
                     rest_s=ms(rest), meta={})


SLOW_INT4 = costs(int4=1.7, int8=1.6)   # an AVX2 CPU where the quantized kernels lose at every size
FAST_INT4 = costs(int4=0.7, int8=0.9)   # a GPU / AVX-512 CPU where they win
QUEUEING = {"usage": 0.3, "num_running": 4, "num_waiting": 2, "oldest_wait_s": 1.0, "blocks_needed_waiting": 20}


def ctl(c: StepCosts | None, **overrides: object) -> MorphController:
    config = PolicyConfig.for_mode("default", persist_iters=1, **overrides)
    return MorphController(config, SWAP_ORDER, c)


def test_slow_int4_machine_never_quantizes_to_int4_under_compute_pressure() -> None:
    c, eng = ctl(SLOW_INT4), FakeEngine()
    for _ in range(50):  # requests queue, yet their 20 blocks are free: compute, not memory
        d = step(c, eng, **QUEUEING)
        assert d.action == "none" and "does not pay" in d.reason and "slower" in d.reason
    assert not eng.quantized
    # at any step size: prefill-heavy steps too
    assert step(c, eng, **QUEUEING, step_tokens=512).action == "none"


def test_fast_int4_machine_quantizes_under_compute_pressure() -> None:
    c, eng = ctl(FAST_INT4), FakeEngine()
    d = step(c, eng, **QUEUEING)
    assert d.action == "quantize" and d.precision == "int4" and "faster" in d.reason
    # and it behaves as the cost-blind controller does
    blind, eng2 = ctl(None), FakeEngine()
    assert step(blind, eng2, **QUEUEING).layers == d.layers


def test_slow_machine_under_memory_pressure_quantizes_the_fewest_layers_that_cover_the_deficit() -> None:
    c, eng = ctl(SLOW_INT4, max_layers_per_step=8), FakeEngine()
    total = eng.total
    free = total - round(0.5 * total)
    for deficit in (1, 75, 76, 200):
        eng2 = FakeEngine()
        d = step(ctl(SLOW_INT4, max_layers_per_step=8), eng2, usage=0.5, num_running=2, num_waiting=4,
                 blocks_needed_waiting=free + deficit)
        assert d.action == "quantize", d.reason
        assert len(d.layers) == math.ceil(deficit / EXTENT["int4"]), (deficit, d.reason)
        assert d.layers == SWAP_ORDER[:len(d.layers)] and "pays" in d.reason
    assert not eng.quantized and c.costs is SLOW_INT4


def test_slow_machine_refuses_a_memory_step_whose_slowdown_outweighs_the_requests_it_admits() -> None:
    very_slow = costs(int4=6.0, int8=6.0)
    # 30 decodes running, 500 blocks free; three waiting prompts of 180 blocks: one layer admits one more
    tel = {"usage": 0.5, "num_running": 30, "num_waiting": 3, "blocks_needed_waiting": 540, "step_token_budget": 32}
    d = step(ctl(very_slow), FakeEngine(), **tel)
    assert d.action == "none" and "does not pay" in d.reason
    # the same pressure on a machine where int4 is slower only a little pays
    assert step(ctl(costs(int4=1.1, int8=1.1)), FakeEngine(), **tel).action == "quantize"


def test_kv_above_its_mark_with_nothing_waiting_does_not_quantize_slow_layers() -> None:
    assert step(ctl(SLOW_INT4), FakeEngine(), usage=0.95, num_running=8).action == "none"
    assert step(ctl(FAST_INT4), FakeEngine(), usage=0.95, num_running=8).action == "quantize"


def test_quantize_before_preempt_always_pays() -> None:
    c, eng = ctl(SLOW_INT4), FakeEngine()
    d = c.cover_deficit(eng.telemetry(usage=0.99, num_running=8), 10)
    assert d.action == "quantize" and len(d.layers) == 1


def test_the_ladder_comes_from_the_measured_costs() -> None:
    extents = {"int8": 50, "int4": 75}
    assert cost_ladder(("int8", "int4"), costs(int4=1.7, int8=1.1), extents) == ("int8", "int4")  # int8 first
    assert cost_ladder(("int8", "int4"), costs(int4=0.7, int8=0.9), extents) == ("int4",)  # int4 dominates
    assert cost_ladder(("int8", "int4"), costs(int4=1.2, int8=1.2), extents) == ("int4",)  # same cost, more blocks
    # a mode whose ladder lists both ladder steps quantizes new layers to the cheaper one
    c = ctl(costs(int4=1.7, int8=1.02), ladder=("int8", "int4"), max_layers_per_step=8)
    d = step(c, FakeEngine(), usage=0.5, num_running=2, num_waiting=2, blocks_needed_waiting=600)
    assert d.action == "quantize" and d.precision == "int8"


def test_a_slow_layer_is_restored_after_a_short_calm_a_fast_one_after_the_usual_one() -> None:
    for c, expect_early in ((SLOW_INT4, True), (FAST_INT4, False)):
        control, eng = ctl(c, restore_persist_s=5.0, slow_restore_persist_s=0.5), FakeEngine()
        control.cover_deficit(eng.telemetry(usage=0.99, num_running=1), 1)
        eng.apply(control.cover_deficit(eng.telemetry(usage=0.99, num_running=1), 1))
        assert eng.quantized
        actions = [step(control, eng, usage=0.65, num_running=4, dt=0.25).action for _ in range(6)]  # 1.5 s calm
        assert ("restore" in actions) is expect_early, (c.device, actions)


def test_without_costs_a_cost_aware_mode_is_the_cost_blind_controller() -> None:
    aware, blind = ctl(None), MorphController(PolicyConfig.for_mode("default", persist_iters=1, cost_aware=False),
                                              SWAP_ORDER)
    e1, e2 = FakeEngine(), FakeEngine()
    for kw in (QUEUEING, {"usage": 0.95}, {"usage": 0.1}):
        assert step(aware, e1, **kw) .layers == step(blind, e2, **kw).layers  # type: ignore[arg-type]


def test_requests_admitted_counts_whole_requests() -> None:
    eng = FakeEngine()
    t = eng.telemetry(usage=0.9, num_waiting=4, blocks_needed_waiting=160)  # 100 free, 40 blocks each
    assert t.kv_blocks_free == 100 and requests_admitted(t, 0) == 0 and requests_admitted(t, 75) == 2
    assert requests_admitted(t, 10_000) == 2  # capped by who is waiting (2 fit already)


def test_step_costs_interpolate_and_round_trip() -> None:
    c = SLOW_INT4
    assert c.layer_cost_s("full", 8) == pytest.approx(1.5e-3)
    assert c.layer_cost_s("full", 20) == pytest.approx((1.5 + (3.0 - 1.5) * 12 / 24) / 1e3)
    assert c.layer_cost_s("full", 1024) == pytest.approx((30 + 22 * 512 / 384) / 1e3)  # the last segment, extended
    assert c.ratio("int4", 100) == pytest.approx(1.7)
    assert c.slowdown_s("int4", 8, "int8") == pytest.approx(0.1 * 1.5e-3)
    assert c.step_s(8, 30, {0: "int4"}) == pytest.approx((30 * 1.5 + 0.7 * 1.5 + 15) / 1e3)
    assert StepCosts.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="full-precision row"):
        StepCosts("x", (1,), {"int4": (1.0,)})
    assert "| int4 |" in c.table()


def test_measure_and_the_per_machine_cache(tiny, tmp_path, monkeypatch) -> None:
    """Real kernels on the tiny model: every precision timed at every size; stored under the machine key,
    found again; another kernel fingerprint is another machine (measured anew)."""
    from serve.config import EngineConfig
    from serve.engine.engine import LLMEngine
    from serve.morph.setup import cost_inputs

    monkeypatch.setenv("MORPHSERVE_CACHE_DIR", str(tmp_path))
    e = LLMEngine(EngineConfig(num_kv_blocks=8, block_size=4, morph_mode="default", morph_precisions="int8,int4",
                               policy_overrides={"cost_aware": False}, max_model_len=64), loaded=tiny)
    try:
        layers, shape, head = cost_inputs(e.model, morph(e).bank)
        measured = sc.measure(layers, shape, e.model.device, e.model.dtype, head=head, token_counts=(1, 8), repeats=1)
        assert (set(measured.layer_s) == {"full", "int8", "int4"}
                and all(v > 0 for r in measured.layer_s.values() for v in r))
        key = sc.machine_key(e.model.device, e.model.dtype, shape)
        assert key["device"] == sc.device_name(torch.device("cpu")) and key["layer_shape"] == list(shape)
        sc.store(sc.cache_path(), key, measured)
        found, source = sc.load_or_measure(layers, shape, e.model.device, e.model.dtype, head=head)
        assert found.layer_s == measured.layer_s and source == str(sc.cache_path())
        assert sc.lookup(sc.cache_path(), {**key, "kernels": "another"}, ["full"]) is None
        assert sc.lookup(sc.cache_path(), key, ["full", "fp8"]) is None  # a precision it never measured
    finally:
        e.shutdown()


@pytest.mark.parametrize("quiet", [True, False])
def test_cost_aware_engine_gets_costs_at_start(tiny, tmp_path, monkeypatch, quiet: bool) -> None:
    """Measured at start, used by the engine either way, cached as this machine's only when the measurement was
    quiet (the host's load is the verdict's input; it is set here so the test does not depend on it)."""
    from policy.measurement import Verdict
    from serve.config import EngineConfig
    from serve.engine.engine import LLMEngine

    monkeypatch.setenv("MORPHSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sc, "judge", lambda c: Verdict(quiet, () if quiet else ("other processes used 90%",)))
    e = LLMEngine(EngineConfig(num_kv_blocks=8, block_size=4, morph_mode="default", max_model_len=64), loaded=tiny)
    try:
        assert morph(e).controller.costs is not None and "int4" in morph(e).controller.costs.layer_s
        assert (tmp_path / sc.COSTS_FILE).is_file() == quiet
    finally:
        e.shutdown()


def test_repeated_run_summaries() -> None:
    runs = {"off": [{"ttft_s": {"p50": v}, "slo": {"violation_rate": 0.1}} for v in (3.0, 1.0, 2.0)]}
    s = summarize_runs(runs)["off"]
    assert s["P50 TTFT (s)"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert s["swaps"] == spread([]) and cell([1.0, 3.0, 2.0]) == "2.0 [1.0-3.0]" and cell([]) == "n/a"
    assert parse_mode("default+cost_aware=false+kv_high=0.8") == ("default", {"cost_aware": False, "kv_high": 0.8})
    assert parse_mode("off") == ("off", {})
    assert parse_mode("default+speculation=off+kv_high=0.8") == ("default", {"kv_high": 0.8})


def test_a_batch_at_its_token_budget_is_compute_bound_so_slow_layers_are_refused() -> None:
    """Waiting prompts short of blocks, but the last batch already ran the whole token budget: more KV
    would not make the steps do more work, only slower ones."""
    tel = {"usage": 0.5, "num_running": 4, "num_waiting": 4, "blocks_needed_waiting": 600, "step_tokens": 512,
           "step_token_budget": 512}
    d = step(ctl(SLOW_INT4), FakeEngine(), **tel)
    assert d.action == "none" and "512 -> 512 tokens" in d.reason
    assert step(ctl(FAST_INT4), FakeEngine(), **tel).action == "quantize"
    # the same deficit with a batch of 4 decodes: the admitted prompts fill the budget, which pays
    assert step(ctl(SLOW_INT4), FakeEngine(), **{**tel, "step_tokens": 4}).action == "quantize"


def test_h200_costs_from_gpu_check_quantize_only_where_the_kernels_win() -> None:
    """bench/gpu_check.py's H200 table (README, random 16-layer Llama, bf16, tok/s): int4 loses at batch 1-8
    (0.81x) and wins at batch 32 and in prefill (1.26-1.3x). Compute pressure quantizes only where it wins."""
    tok_s = {"full": (106.0, 823.6, 1750.3, 26330), "int8": (72.2, 596.1, 2209.2, 33866),
             "int4": (86.1, 654.5, 2203.5, 34564)}
    counts = (1, 8, 32, 512)
    h200 = StepCosts("NVIDIA H200", counts,
                     {p: tuple(n / v / 16 for n, v in zip(counts, row)) for p, row in tok_s.items()})
    assert cost_ladder(("int8", "int4"), h200, EXTENT) == ("int4",)
    small = {**QUEUEING, "num_running": 1}
    assert step(ctl(h200), FakeEngine(), **small, step_tokens=1).action == "none"
    assert step(ctl(h200), FakeEngine(), **small, step_tokens=512).action == "quantize"


def test_bench_triton_reports_the_median_run() -> None:
    from bench.triton.__main__ import median_run

    runs = [{"ttft_s": {"p95": v}, "id": i} for i, v in enumerate((3.0, None, 1.0, 2.0))]
    assert median_run(runs)["id"] == 3  # 1.0, 2.0, 3.0, None(=inf): the lower median
    assert median_run(runs[:1])["id"] == 0


@pytest.mark.parametrize("fake, swaps", [(SLOW_INT4, False), (FAST_INT4, True)])
def test_engine_under_compute_pressure_quantizes_only_where_the_machine_costs_say_it_helps(
        tiny, tmp_path, monkeypatch, fake, swaps) -> None:
    """A real engine reading (fake) costs from its per-machine cache: requests queue on the sequence cap with
    KV blocks free; slow int4 never swaps, fast int4 does."""
    from serve.config import EngineConfig
    from serve.engine.engine import LLMEngine
    from serve.engine.sampling_params import SamplingParams
    from tests.morph.test_morph import FakeClock

    monkeypatch.setenv("MORPHSERVE_CACHE_DIR", str(tmp_path))
    cfg = tiny.config
    shape = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    sc.store(sc.cache_path(), sc.machine_key(torch.device("cpu"), torch.float32, shape), fake)
    clock = FakeClock()
    e = LLMEngine(EngineConfig(num_kv_blocks=40, block_size=4, max_num_batched_tokens=32, max_num_seqs=2,
                               morph_mode="default", max_model_len=128, policy_overrides={"persist_iters": 1}),
                  loaded=tiny, clock=clock)
    try:
        assert morph(e).controller.costs.layer_s == fake.layer_s
        for i in range(8):
            e.add_request([10 + i, 11, 12, 13], SamplingParams(max_tokens=6, ignore_eos=True))
        while e.has_unfinished_requests():
            e.step()
            clock.t += 0.05
        assert (morph(e).stats.swaps > 0) is swaps
        assert e.scheduler.num_preemptions == 0
    finally:
        e.shutdown()
