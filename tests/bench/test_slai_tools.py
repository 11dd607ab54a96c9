"""Per-request targets through the tools: tier assignment, the result's tiers block, the capacity sweep's
arithmetic, and the Triton input parser (no model, no server)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.capacity import at_rate, parse_configs, parse_rates, summarize_config
from serve.triton.request_inputs import InputError, SloInputs, parse_slo_inputs
from workload.items import WorkItem, assign_targets
from workload.latency import RequestTiming, by_tier


def items(n: int) -> list[WorkItem]:
    return [WorkItem(float(i), [1, 2, 3], 4) for i in range(n)]


def test_tight_share_is_chosen_by_seed_and_gets_tier_0() -> None:
    a = assign_targets(items(20), 1.5, 0.25, 0.4, seed=3)
    tight = [i for i, w in enumerate(a) if w.priority == 0]
    assert len(tight) == 5 and all(a[i].tbt_slo_s == 0.4 for i in tight)
    assert all(w.tbt_slo_s == 1.5 and w.priority is None for i, w in enumerate(a) if i not in tight)
    assert [w.priority for w in assign_targets(items(20), 1.5, 0.25, 0.4, seed=3)] == [w.priority for w in a]
    assert [w.priority for w in assign_targets(items(20), 1.5, 0.25, 0.4, seed=4)] != [w.priority for w in a]
    assert all(w.tbt_slo_s is None and w.priority is None for w in assign_targets(items(5), None, 0.0, None, 0))


@pytest.mark.parametrize("args, match", [
    ((0.0, 0.0, None), "--tbt-slo"), ((1.0, 1.5, 0.2), "--tight-share"), ((1.0, 0.1, None), "needs --tight-tbt-slo"),
    ((1.0, 0.1, -0.2), "--tight-tbt-slo"),
])
def test_bad_target_options(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        assign_targets(items(4), *args, seed=0)


def test_tiers_block_has_the_top_level_latency_blocks_per_tier() -> None:
    timings = [RequestTiming(0.0, [1.0, 1.2, 1.4]), RequestTiming(0.0, [2.0, 3.0]), RequestTiming(0.0, [0.5, 1.5, 2.5]),
               RequestTiming(0.0, [], ok=False)]
    tiers = by_tier(timings, [0, 1, 1, 1], [0.3, 2.0, 2.0, 2.0])
    assert list(tiers) == ["0", "1"]
    t0, t1 = tiers["0"], tiers["1"]
    assert set(t0) >= {"ttft_s", "tpot_s", "itl_s", "e2el_s"}
    assert t0["ttft_s"]["p50"] == 1.0 and t0["itl_s"]["p99"] == pytest.approx(0.2) and t0["tbt_p99_met"] is True
    assert (t1["num_requests"], t1["completed"]) == (3, 2)
    assert t1["ttft_s"]["p50"] == pytest.approx(1.25) and t1["itl_s"]["p99"] == pytest.approx(1.0)
    assert t1["tbt_slo_s"] == 2.0 and t1["tbt_p99_met"] is True
    assert by_tier(timings[:1], [0], [0.1])["0"]["tbt_p99_met"] is False
    with pytest.raises(ValueError, match="one entry per request"):
        by_tier(timings, [0], [0.3])


def test_at_rate_rescales_arrivals_to_the_mean_rate() -> None:
    w = [WorkItem(10.0, [1], 1), WorkItem(14.0, [1], 1), WorkItem(12.0, [1], 1)]
    assert [x.arrival_s for x in at_rate(w, 2.0)] == [0.0, 0.5, 1.0]  # 2 gaps in 1 s


def point(ttft: float | None, met: bool = True, done: int = 4) -> dict:
    return {"ttft_p50_s": ttft, "completed": done, "num_requests": 4,
            "tiers": {"0": {"tbt_p99_met": met}, "1": {"tbt_p99_met": True}}}


def test_capacity_is_the_highest_passing_rate_of_the_median_run() -> None:
    s = summarize_config({1.0: [point(0.3), point(0.5), point(0.4)],
                          2.0: [point(0.9, met=False), point(0.6), point(0.7)],   # median run 0.7 meets TBT
                          3.0: [point(0.8, met=False), point(0.9, met=False), point(0.7)],
                          4.0: [point(2.5), point(3.0), point(2.2)]}, ttft_target=2.0)
    assert s["rates"]["2.0"]["ttft_p50_s_median"] == 0.7 and s["rates"]["2.0"]["pass"]
    assert not s["rates"]["3.0"]["pass"] and not s["rates"]["4.0"]["pass"]
    assert s["capacity_rps"] == 2.0
    assert summarize_config({1.0: [point(0.1, done=3)]}, 2.0)["capacity_rps"] is None  # a failed request fails


def test_sweep_option_errors() -> None:
    assert parse_configs("fcfs:off,slai:default") == [("fcfs", "off"), ("slai", "default")]
    for bad in ("edf:off", "slai", "slai:turbo"):
        with pytest.raises(ValueError, match="SCHEDULER:MODE"):
            parse_configs(bad)
    assert parse_rates("3,1,2") == [1.0, 2.0, 3.0]
    for bad in ("a,b", "0,1"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)


def test_triton_slo_inputs_parse_and_check_shapes() -> None:
    arrays = {"ttft_slo_s": np.array([1.5], dtype=np.float32), "tbt_slo_s": np.array([[0.25]], dtype=np.float32),
              "priority": np.array([0], dtype=np.int32)}
    assert parse_slo_inputs(arrays.get) == SloInputs(1.5, 0.25, 0)
    assert parse_slo_inputs({}.get) == SloInputs()
    with pytest.raises(InputError, match="priority must hold exactly one INT32"):
        parse_slo_inputs({"priority": np.array([0, 1], dtype=np.int32)}.get)


def test_capacity_plot_draws_every_config(tmp_path) -> None:
    from workload.plots import capacity_plot

    s = {name: summarize_config({1.0: [point(0.3)], 2.0: [point(t)]}, 2.0) for name, t
         in (("fcfs:off", 2.5), ("slai:off", 0.8))}
    assert s["fcfs:off"]["capacity_rps"] == 1.0 and s["slai:off"]["capacity_rps"] == 2.0
    path = capacity_plot(s, 2.0, tmp_path / "capacity.png")
    assert path.stat().st_size > 1000
