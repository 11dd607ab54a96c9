"""The KV-precision rung's rule (policy/kv_rung.py): when it converts free slots to 8-bit blocks, how many, when it
reverts, and that every decision says why."""

from __future__ import annotations

import pytest

from policy import PolicyConfig
from policy.kv_rung import KV_PRICE_PCT, LAYER_PRICE_PCT, KVRungRule, KVRungTelemetry


def _t(used: int, total: int = 100, free_slots: int = 10, now: float = 0.0, **kw) -> KVRungTelemetry:
    return KVRungTelemetry(now_s=now, kv_blocks_total=total, kv_blocks_used=used, free_full_slots=free_slots,
                           blocks_per_slot=3.75, kv_blocks_8bit=kw.pop("blocks8", 0),
                           top_free=kw.pop("top_free", False),
                           **kw)


def test_pressure_converts_every_free_full_precision_slot():
    rule = KVRungRule("int8", kv_high=0.85, kv_low=0.6, calm_s=5.0)
    d = rule.decide(_t(used=90, total=100, free_slots=10))
    assert d.action == "convert" and d.slots == 10 and "kv_high" in d.reason and "~27 more blocks" in d.reason
    assert rule.decide(_t(used=84, total=100, free_slots=16)).action == "none"


def test_waiting_prompts_that_do_not_fit_are_pressure_too():
    rule = KVRungRule("int8", kv_high=0.85, kv_low=0.6, calm_s=5.0)
    d = rule.decide(_t(used=10, total=100, free_slots=90, blocks_needed_waiting=200))
    assert d.action == "convert" and d.slots == 90 and "waiting prompts need 200 blocks, 90 free" in d.reason
    assert rule.decide(_t(used=10, total=100, free_slots=90, blocks_needed_waiting=90)).action == "none"


def test_no_free_slot_or_a_cheaper_layer_swap_means_no_conversion():
    rule = KVRungRule("int8", kv_high=0.85, kv_low=0.6, calm_s=5.0)
    d = rule.decide(_t(used=99, free_slots=0))
    assert d.action == "none" and "no free full-precision slot" in d.reason
    # a layer swap that frees a huge extent is cheaper per block than 8-bit KV (an absurd layer, to show the weighing)
    d = rule.decide(_t(used=90, free_slots=10, layer_extent_blocks=10**9, layer_precision="int8"))
    assert d.action == "none" and "layer swap to int8 costs less" in d.reason
    rung, layer = rule.price_per_block(_t(used=90, free_slots=10, layer_extent_blocks=56), 10)
    assert rung < layer / 10  # at the stated prices the rung is far cheaper than an int4 swap of 56 blocks
    assert KV_PRICE_PCT["int8"] < LAYER_PRICE_PCT["int4"]


def test_calm_reverts_the_newest_free_extent_after_calm_s_lifo():
    rule = KVRungRule("int8", kv_high=0.85, kv_low=0.6, calm_s=5.0)
    calm = dict(total=130, free_slots=0, blocks8=40, top_blocks=40, top_slots=10)
    d = rule.decide(_t(used=20, now=0.0, top_free=False, **calm))
    assert d.action == "none" and "in use or not the pool's newest" in d.reason
    assert rule.decide(_t(used=20, now=1.0, top_free=True, **calm)).action == "none"  # calm starts
    d = rule.decide(_t(used=20, now=3.0, top_free=True, **calm))
    assert d.action == "none" and "calm for 2.00 s of 5.0 s" in d.reason
    d = rule.decide(_t(used=20, now=6.0, top_free=True, **calm))
    assert d.action == "revert" and d.slots == 10
    # usage after the revert (70 / 100) above kv_low: stays
    d = rule.decide(_t(used=70, now=20.0, top_free=True, **calm))
    assert d.action == "none" and "would be 0.70" in d.reason


def test_the_policy_field_is_validated():
    assert PolicyConfig.for_mode("default", kv_rung="int8").kv_rung == "int8"
    assert PolicyConfig.for_mode("default").kv_rung == "auto"
    assert PolicyConfig.for_mode("default", kv_rung=None).kv_rung is None
    assert PolicyConfig.for_mode("performance").kv_rung is None and PolicyConfig.for_mode("off").kv_rung is None
    with pytest.raises(ValueError, match="kv_rung must be one of auto, int8, fp8 or null"):
        PolicyConfig.for_mode("default", kv_rung="int4")
    with pytest.raises(ValueError, match="int8 or fp8"):
        KVRungRule("int4", 0.85, 0.6, 1.0)


def test_without_free_slots_it_rewrites_just_the_running_blocks_the_pressure_needs():
    """No free slot left: cold running blocks, each gaining 2.75 blocks, only as many as bring usage back to the middle
    of the band (0.725 here: 100 used need 138 blocks, 38 more = 14 blocks) or cover the waiting prompts, never more
    than there are; none when there is none."""
    rule = KVRungRule("int8", kv_high=0.85, kv_low=0.6, calm_s=5.0)
    d = rule.decide(_t(used=100, total=100, free_slots=0, cold_blocks=40))
    assert d.action == "convert" and (d.slots, d.blocks) == (0, 14) and "14 cold block(s) of running" in d.reason
    d = rule.decide(_t(used=50, total=100, free_slots=0, cold_blocks=40, blocks_needed_waiting=61))
    assert (d.action, d.slots, d.blocks) == ("convert", 0, 4)  # 11 short: 4 x 2.75 = 11
    d = rule.decide(_t(used=100, total=100, free_slots=0, cold_blocks=5))
    assert (d.slots, d.blocks) == (0, 5)
    d = rule.decide(_t(used=99, free_slots=0, cold_blocks=0))
    assert d.action == "none" and "no cold running block" in d.reason
    # free slots first: with 10 of them (27.5 blocks) at kv_high only what they leave short
    d = rule.decide(_t(used=90, total=100, free_slots=10, cold_blocks=40))
    assert (d.slots, d.blocks) == (10, 0)  # 90 / 127.5 = 0.71 < 0.725
    d = rule.decide(_t(used=100, total=100, free_slots=4, cold_blocks=40))
    assert (d.slots, d.blocks) == (4, 10)  # 38 short - 11 from the slots = 27 -> 10 blocks


def test_a_shortfall_takes_free_slots_then_running_blocks_and_a_cheaper_swap_keeps_running_blocks():
    rule = KVRungRule("int8", kv_high=0.85, kv_low=0.6, calm_s=5.0)
    d = rule.for_shortfall(_t(used=98, total=100, free_slots=2, cold_blocks=30), 12)
    assert (d.action, d.slots, d.blocks) == ("convert", 2, 3) and "shortfall of 12" in d.reason  # 12 - 5.5 -> 3
    d = rule.for_shortfall(_t(used=100, total=100, free_slots=0, cold_blocks=30), 3)
    assert (d.slots, d.blocks) == (0, 2)
    d = rule.decide(_t(used=100, free_slots=0, cold_blocks=40, layer_extent_blocks=10**9, layer_precision="int8"))
    assert d.action == "none" and "layer swap to int8 costs less" in d.reason


def test_auto_is_int8_only_where_it_is_verified():
    """kv_rung auto: int8 on a CPU engine computing in fp32 over a full-precision cache in a dynamic mode; no rung
    on CUDA (the fp8 rung has not run on a GPU), over a static 8-bit cache, in bf16, or without morphing; an
    explicit format is kept as asked."""
    from policy import resolve_kv_rung  # noqa: PLC0415

    default = PolicyConfig.for_mode("default")
    assert resolve_kv_rung(default, "cpu", True, "auto").kv_rung == "int8"
    assert resolve_kv_rung(default, "cuda", False, "auto").kv_rung is None
    assert resolve_kv_rung(default, "cpu", True, "int8").kv_rung is None
    assert resolve_kv_rung(default, "cpu", False, "auto").kv_rung is None
    assert resolve_kv_rung(PolicyConfig.for_mode("off", kv_rung="auto"), "cpu", True, "auto").kv_rung is None
    assert resolve_kv_rung(PolicyConfig.for_mode("default", kv_rung="fp8"), "cuda", False, "auto").kv_rung == "fp8"
