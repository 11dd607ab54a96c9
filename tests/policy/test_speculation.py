"""The speculation controller's decisions from telemetry (pure): on at batch 1 when the measured costs and the
acceptance say it pays, off when the batch is large enough that verification wastes compute, off under KV pressure
and on again when calm, k capped by free blocks, a probe after low acceptance, reasons on every decision."""

from __future__ import annotations

import pytest

from policy.costs import StepCosts
from policy.speculation import (
    SpeculationConfig,
    SpeculationController,
    SpeculationTelemetry,
    batch_bucket,
    expected_tokens,
    precision_below,
)

# engines/smollm2-135m/step_costs.json as measured on the 2-core AMD EPYC (avx512) on 2026-12-04 (seconds)
COSTS = StepCosts(
    device="AMD EPYC (avx512, 2 cpus)", token_counts=(1, 8, 32, 128, 512),
    layer_s={"full": (0.000409, 0.001130, 0.002158, 0.005378, 0.018308),
             "int4": (0.000289, 0.000924, 0.002735, 0.007063, 0.022290),
             "int8": (0.000124, 0.000462, 0.001769, 0.007973, 0.021165)},
    rest_s=(0.003968, 0.006095, 0.012121, 0.037905, 0.183236))
LAYERS = ("full",) * 30


def tele(batch: int = 1, kv: float = 0.2, free: int = 100, waiting: int = 0, other: int = 0,
         layers: tuple[str, ...] = LAYERS, now: float = 0.0) -> SpeculationTelemetry:
    return SpeculationTelemetry(now_s=now, batch_size=batch, other_tokens=other, kv_usage=kv, kv_blocks_free=free,
                                num_waiting=waiting, draft_blocks=tuple(batch * ((k + 15) // 16) for k in range(1, 5)),
                                layer_precisions=layers, token_budget=512)


def controller(mode: str = "auto", **kw) -> SpeculationController:
    """A controller that has seen a plain decode step at every batch size measured as the model predicts it (machine
    factor 1)."""
    c = SpeculationController(SpeculationConfig(mode=mode, **kw), COSTS)
    for b in (1, 2, 4, 8, 16, 32, 64):
        c.observe("plain", 0.01, 0.01, b)
    return c


def test_batch_1_drafts_with_int8_when_acceptance_is_high():
    c = controller(prior_acceptance=0.9)
    d = c.decide(tele(batch=1))
    assert d.speculate and d.precision == "int8" and 1 <= d.k <= 4 and d.predicted_gain > 1.05
    assert "predicted x" in d.reason and "batch 1" in d.reason


def test_large_batch_runs_plain_verification_would_waste_compute():
    c = controller(prior_acceptance=0.9)
    c.observe("draft", 0.01, 0.01, 32)  # this bucket's draft and verify measured as the model predicts them
    c.observe("verify", 0.01, 0.01, 32)
    c.observe_acceptance("int8", 10, 9)
    c.observe_acceptance("int4", 10, 9)
    d = c.decide(tele(batch=32, free=1000))
    assert not d.speculate and d.predicted_gain < 1.0 and "<" in d.reason


def test_low_acceptance_turns_it_off_and_a_probe_comes_back():
    c = controller(prior_acceptance=0.9, probe_every=5)
    assert c.decide(tele()).speculate
    c.observe("draft", 0.01, 0.01)  # the step's draft and verify times, as the executor reports them
    c.observe("verify", 0.01, 0.01)
    for _ in range(20):
        c.observe_acceptance("int8", 4, 0)
        c.observe_acceptance("int4", 4, 0)
    decisions = [c.decide(tele(now=i)) for i in range(10)]
    assert not decisions[0].speculate
    probes = [i for i, d in enumerate(decisions) if d.speculate]
    assert probes and all(decisions[i].reason.startswith("probe") for i in probes)
    assert probes[0] == 4  # the 5th plain decision in a row (probe_every) drafts once


def test_kv_pressure_turns_it_off_and_calm_turns_it_on_again():
    c = controller(prior_acceptance=0.9)
    assert c.decide(tele(kv=0.5)).speculate
    d = c.decide(tele(kv=0.95))
    assert not d.speculate and d.reason.startswith("KV pressure")
    assert not c.decide(tele(kv=0.5, waiting=2)).speculate  # waiting requests: drafts' blocks are theirs
    d = c.decide(tele(kv=0.85))  # below kv_high but not calm yet (kv_calm 0.8): hysteresis
    assert not d.speculate and "not calm" in d.reason
    assert c.decide(tele(kv=0.7)).speculate


def test_k_is_capped_by_free_blocks_and_none_fits_runs_plain():
    c = controller(mode="always")
    t = SpeculationTelemetry(0.0, 2, 0, 0.3, 3, 0, (2, 3, 4, 4), LAYERS, 512)
    assert c.decide(t).k == 2  # k 3 would need 4 blocks, 3 are free
    t = SpeculationTelemetry(0.0, 2, 0, 0.3, 1, 0, (2, 3, 4, 4), LAYERS, 512)
    d = c.decide(t)
    assert not d.speculate and "no draft length fits" in d.reason


def test_prefill_in_the_batch_off_mode_and_no_costs():
    assert "other chunks" in controller().decide(tele(other=40)).reason
    assert not controller(mode="off").decide(tele()).speculate
    d = SpeculationController(SpeculationConfig(mode="auto"), None).decide(tele())
    assert not d.speculate and "no measured step costs" in d.reason
    d = SpeculationController(SpeculationConfig(mode="always"), None).decide(tele())
    assert d.speculate and d.k == 3 and d.precision == "int8"


def test_quantized_layers_draft_one_ladder_step_below_and_the_cost_model_reads_them():
    assert [precision_below(p, "int8") for p in ("full", "int8", "int4")] == ["int8", "int4", "int4"]
    assert precision_below("full", "int4") == "int4"
    c = controller()
    morphed = ("int8",) * 15 + ("full",) * 15
    assert c.draft_s(morphed, "int8", 1) == pytest.approx(
        15 * COSTS.layer_cost_s("int4", 1) + 15 * COSTS.layer_cost_s("int8", 1)
        + COSTS.rest_cost_s(1) * COSTS.ratio("int8", 1))
    assert c.plain_s(morphed, 1) < c.plain_s(LAYERS, 1)


def test_measured_step_times_correct_the_cost_model():
    c = controller(prior_acceptance=0.9)
    g0 = c.gain(tele(), "int8", 2)
    for _ in range(50):
        c.observe("verify", 0.01, 0.03)  # verification measured 3x slower than the costs say
    assert c.gain(tele(), "int8", 2) < g0
    assert not c.decide(tele()).speculate


def test_expected_tokens_and_config_checks():
    assert expected_tokens(1.0, 3) == 4 and expected_tokens(0.0, 3) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="speculation mode"):
        SpeculationConfig(mode="sometimes")
    with pytest.raises(ValueError, match="hysteresis"):
        SpeculationConfig(on_gain=1.0, off_gain=1.2)


def test_a_load_change_moves_every_prediction_alike():
    c = controller(prior_acceptance=0.9)
    g0 = c.gain(tele(batch=24, free=1000), "int8", 2)
    for _ in range(50):
        c.observe("plain", 0.01, 0.03)  # the machine got 3x slower (other work): plain steps measured slower
    assert c.plain_s(LAYERS, 1) == pytest.approx(3 * c.plain_s(LAYERS, 1, corrected=False), rel=0.02)
    assert c.gain(tele(batch=24, free=1000), "int8", 2) == pytest.approx(g0)
    c.observe("verify", 0.01, 0.06)  # verify measured 2x slower than the (3x loaded) model: its own factor moves
    assert c.correction("verify", 1) > 1.0


def test_an_unmeasured_draft_precision_is_probed_at_once_and_its_first_measurements_replace_the_priors():
    """A prior that predicts no gain (acceptance 0.5) does not keep a fresh controller plain for ``probe_every``
    iterations: it probes at its first decision; one verification at acceptance 1.0 and one draft / verify time
    each replace the prior and the 1.0 corrections outright, and the next decision drafts on them."""
    c = controller(prior_acceptance=0.5, probe_every=64)
    assert c.gain(tele(), "int8", 4) < 1.05 <= c.gain(tele(), "int8", 4, acceptance=1.0)
    d = c.decide(tele())
    assert d.speculate and d.reason.startswith("probe") and "never measured: int8, draft, verify" in d.reason
    c.observe_acceptance("int8", d.k, d.k)
    c.observe("draft", 0.010, 0.008)
    c.observe("verify", 0.020, 0.010)
    assert c.acceptance("int8") == 1.0
    assert c.correction("draft", 1) == pytest.approx(0.8) and c.correction("verify", 1) == pytest.approx(0.5)
    d = c.decide(tele())
    assert d.speculate and not d.reason.startswith("probe") and d.predicted_gain > 1.05
    c.observe("verify", 0.020, 0.030)  # later measurements: the median of the latest ones
    c.observe("verify", 0.020, 0.400)  # a warm-up or a step slowed by other work: one outlier
    assert c.correction("verify", 1) == pytest.approx(1.5)
    for _ in range(8):
        c.observe("verify", 0.020, 0.012)
    assert c.correction("verify", 1) == pytest.approx(0.6)  # the window (9) forgot the outlier's neighbours


def test_no_draft_before_a_plain_step_sets_the_machine_factor_and_later_factors_are_relative_to_it():
    """A fresh engine's first decode step is not a draft: the draft and verify factors are measured relative to the
    machine factor, and a draft timed before any plain step would fold the machine's slowness into them (then count
    it twice once a plain step is measured)."""
    c = SpeculationController(SpeculationConfig(prior_acceptance=0.9), COSTS)
    d = c.decide(tele())
    assert not d.speculate and "no plain decode step measured yet" in d.reason
    c.observe("plain", 0.010, 0.025)  # this machine runs 2.5x the model's step time
    assert c.decide(tele()).speculate
    c.observe("draft", 0.004, 0.010)  # as slow as the machine factor says: relative factor 1
    assert c.correction("draft", 1) == pytest.approx(1.0)
    assert c.draft_s(LAYERS, "int8", 1) == pytest.approx(2.5 * c.draft_s(LAYERS, "int8", 1, corrected=False))


def test_corrections_are_kept_per_batch_bucket():
    """A verify factor learned at batch 1 (memory-bound: nearly free) does not make batch 8 (compute-bound) look
    cheap: each bucket (1, 2-3, 4-7, 8-15, ...) has its own factors, and a bucket never measured probes first."""
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 7, 8, 15, 16)] == [1, 2, 2, 4, 4, 8, 8, 16]
    c = controller(prior_acceptance=0.9)
    for _ in range(3):
        c.observe("verify", 0.020, 0.005, 1)
    assert c.correction("verify", 1) == pytest.approx(0.25) and c.correction("verify", 8) == 1.0
    g8 = c.gain(tele(batch=8, free=1000), "int8", 2)
    c.observe("verify", 0.020, 0.060, 8)
    c.observe("verify", 0.020, 0.080, 9)  # 9 is in the bucket of 8
    assert c.correction("verify", 8) == pytest.approx(3.5) and c.correction("verify", 1) == pytest.approx(0.25)
    assert c.gain(tele(batch=8, free=1000), "int8", 2) < g8
    d = c.decide(tele(batch=4, free=1000))  # bucket 4 decides on its own factors (none measured there yet)
    assert "draft 1.00, verify 1.00 at batch 4+" in d.reason


def test_a_never_measured_bucket_is_probed_once_even_when_the_uncorrected_model_says_no():
    """A bucket whose gain at acceptance 1 reaches probe_gain (here 0.8: the uncorrected model is off by tens of
    percent) drafts once to measure itself, then decides on the measurement; below probe_gain (the default, on_gain)
    it never drafts."""
    c = controller(prior_acceptance=0.9, probe_gain=0.8)
    t = tele(batch=32, free=1000)
    assert c.gain(t, "int8", 1, acceptance=1.0) < 1.05
    d = c.decide(t)
    assert d.speculate and d.reason.startswith("probe") and "never measured: int8, draft, verify" in d.reason
    c.observe("draft", 0.01, 0.01, 32)
    c.observe("verify", 0.01, 0.01, 32)
    c.observe_acceptance("int8", 10, 9)
    c.observe_acceptance("int4", 10, 9)
    assert not c.decide(t).speculate
    assert not controller(prior_acceptance=0.9).decide(t).speculate
