"""Unit tests for the pure MorphServe controller (policy/), with hand-built telemetry and a fake clock."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy import MODES, MorphController, MorphDecision, PolicyConfig, Telemetry

NUM_LAYERS = 8
SWAP_ORDER = (5, 2, 7, 0, 3, 6, 1, 4)  # a stand-in for the builder's LIS order
EXTENT = {"int8": 50, "int4": 75}  # KV blocks one layer adds at each precision
BASE_TOTAL = 1000


class FakeEngine:
    """Applies decisions to a model of the engine's layer/KV state and builds telemetry from it.

    Like the real engine it keeps a stack of transitions (one KV extent each); a layer's place in
    ``quantized_layers`` is the place of its newest extent, so the last entry always owns the top extent.
    """

    def __init__(self, num_layers: int = NUM_LAYERS) -> None:
        self.num_layers = num_layers
        self.stack: list[tuple[int, str]] = []  # (layer, precision reached), one extent each
        self.now = 0.0

    @property
    def quantized(self) -> dict[int, str]:
        latest = {layer: (i, p) for i, (layer, p) in enumerate(self.stack)}
        return {layer: p for layer, (_, p) in sorted(latest.items(), key=lambda kv: kv[1][0])}

    @property
    def total(self) -> int:
        return BASE_TOTAL + sum(EXTENT[p] for p in self.quantized.values())

    def telemetry(self, *, usage: float = 0.1, dt: float = 0.05, extent_free: bool = True, **kw: object) -> Telemetry:
        self.now += dt
        return Telemetry(
            now_s=self.now,
            kv_blocks_total=self.total,
            kv_blocks_used=min(self.total, round(usage * self.total)),
            num_layers=self.num_layers,
            quantized_layers=tuple(self.quantized.items()),
            pending_restore_extent_free=extent_free,
            blocks_per_layer_extent=EXTENT,
            **kw,  # type: ignore[arg-type]
        )

    def apply(self, d: MorphDecision) -> None:
        if d.action == "quantize":
            for layer in d.layers:
                assert self.quantized.get(layer) != d.precision, f"layer {layer} quantized twice to {d.precision}"
                self.stack.append((layer, d.precision))  # type: ignore[arg-type]
        elif d.action == "restore":
            for layer in d.layers:
                assert layer in self.quantized, f"restored layer {layer} that is not quantized"
                assert self.stack[-1][0] == layer, "restore must be LIFO: the layer owns the top extent"
                self.stack.pop()
                after = self.quantized.get(layer)
                assert after == d.precision, f"restore of {layer} should reach {after}, decision says {d.precision}"


def step(ctl: MorphController, eng: FakeEngine, **kw: object) -> MorphDecision:
    d = ctl.decide(eng.telemetry(**kw))  # type: ignore[arg-type]
    eng.apply(d)
    return d


def controller(mode: str = "default", **overrides: object) -> MorphController:
    return MorphController(PolicyConfig.for_mode(mode, **overrides), SWAP_ORDER)


HOT = {"usage": 0.95}  # KV usage above every preset's kv_high
CALM = {"usage": 0.1}


# -- hysteresis ---------------------------------------------------------------------


def test_pressure_must_persist_n_iterations() -> None:
    ctl, eng = controller("default", persist_iters=3), FakeEngine()
    assert step(ctl, eng, **HOT).action == "none"
    assert step(ctl, eng, **HOT).action == "none"
    d = step(ctl, eng, **HOT)
    assert d.action == "quantize" and d.precision == "int4"
    assert d.layers[0] == SWAP_ORDER[0]


def test_interrupted_pressure_resets_the_streak() -> None:
    ctl, eng = controller("default", persist_iters=3), FakeEngine()
    for _ in range(2):
        assert step(ctl, eng, **HOT).action == "none"
    assert step(ctl, eng, usage=0.7).action == "none"  # between kv_low and kv_high: no pressure
    for _ in range(2):
        assert step(ctl, eng, **HOT).action == "none"
    assert step(ctl, eng, **HOT).action == "quantize"


def test_streak_restarts_after_a_quantize_step() -> None:
    ctl, eng = controller("default", persist_iters=2, max_layers_per_step=1), FakeEngine()
    actions = [step(ctl, eng, **HOT).action for _ in range(6)]
    assert actions == ["none", "quantize"] * 3
    assert list(eng.quantized) == list(SWAP_ORDER[:3])


def test_each_pressure_signal_triggers() -> None:
    cfg = PolicyConfig.for_mode("default", persist_iters=1)
    cases = [
        {"usage": 0.9},
        {"oldest_wait_s": 0.2, "num_waiting": 1},
        {"num_waiting": 2, "blocks_needed_waiting": 950},
        {"num_waiting": 1, "ttft_p95_s": 3.0},
    ]
    for kw in cases:
        d = MorphController(cfg, SWAP_ORDER).decide(FakeEngine().telemetry(**kw))  # type: ignore[arg-type]
        assert d.action == "quantize", kw
    # High TTFT with nothing waiting is not KV pressure: more blocks would not help.
    d = MorphController(cfg, SWAP_ORDER).decide(FakeEngine().telemetry(ttft_p95_s=3.0))
    assert d.action == "none"


def test_layers_needed_covers_the_block_deficit() -> None:
    ctl, eng = controller("default", persist_iters=1, max_layers_per_step=8, max_quantized_fraction=1.0), FakeEngine()
    # 100 used -> 900 free; waiting prompts need 1200 -> deficit 300 blocks / 75 per int4 layer = 4 layers.
    d = step(ctl, eng, num_waiting=3, blocks_needed_waiting=1200)
    assert d.layers == SWAP_ORDER[:4]
    # 301 blocks short -> 5 layers.
    ctl2 = controller("default", persist_iters=1, max_layers_per_step=8, max_quantized_fraction=1.0)
    d2 = ctl2.decide(FakeEngine().telemetry(num_waiting=3, blocks_needed_waiting=1201))
    assert len(d2.layers) == 5


def test_layers_needed_count_the_8bit_blocks_the_kv_rung_makes_of_a_freed_slot() -> None:
    """With the KV rung a freed slot becomes 3.75 8-bit blocks under pressure: a 300-block deficit needs
    ceil(300 / floor(75 * 3.75)) = 2 int4 layers, not 4; the reason says what a layer is worth."""
    ctl = controller("default", persist_iters=1, max_layers_per_step=8, max_quantized_fraction=1.0)
    d = ctl.decide(FakeEngine().telemetry(num_waiting=3, blocks_needed_waiting=1200, kv_blocks_per_freed_slot=3.75))
    assert d.layers == SWAP_ORDER[:2] and "75 blocks/layer (281 as 8-bit KV)" in d.reason, d.reason
    with pytest.raises(ValueError, match="kv_blocks_per_freed_slot"):
        FakeEngine().telemetry(kv_blocks_per_freed_slot=0.5)


def test_layers_capped_by_step_and_fraction() -> None:
    ctl, eng = controller("default", persist_iters=1, max_layers_per_step=2, max_quantized_fraction=0.5), FakeEngine()
    wants_many = {"num_waiting": 9, "blocks_needed_waiting": 5000}
    assert len(step(ctl, eng, **wants_many).layers) == 2
    assert len(step(ctl, eng, **wants_many).layers) == 2
    d = step(ctl, eng, **wants_many)  # 4 of 8 quantized = 0.5: no room, single-step ladder
    assert d.action == "none" and "nothing left to quantize" in d.reason
    assert len(eng.quantized) == 4


def test_reason_names_signal_values() -> None:
    ctl = controller("default", persist_iters=1)
    d = ctl.decide(FakeEngine().telemetry(usage=0.9, num_waiting=2, oldest_wait_s=0.25, blocks_needed_waiting=40))
    assert "kv usage 90.0% > kv_high 85%" in d.reason
    assert "queueing delay 250 ms > 100 ms" in d.reason
    assert "waiting 2" in d.reason and "needs 40 blocks" in d.reason


# -- modes --------------------------------------------------------------------------


def test_performance_is_faster_and_bigger_than_default() -> None:
    perf, default = controller("performance"), controller("default")
    eng_p, eng_d = FakeEngine(), FakeEngine()
    wants_many = {"usage": 0.95, "num_waiting": 4, "blocks_needed_waiting": 2000}
    first_p = step(perf, eng_p, **wants_many)
    first_d = step(default, eng_d, **wants_many)
    assert first_p.action == "quantize" and first_d.action == "none"
    while (d := step(default, eng_d, **wants_many)).action == "none":
        pass
    assert len(first_p.layers) > len(d.layers)
    assert first_p.precision == d.precision == "int4"


def test_accuracy_is_slower_smaller_and_uses_int8() -> None:
    acc, eng = controller("accuracy"), FakeEngine()
    calls = 0
    while (d := step(acc, eng, usage=0.95, num_waiting=4, blocks_needed_waiting=2000)).action == "none":
        calls += 1
    assert calls + 1 == MODES["accuracy"].persist_iters > MODES["default"].persist_iters
    assert d.precision == "int8" and len(d.layers) == 1


def test_ladder_requantizes_in_swap_order_once_fraction_reached() -> None:
    ctl, eng = controller("accuracy", persist_iters=1, max_layers_per_step=1, max_quantized_fraction=0.25), FakeEngine()
    decisions = [step(ctl, eng, **HOT) for _ in range(5)]
    assert [(d.layers, d.precision) for d in decisions[:4]] == [
        ((5,), "int8"), ((2,), "int8"), ((5,), "int4"), ((2,), "int4"),
    ]
    assert decisions[4].action == "none"
    assert eng.quantized == {5: "int4", 2: "int4"}


def test_requantize_gain_is_the_extent_difference() -> None:
    ctl = controller("accuracy", persist_iters=1, max_layers_per_step=8, max_quantized_fraction=0.25)
    t = Telemetry(now_s=0, kv_blocks_total=1100, kv_blocks_used=1050, num_layers=8, num_waiting=1,
                  blocks_needed_waiting=100, quantized_layers=((5, "int8"), (2, "int8")),
                  blocks_per_layer_extent=EXTENT)
    d = ctl.decide(t)  # deficit 50 blocks; int8 -> int4 adds 25 per layer -> 2 layers
    assert d.action == "quantize" and d.layers == (5, 2) and d.precision == "int4"


def test_off_mode_never_morphs() -> None:
    ctl, eng = controller("off"), FakeEngine()
    for _ in range(20):
        d = step(ctl, eng, usage=1.0, num_waiting=5, oldest_wait_s=9.0, blocks_needed_waiting=10_000)
        assert d.action == "none" and "off" in d.reason


@pytest.mark.parametrize("mode,precision", [("static-int8", "int8"), ("static-int4", "int4")])
def test_static_modes_quantize_everything_once_and_never_restore(mode: str, precision: str) -> None:
    ctl, eng = controller(mode), FakeEngine()
    d = step(ctl, eng, **CALM)
    assert d.action == "quantize" and d.precision == precision and d.layers == SWAP_ORDER
    for _ in range(200):
        d = step(ctl, eng, dt=1.0, **CALM)
        assert d.action == "none"
    assert eng.quantized == {layer: precision for layer in SWAP_ORDER}


# -- restore ------------------------------------------------------------------------


def quantized_engine(ctl: MorphController, n: int) -> FakeEngine:
    eng = FakeEngine()
    while len(eng.quantized) < n:
        step(ctl, eng, **HOT)
    return eng


def test_restore_only_after_sustained_calm() -> None:
    ctl = controller("default", persist_iters=1, max_layers_per_step=1, restore_persist_s=5.0)
    eng = quantized_engine(ctl, 2)
    assert step(ctl, eng, dt=1.0, **CALM).action == "none"  # calm starts here
    for _ in range(4):
        assert step(ctl, eng, dt=1.0, **CALM).action == "none"
    d = step(ctl, eng, dt=1.0, **CALM)
    assert d.action == "restore" and d.layers == (SWAP_ORDER[1],) and d.precision is None


def test_calm_interrupted_restarts_the_period() -> None:
    ctl = controller("default", persist_iters=1, max_layers_per_step=1, restore_persist_s=5.0)
    eng = quantized_engine(ctl, 1)
    for _ in range(4):
        step(ctl, eng, dt=1.0, **CALM)
    assert step(ctl, eng, dt=1.0, usage=0.7).action == "none"  # above kv_low: not calm
    for _ in range(5):
        assert step(ctl, eng, dt=1.0, **CALM).action == "none"
    assert step(ctl, eng, dt=1.0, **CALM).action == "restore"


def test_no_restore_while_requests_wait_or_extent_busy() -> None:
    ctl = controller("default", persist_iters=1, max_layers_per_step=1, restore_persist_s=1.0)
    eng = quantized_engine(ctl, 1)
    for _ in range(10):
        assert step(ctl, eng, dt=1.0, usage=0.1, num_waiting=1).action == "none"
    for _ in range(10):
        d = step(ctl, eng, dt=1.0, usage=0.1, extent_free=False)
        assert d.action == "none"
    assert "still in use" in d.reason
    assert step(ctl, eng, dt=1.0, usage=0.1, extent_free=True).action == "restore"


def test_no_restore_that_would_recreate_pressure() -> None:
    ctl = controller("default", persist_iters=1, max_layers_per_step=8, max_quantized_fraction=1.0,
                     kv_low=0.6, kv_high=0.61, restore_persist_s=0.0)
    t = Telemetry(now_s=0, kv_blocks_total=1075, kv_blocks_used=640, num_layers=8,
                  quantized_layers=((5, "int4"),), pending_restore_extent_free=True, blocks_per_layer_extent=EXTENT)
    d = ctl.decide(t)  # 59.5% now, 64% after giving back 75 blocks
    assert d.action == "none" and "would leave" in d.reason


def test_restore_is_lifo_one_layer_at_a_time() -> None:
    ctl = controller("default", persist_iters=1, max_layers_per_step=1, restore_persist_s=2.0)
    eng = quantized_engine(ctl, 3)
    assert list(eng.quantized) == list(SWAP_ORDER[:3])
    restored = []
    for _ in range(30):
        d = step(ctl, eng, dt=1.0, **CALM)
        if d.action == "restore":
            assert len(d.layers) == 1
            restored.append(d.layers[0])
    assert restored == list(reversed(SWAP_ORDER[:3]))
    assert eng.quantized == {}


# -- validation ---------------------------------------------------------------------


def test_unknown_mode_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown policy mode 'turbo'.*off.*static-int4.*performance"):
        PolicyConfig.for_mode("turbo")


def test_overrides_apply_and_validate() -> None:
    assert PolicyConfig.for_mode("default", kv_high=0.9).kv_high == 0.9
    with pytest.raises(ValueError, match="unknown PolicyConfig field"):
        PolicyConfig.for_mode("default", kv_hihg=0.9)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"kv_low": 0.9, "kv_high": 0.85}, "kv_low < kv_high"),
        ({"kv_high": 1.5}, "kv_high"),
        ({"queue_delay_high_s": 0}, "queue_delay_high_s"),
        ({"persist_iters": 0}, "persist_iters"),
        ({"restore_persist_s": -1}, "restore_persist_s"),
        ({"max_layers_per_step": 0}, "max_layers_per_step"),
        ({"max_quantized_fraction": 1.2}, "max_quantized_fraction"),
        ({"ladder": ()}, "at least one precision"),
        ({"ladder": ("int3",)}, "unknown precision"),
        ({"ladder": ("int4", "int4")}, "repeats"),
        ({"ttft_slo_s": 0}, "ttft_slo_s"),
        ({"strategy": "sometimes"}, "strategy"),
    ],
)
def test_config_validation(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PolicyConfig.for_mode("default", **overrides)


def test_static_needs_one_precision() -> None:
    with pytest.raises(ValueError, match="exactly one precision"):
        PolicyConfig.for_mode("static-int4", ladder=("int8", "int4"))


def test_all_presets_are_valid_and_named() -> None:
    for name, cfg in MODES.items():
        assert cfg.mode == name
        assert dataclasses.replace(cfg) == cfg


def test_controller_and_telemetry_validation() -> None:
    cfg = PolicyConfig()
    with pytest.raises(ValueError, match="permutation"):
        MorphController(cfg, [0, 1, 1])
    with pytest.raises(ValueError, match="layers"):
        MorphController(cfg, SWAP_ORDER).decide(Telemetry(now_s=0, kv_blocks_total=10, kv_blocks_used=0, num_layers=4))
    with pytest.raises(ValueError, match="kv_blocks_used"):
        Telemetry(now_s=0, kv_blocks_total=10, kv_blocks_used=11, num_layers=4)
    with pytest.raises(ValueError, match="twice"):
        Telemetry(now_s=0, kv_blocks_total=10, kv_blocks_used=1, num_layers=4,
                  quantized_layers=((1, "int4"), (1, "int8")))
    with pytest.raises(ValueError):
        MorphDecision("quantize", (), "int4", "x")
    t = Telemetry(now_s=0, kv_blocks_total=10, kv_blocks_used=4, num_layers=4)
    assert t.kv_blocks_free == 6 and t.kv_usage == 0.4


# -- property: invariants over random telemetry sequences ---------------------------

signal = st.fixed_dictionaries({
    "usage": st.floats(0.0, 1.0),
    "dt": st.floats(0.0, 3.0),
    "extent_free": st.booleans(),
    "num_waiting": st.integers(0, 4),
    "oldest_wait_s": st.sampled_from([0.0, 0.02, 0.3]),
    "blocks_needed_waiting": st.integers(0, 2500),
    "ttft_p95_s": st.none() | st.floats(0.0, 5.0),
})
calm_signal = st.fixed_dictionaries({
    "usage": st.floats(0.0, 0.45),
    "dt": st.floats(0.0, 3.0),
    "extent_free": st.booleans(),
})
# Workloads come in phases (a burst, a lull), each held for a few iterations, so that both
# hysteresis thresholds are actually crossed.
phases = st.lists(st.tuples(signal | calm_signal, st.integers(1, 8)), min_size=1, max_size=15)


@settings(max_examples=200, deadline=None)
@given(
    mode=st.sampled_from(["default", "default", "performance", "accuracy", "off", "static-int8", "static-int4"]),
    fraction=st.floats(0.0, 1.0),
    per_step=st.integers(1, 8),
    persist=st.integers(1, 4),
    ladder=st.sampled_from([("int4",), ("int8", "int4"), ("int8",)]),
    workload=phases,
)
def test_invariants_over_random_telemetry(
    mode: str, fraction: float, per_step: int, persist: int, ladder: tuple[str, ...],
    workload: list[tuple[dict, int]],
) -> None:
    overrides: dict[str, object] = {}
    if MODES[mode].strategy == "dynamic":
        overrides = dict(max_quantized_fraction=fraction, max_layers_per_step=per_step,
                         persist_iters=persist, ladder=ladder, restore_persist_s=1.0)
    ctl = controller(mode, **overrides)
    limit = math.floor(ctl.config.max_quantized_fraction * NUM_LAYERS + 1e-9)
    eng = FakeEngine()
    for s in (s for s, repeat in workload for _ in range(repeat)):
        t = eng.telemetry(**s)
        d = ctl.decide(t)
        assert d.reason
        if d.action == "restore":
            assert t.pending_restore_extent_free
            assert ctl.config.strategy == "dynamic"
        eng.apply(d)  # asserts: no double quantize at one precision, restores only quantized layers, LIFO
        assert len(eng.quantized) <= limit
        if ctl.config.strategy == "off":
            assert d.action == "none"
