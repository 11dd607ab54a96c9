"""SLO pressure from the slai scheduler as a controller input: policy rules, then the engine wiring."""

from __future__ import annotations

import pytest

from policy import MorphController, PolicyConfig, Telemetry

SWAP_ORDER = (3, 1, 0, 2)
EXTENT = {"int4": 10}


def telemetry(now: float, **kw: object) -> Telemetry:
    return Telemetry(now_s=now, kv_blocks_total=100, kv_blocks_used=10, num_layers=4, blocks_per_layer_extent=EXTENT,
                     **kw)  # type: ignore[arg-type]


def test_unscheduled_critical_decodes_are_pressure() -> None:
    ctl = MorphController(PolicyConfig.for_mode("performance"), SWAP_ORDER)  # persist 1 iteration
    d = ctl.decide(telemetry(0.1, num_running=4, critical_decodes_unscheduled=1))
    assert d.action == "quantize" and d.layers == (3,) and "critical decode" in d.reason
    assert ctl.decide(telemetry(0.2, num_running=4)).action == "none"  # no signal, low KV: no pressure


def test_ttft_slack_below_threshold_is_pressure_before_the_deadline() -> None:
    ctl = MorphController(PolicyConfig.for_mode("performance", queue_delay_high_s=10.0), SWAP_ORDER)
    # 0.8 s left of this request's own TTFT target: not missed yet, but below performance's 1.0 s.
    d = ctl.decide(telemetry(0.1, num_waiting=1, oldest_wait_s=0.2, min_ttft_slack_s=0.8))
    assert d.action == "quantize" and "TTFT target is 800 ms away" in d.reason
    ctl = MorphController(PolicyConfig.for_mode("performance", queue_delay_high_s=10.0), SWAP_ORDER)
    assert ctl.decide(telemetry(0.1, num_waiting=1, oldest_wait_s=0.2, min_ttft_slack_s=1.2)).action == "none"


def test_slo_signals_respect_persistence_and_thresholds() -> None:
    ctl = MorphController(PolicyConfig.for_mode("accuracy"), SWAP_ORDER)  # persist 6, critical_decodes_high 2
    for i in range(10):
        assert ctl.decide(telemetry(0.1 * i, critical_decodes_unscheduled=1)).action == "none"
    decisions = [ctl.decide(telemetry(1 + 0.1 * i, critical_decodes_unscheduled=2)).action for i in range(6)]
    assert decisions == ["none"] * 5 + ["quantize"]


def test_slo_pressure_can_be_switched_off() -> None:
    cfg = PolicyConfig.for_mode("performance", critical_decodes_high=None, ttft_slack_low_s=None,
                                queue_delay_high_s=10.0)
    ctl = MorphController(cfg, SWAP_ORDER)
    assert ctl.decide(telemetry(0.1, num_waiting=1, critical_decodes_unscheduled=9,
                                min_ttft_slack_s=-1.0)).action == "none"


def test_slo_pressure_blocks_restore() -> None:
    ctl = MorphController(PolicyConfig.for_mode("performance", restore_persist_s=0.0, queue_delay_high_s=10.0),
                          SWAP_ORDER)
    q = {"quantized_layers": ((3, "int4"),), "pending_restore_extent_free": True}
    d = ctl.decide(telemetry(0.1, critical_decodes_unscheduled=1, **q))
    assert d.action == "quantize"  # pressure wins over calm
    assert ctl.decide(telemetry(0.2, **q)).action == "restore"


@pytest.mark.parametrize("overrides, match", [
    ({"critical_decodes_high": 0}, "critical_decodes_high"), ({"critical_decodes_high": True}, "critical_decodes_high"),
    ({"ttft_slack_low_s": -0.1}, "ttft_slack_low_s"), ({"ttft_slack_low_s": float("inf")}, "ttft_slack_low_s"),
])
def test_slo_threshold_validation(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PolicyConfig.for_mode("default", **overrides)
    with pytest.raises(ValueError, match="critical_decodes_unscheduled"):
        telemetry(0.0, critical_decodes_unscheduled=-1)
