"""A serving engine's check of its step-cost table against its own machine, and the correction (policy/cost_drift.py).

A resource manager of the engine (serve/resource_seam.py), after the levers that read the table: it counts the
iterations that serve something, and now and then (after ``first`` of them, then every ``every``) times a probe: the
full-precision linears of the first ``PROBE_LAYERS`` layers one after another (on CUDA layer 0) at 8 tokens, three
repeats, under the conditions check of policy/measurement.py. Only at 8: with the table timed on layer 0 repeated,
in quiet probes inside a serving loop the 1- and 32-token cells disagreed with it by more than the band while 8
tokens agreed, so a check there corrected a right table at every engine start. The rule compares the probe with the
table; when quiet probes say the table is off, the correction is due: at the next iteration with nothing running or
waiting (measuring the table takes ~10 s on 2 cores, which no running request should wait for) the whole table is
measured again (quietly, else the old one stays) and handed to ``on_correct`` (the morph controller and the
speculation controller take it), written back to the per-machine cache, and the kernel crossovers are measured again
and made current (quietly, else they stay). Every decision is logged with its reason; the counts are stats.

``remeasure()`` does the correction at once (the operator's ``remeasure_costs`` control). Its stats fill
``EngineStats.step_cost_probes`` / ``step_cost_corrections`` (metrics ``morphserve_step_cost_*_total``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from policy import FULL, StepCosts
from policy.cost_drift import DriftDecision, DriftRule
from serve.logging_setup import get_logger
from serve.model import crossover_measure, crossovers
from serve.model.llama import DecoderLayer, LlamaModel
from serve.model.step_costs import cache_path, machine_key, measure_checked, store
from serve.resource_seam import ResourceManagerBase, SchedulerView

log = get_logger("morphserve.cost_check")

PROBE_TOKENS = (8,)
PROBE_LAYERS = 6
"""Layers the probe streams on CPU (the table streams them all): more than the caches hold, so each is read from
memory as in a step, and few enough that a probe inside the serving loop stays near 30 ms on 2 cores."""


@dataclass
class CostCheckStats:
    probes: int = 0
    corrections: int = 0
    last_reason: str = ""
    table_source: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"probes": self.probes, "corrections": self.corrections, "last_reason": self.last_reason,
                "table_source": self.table_source}

    def engine_fields(self) -> dict[str, Any]:
        return {"step_cost_probes": self.probes, "step_cost_corrections": self.corrections}


class CostCheck(ResourceManagerBase):
    name = "cost_check"

    def __init__(self, model: LlamaModel, layers: Mapping[str, DecoderLayer], shape: tuple[int, int, int],
                 head: Callable[[torch.Tensor], torch.Tensor], costs: StepCosts, source: str,
                 on_correct: Callable[[StepCosts], None], first: int = 16, every: int = 256,
                 rule: DriftRule | None = None) -> None:
        self.model, self.layers, self.shape, self.head = model, dict(layers), shape, head
        self.costs = costs
        self.on_correct = on_correct
        self.first, self.every = first, every
        self.rule = rule or DriftRule()
        self.stats = CostCheckStats(table_source=source)
        self._steps = 0
        self.due: str | None = None  # why a correction is due (it runs when nothing is running or waiting)

    def before_schedule(self, scheduler: SchedulerView) -> None:
        """Each iteration that serves something counts, with a probe when one is due; an idle one makes a due
        correction."""
        if scheduler.num_running() or scheduler.num_waiting():
            self.on_step()
        elif self.due is not None:
            why, self.due = self.due, None
            self.remeasure(why)

    def resource_stats(self) -> CostCheckStats:
        return self.stats

    def on_step(self) -> None:
        """A serving step: probe when one is due (the first after ``first`` steps, then every ``every``)."""
        self._steps += 1
        due = self._steps == self.first or (self._steps > self.first and (self._steps - self.first) % self.every == 0)
        if due:
            self.check()

    def check(self) -> DriftDecision:
        """One probe and the rule's decision; a correction due when it says so."""
        model = self.model
        full = self.layers[FULL]
        layers = full[:PROBE_LAYERS] if isinstance(full, list) else full  # streamed like a step, but a few ms
        probe, _, verdict = measure_checked({FULL: layers}, self.shape, model.device, model.dtype,
                                            token_counts=PROBE_TOKENS, repeats=3)
        self.stats.probes += 1
        ratios = {n: probe.layer_cost_s(FULL, n) / self.costs.layer_cost_s(FULL, n) for n in PROBE_TOKENS}
        decision = self.rule.observe(ratios, verdict.trusted, verdict.why())
        log.info("step_costs_probe", correct=decision.correct, reason=decision.reason,
                 ratios={n: round(r, 3) for n, r in ratios.items()})
        self.stats.last_reason = decision.reason
        if decision.correct:
            self.due = decision.reason
        return decision

    def remeasure(self, why: str = "asked by the operator") -> dict[str, Any]:
        """Measure the table and the kernel crossovers again; use and cache what was measured quietly."""
        model = self.model
        t0 = time.perf_counter()
        costs, conditions, verdict = measure_checked(self.layers, self.shape, model.device, model.dtype,
                                                     head=self.head, repeats=3)
        answer: dict[str, Any] = {"why": why, "trusted": verdict.trusted, "verdict": verdict.why(),
                                  "conditions": conditions.as_dict()}
        if not verdict.trusted:
            log.warning("step_costs_not_corrected", why=why, verdict=verdict.why())
            return answer
        old = self.costs
        self.costs = costs
        self.on_correct(costs)
        self.stats.corrections += 1
        self.stats.table_source = f"measured while serving ({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())})"
        try:
            store(cache_path(), machine_key(model.device, model.dtype, self.shape), costs)
        except OSError as exc:
            answer["cache"] = f"not written: {exc}"
        answer["crossovers"] = self._crossovers()
        answer["full_ratio"] = {n: round(costs.layer_cost_s(FULL, n) / old.layer_cost_s(FULL, n), 3)
                                for n in costs.token_counts}
        log.warning("step_costs_corrected", why=why, seconds=round(time.perf_counter() - t0, 3),
                    new_over_old=answer["full_ratio"], crossovers=answer["crossovers"])
        return answer

    def _crossovers(self) -> dict[str, Any]:
        """The kernel crossovers measured again (fp32 CPU models only); made current and cached when quiet."""
        model = self.model
        if model.device.type != "cpu" or model.dtype != torch.float32:
            return {"note": "no kernel crossovers on this device"}
        found, entry, verdict = crossover_measure.measure_trusted(model, repeats=3)
        if not verdict.trusted:
            return {"trusted": False, "verdict": verdict.why(), "kept": crossovers.current().values()}
        crossovers.use(found)
        try:
            crossover_measure.store(model, None, entry)
        except OSError:
            pass
        return {"trusted": True, "values": found.values()}
