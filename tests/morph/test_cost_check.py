"""The step-cost table checked while serving (serve/morph/cost_check.py, policy/cost_drift.py): an engine started on a
table three times too slow measures it again after two quiet probes and hands the new one to every manager that
weighs step costs; its kernel crossovers are measured again and made current.

No timing decides these tests: the measurements the check takes are stood in for by a fixed "quiet" table (a real
timing on a loaded test host can be anything), the verdict set to quiet (tests/model/test_step_costs_conditions.py
tests the verdict); what is tested is the rule acting on them and the correction reaching every manager."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from policy import FULL, StepCosts
from policy.measurement import Verdict
from serve.model import crossover_measure, crossovers
from serve.model import step_costs as sc

QUIET = Verdict(True, ())


def inflated(costs: StepCosts, factor: float) -> StepCosts:
    return StepCosts(costs.device, costs.token_counts, {p: tuple(v * factor for v in row)
                                                        for p, row in costs.layer_s.items()},
                     tuple(v * factor for v in costs.rest_s), dict(costs.meta))


def fixed_measurements(monkeypatch, quiet: StepCosts) -> None:
    """serve/morph/cost_check.py's measurements give ``quiet`` (its probe the same rows at the probe's token counts)."""
    from policy.measurement import Conditions
    from serve.morph import cost_check

    calm = Conditions(0.0, 0.0, 0.0, 0.0)

    def measured(layers, shape, device, dtype, head=None, token_counts=sc.TOKEN_COUNTS, repeats=7):
        rows = {p: tuple(quiet.layer_cost_s(p, n) for n in token_counts) for p in layers}
        rest = tuple(quiet._interp(quiet.rest_s, n) for n in token_counts) if head is not None and quiet.rest_s else ()
        return StepCosts(quiet.device, tuple(token_counts), rows, rest, dict(quiet.meta)), calm, QUIET
    monkeypatch.setattr(cost_check, "measure_checked", measured)


@dataclasses.dataclass
class Busy:
    """What the check reads of the scheduler (serve/resource_seam.py SchedulerView): whether anything is served."""
    running: int = 0
    waiting: int = 0

    def num_running(self) -> int:
        return self.running

    def num_waiting(self) -> int:
        return self.waiting


def test_a_table_three_times_too_slow_is_corrected_after_two_probes(tiny, tmp_path, monkeypatch) -> None:
    from serve.model.llama import LlamaModel
    from serve.morph.cost_check import CostCheck

    monkeypatch.setenv("MORPHSERVE_CACHE_DIR", str(tmp_path))
    remeasured = []
    chosen = crossovers.KernelCrossovers(fp32_kernel_max_rows=7, blocked_kernel_max_rows=5, int8_head_max_rows=3,
                                         source="measured while serving (test)")
    monkeypatch.setattr(crossover_measure, "measure_trusted",
                        lambda model, repeats=5: (remeasured.append(1) or chosen, {"values": chosen.values()}, QUIET))
    monkeypatch.setattr(crossover_measure, "store", lambda model, engine_dir, entry: [])
    model = LlamaModel(tiny.config, tiny.weights, device=torch.device("cpu"), dtype=torch.float32, max_positions=64)
    layers = {FULL: model.layers[0]}
    shape = (tiny.config.hidden_size, tiny.config.q_size, tiny.config.intermediate_size)
    quiet = StepCosts("test cpu", sc.TOKEN_COUNTS, {FULL: (1e-4, 2e-4, 5e-4, 2e-3, 8e-3)})
    fixed_measurements(monkeypatch, quiet)
    planted = inflated(quiet, 3.0)
    got: list[StepCosts] = []
    check = CostCheck(model, layers, shape, model.logits, planted, "planted", on_correct=got.append, first=1, every=1)
    try:
        check.on_step()
        assert not got and check.stats.probes == 1 and "1 of 2" in check.stats.last_reason
        check.on_step()
        assert not got and check.due is not None  # due, but requests are being served: none waits ~10 s for it
        check.before_schedule(Busy(running=1))          # a serving iteration: a third probe, no correction
        assert not got and check.due is not None
        check.before_schedule(Busy(running=0))        # nothing running or waiting: now
        assert len(got) == 1 and check.stats.corrections == 1 and check.due is None
        assert check.costs is got[0] and check.costs.layer_s == quiet.layer_s
        assert crossovers.current() == chosen and remeasured  # the kernel choices follow
        assert (tmp_path / sc.COSTS_FILE).is_file()  # a quiet measurement is this machine's
        assert check.resource_stats().engine_fields() == {"step_cost_probes": 3, "step_cost_corrections": 1}
    finally:
        crossovers.use(crossovers.DEFAULTS)


@pytest.mark.slow
def test_an_engine_on_an_inflated_table_converges_while_serving(tmp_path, monkeypatch) -> None:
    """The real embedded model's engine directory with its table (this machine's entry) multiplied by 3: the default
    mode's controller starts on it, and after the serving iterations (probes at 4 and 8) and one idle iteration it
    weighs the table measured again, which the speculation manager (always) gets too; the kernel crossovers are
    measured again for real and made current."""
    from serve.config import EngineConfig
    from serve.engine.engine import LLMEngine
    from serve.engine.sampling_params import SamplingParams
    from serve.engine.spec_manager import SpeculationManager
    from serve.morph.cost_check import CostCheck
    from serve.morph.runtime import MorphRuntime
    from serve.morph.setup import cost_inputs

    source = Path("engines/smollm2-135m")
    if not (source / "manifest.json").is_file():
        pytest.fail("needs make build-engines (engines/smollm2-135m)")
    eng = tmp_path / "eng"  # the engine directory, its files linked, its own step_costs.json
    eng.mkdir()
    for entry in source.iterdir():
        if entry.name not in (sc.COSTS_FILE, crossover_measure.CROSSOVERS_FILE):
            (eng / entry.name).symlink_to(entry.resolve())
    monkeypatch.setenv("MORPHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sc, "judge", lambda c: QUIET)
    monkeypatch.setattr(crossover_measure, "judge", lambda c: QUIET)  # the crossovers are really measured again
    config = EngineConfig(model=str(eng), morph_mode="default", num_kv_blocks=64, max_model_len=256, num_threads=2,
                          speculation="always")
    probe = LLMEngine(dataclasses.replace(config, speculation="off"))  # this machine's key and a fresh table
    runtime = probe.resource_manager(MorphRuntime)
    assert runtime is not None and runtime.costs is not None
    quiet = runtime.costs
    layers, shape, _ = cost_inputs(probe.model, runtime.bank)
    key = sc.machine_key(probe.model.device, probe.model.dtype, shape)
    probe.shutdown()
    sc.cache_path().unlink()  # the probe's quiet table: the engine must start on the planted one
    fixed_measurements(monkeypatch, quiet)
    entry = {**inflated(quiet, 3.0).to_dict(), "meta": {"key": key}}
    (eng / sc.COSTS_FILE).write_text(json.dumps({sc.key_id(key): entry}))
    engine = LLMEngine(config)
    try:
        runtime = engine.resource_manager(MorphRuntime)
        spec = engine.resource_manager(SpeculationManager)
        check = engine.resource_manager(CostCheck)
        check.first, check.every = 4, 4  # probes sooner than a serving engine's schedule: two within this run
        assert runtime.costs.layer_cost_s(FULL, 1) == pytest.approx(3 * quiet.layer_cost_s(FULL, 1))
        engine.generate(["Tell me about rivers."] * 4, SamplingParams(max_tokens=40, ignore_eos=True))
        assert check.stats.corrections == 0 and check.due is not None, check.stats.as_dict()  # never mid-request
        engine.step()  # an iteration with nothing to serve: the due correction
        assert check.stats.corrections == 1, check.stats.as_dict()
        now = runtime.controller.costs
        assert now is check.costs and spec.controller.costs is now
        assert now.layer_s.keys() == quiet.layer_s.keys()  # the planted 3x table is gone (equal up to rounding: the
        assert all(now.layer_s[p] == pytest.approx(quiet.layer_s[p], rel=1e-9) for p in quiet.layer_s)  # interpolation)
        assert "measured" in crossovers.current().source
    finally:
        engine.shutdown()
        crossovers.use(crossovers.DEFAULTS)


def test_the_latest_table_wins_and_the_operator_control_needs_one(tiny, tmp_path, monkeypatch) -> None:
    """A table corrected while serving (the per-user cache) is newer than the build's (the engine directory): the next
    engine and the planner read it. An engine that weighs no table refuses the operator's re-measure by name."""
    from serve.config import EngineConfig
    from serve.engine.controls import ControlError, run_control
    from serve.engine.engine import LLMEngine
    from serve.model.llama import LlamaModel

    monkeypatch.setenv("MORPHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = LlamaModel(tiny.config, tiny.weights, device=torch.device("cpu"), dtype=torch.float32, max_positions=64)
    layers = {FULL: model.layers[0]}
    shape = (tiny.config.hidden_size, tiny.config.q_size, tiny.config.intermediate_size)
    key = sc.machine_key(model.device, model.dtype, shape)
    old = StepCosts("cpu", (1, 8), {FULL: (3e-3, 6e-3)}, meta={"measured": "2026-12-06T10:00:00Z"})
    new = StepCosts("cpu", (1, 8), {FULL: (1e-3, 2e-3)}, meta={"measured": "2026-12-07T10:00:00Z"})
    eng = tmp_path / "eng"
    eng.mkdir()
    sc.store(eng / sc.COSTS_FILE, key, old)
    sc.store(sc.cache_path(), key, new)
    got, source = sc.load_or_measure(layers, shape, model.device, model.dtype, engine_dir=eng)
    assert got.layer_s == new.layer_s and source == str(sc.cache_path())
    engine = LLMEngine(EngineConfig(num_kv_blocks=8, block_size=4, max_model_len=64), loaded=tiny)
    try:
        with pytest.raises(ControlError, match="weighs no step-cost table"):
            run_control(engine, "remeasure_costs", {})
    finally:
        engine.shutdown()
