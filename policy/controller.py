"""The MorphServe controller: telemetry in, one ``MorphDecision`` out per iteration.

Pure and deterministic: no clock (time comes in ``Telemetry.now_s``), no threads,
no I/O. The only state it keeps is its hysteresis (how many consecutive calls saw
pressure, and since when it has been calm); which layers are quantized is read
from the telemetry every time, so the engine stays the single source of truth.

Rules (dynamic modes):

* Quantize. Pressure must be seen on ``persist_iters`` consecutive calls. The
  step then covers the block deficit, as in the paper's released code:
  ``k = ceil(deficit_blocks / blocks_per_layer_extent[precision])``, capped by
  ``max_layers_per_step`` and by the room left under ``max_quantized_fraction``.
  New layers are taken in swap (LIS) order and go to ``ladder[0]``. When no room
  is left, layers already at ladder index ``i`` move to ladder index ``i + 1`` (e.g. int8 -> int4),
  again in swap order, the mildest ladder step first; the gain per layer is then the
  difference of the two extents. After a quantize step the streak restarts, so two
  steps are always at least ``persist_iters`` calls apart.
* Restore. Calm = no pressure, nothing waiting, KV usage below ``kv_low`` and TTFT
  within SLO. After ``restore_persist_s`` seconds of unbroken calm, the most
  recent transition (last of ``Telemetry.quantized_layers``; LIFO) is undone: the
  layer goes one step back on the ladder (int4 -> int8) or to full precision, and
  to full precision, but only if its KV extent is entirely free
  (``pending_restore_extent_free``) and shrinking the pool by that extent would not
  push KV usage above ``kv_high`` (which would re-trigger pressure at once). One
  layer per decision; the calm period restarts after each restore.

Cost-aware modes (``PolicyConfig.cost_aware`` with measured ``StepCosts``; ``policy/cost_rule.py``):

* the ladder is the mode's precisions ordered by measured slowdown per freed block, fixed at the first
  decision (a restore must find the ladder step a layer came from);
* a quantize step under memory pressure (a block deficit: waiting prompts short of blocks, KV above
  ``kv_high``) is sized as above, then taken only if the decode throughput with the admitted requests
  and the slower steps beats the throughput without them; under compute pressure alone only a
  precision faster than the current one at this step's size is taken;
* a layer whose precision makes steps slower here is restored after ``slow_restore_persist_s`` of
  calm (nothing waiting, no pressure, pool after the shrink at most ``kv_high``) instead of waiting for
  ``restore_persist_s`` with KV below ``kv_low``.

Where the measured quantized kernels are not slower, every rule above reduces to the cost-blind one.

The quality floor (``PolicyConfig.quality_floor``, and per SLO tier ``quality_floor_by_tier``, off by default;
policy/quality.py ``FloorRule``): the quality meter's reading comes in the telemetry, with the tiers running; the floor
in force is the strictest of the server's and those tiers'. While its lower bound on top-1 agreement is under it, no
quantizing step is taken (under pressure, and to cover a deficit before preempting: the scheduler then preempts); when
it has stayed under for ``quality_restore_s`` (and the measured agreement is under the floor too), the newest
transition is restored first, under pressure or not, as soon as its KV extent is free. Every reason carries the
reading.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from . import cost_rule
from .costs import StepCosts
from .decision import MorphDecision
from .memory_yield import YieldRule, mib
from .modes import PolicyConfig
from .quality import FloorRule, FloorVerdict
from .telemetry import Telemetry


def describe(t: Telemetry) -> str:
    """Compact summary of the signals, appended to every decision's reason."""
    parts = [
        f"kv {t.kv_usage:.1%} ({t.kv_blocks_used}/{t.kv_blocks_total} used, {t.kv_blocks_free} free)",
        f"running {t.num_running}",
        f"waiting {t.num_waiting} (oldest {t.oldest_wait_s * 1e3:.0f} ms, needs {t.blocks_needed_waiting} blocks)",
    ]
    if t.ttft_p95_s is not None:
        parts.append(f"ttft_p95 {t.ttft_p95_s:.3f} s")
    if t.tbt_p99_s is not None:
        parts.append(f"tbt_p99 {t.tbt_p99_s * 1e3:.1f} ms")
    if t.critical_decodes_unscheduled:
        parts.append(f"critical decodes unscheduled {t.critical_decodes_unscheduled}")
    if t.min_ttft_slack_s is not None:
        parts.append(f"ttft slack {t.min_ttft_slack_s * 1e3:.0f} ms")
    if t.device_mem_used_bytes is not None and t.device_mem_total_bytes:
        parts.append(f"device mem {t.device_mem_used_bytes / t.device_mem_total_bytes:.1%}")
    if t.memory_free_bytes is not None:
        parts.append(f"{t.memory_source or 'outside'} free {mib(t.memory_free_bytes)}")
    if t.yielded_bytes:
        parts.append(f"yielded {mib(t.yielded_bytes)}")
    parts.append(f"quantized {len(t.quantized_layers)}/{t.num_layers}")
    if t.quality is not None:
        parts.append(t.quality.describe())
    return "[" + ", ".join(parts) + "]"


class MorphController:
    """Decides, once per engine iteration, which layers to quantize or restore."""

    def __init__(self, config: PolicyConfig, swap_order: Sequence[int], costs: StepCosts | None = None) -> None:
        order = tuple(swap_order)
        if not order or sorted(order) != list(range(len(order))):
            raise ValueError(f"swap_order must be a permutation of 0..n-1, got {order}")
        self.config = config
        self.swap_order = order
        self.costs = costs if config.cost_aware else None
        self._ladder: tuple[str, ...] | None = None if self.costs is not None else config.ladder
        self._pressure_streak = 0
        self._calm_since: float | None = None
        self.yield_rule = YieldRule(config, order)
        self.floor = FloorRule(config.quality_floor, config.quality_restore_s, config.quality_floor_by_tier)

    def use_costs(self, costs: StepCosts) -> None:
        """A corrected step-cost table (policy/cost_drift.py): the cost rule weighs it from the next decision on,
        and the cost-ranked ladder is ranked again."""
        if self.config.cost_aware:
            self.costs = costs
            self._ladder = None

    def ladder(self, t: Telemetry) -> tuple[str, ...]:
        """The ladder steps in use: the mode's, or (cost-aware) ranked by measured cost at the first decision."""
        if self._ladder is None:
            assert self.costs is not None
            self._ladder = cost_rule.cost_ladder(self.config.ladder, self.costs, t.blocks_per_layer_extent) \
                or self.config.ladder
        return self._ladder

    @property
    def max_quantized_layers(self) -> int:
        """Most layers that may be quantized at once (floor of the fraction)."""
        return math.floor(self.config.max_quantized_fraction * len(self.swap_order) + 1e-9)

    def decide(self, t: Telemetry) -> MorphDecision:
        if t.num_layers != len(self.swap_order):
            raise ValueError(f"telemetry has {t.num_layers} layers, swap order has {len(self.swap_order)}")
        strategy = self.config.strategy
        if strategy == "off":
            return MorphDecision.nothing(f"mode {self.config.mode}: never morphs {describe(t)}")
        if strategy == "static":
            return self._static(t)
        memory = self.yield_rule.decide(t, self.ladder(t), describe)
        if memory is not None and (memory.action != "none" or self.yield_rule.short_bytes > 0):
            return memory  # outside memory first: a co-tenant's out-of-memory error outranks our queue
        decision = self._dynamic(t)
        if decision.action == "none" and memory is not None:
            return memory  # the reclaim rule's reason for waiting is the one that says why nothing moves
        return decision

    # -- static baselines ---------------------------------------------------------

    def _static(self, t: Telemetry) -> MorphDecision:
        target = self.config.ladder[0]
        precision_of = t.precision_of
        todo = tuple(layer for layer in self.swap_order if precision_of.get(layer) != target)
        if not todo:
            return MorphDecision.nothing(
                f"mode {self.config.mode}: all {t.num_layers} layers at {target}, never restores {describe(t)}"
            )
        return MorphDecision(
            "quantize", todo, target,
            f"mode {self.config.mode}: quantize all remaining {len(todo)} layer(s) to {target} {describe(t)}",
        )

    # -- dynamic (MorphServe) -----------------------------------------------------

    def _floor(self, t: Telemetry) -> FloorVerdict:
        return self.floor.check(t.now_s, t.quality, bool(t.quantized_layers) or t.quality is not None, t.running_tiers)

    def _dynamic(self, t: Telemetry) -> MorphDecision:
        floor = self._floor(t)
        if floor.restore and t.quantized_layers:
            return self._floor_restore(t, floor)
        triggers, deficit = self._pressure(t)
        if triggers:
            self._calm_since = None
            self._pressure_streak += 1
            persist = self.config.persist_iters
            if self._pressure_streak < persist:
                return MorphDecision.nothing(
                    f"pressure ({'; '.join(triggers)}) seen {self._pressure_streak}/{persist} iterations, "
                    f"waiting for it to persist {describe(t)}"
                )
            decision = self._quantize_step(t, triggers, deficit, memory=self._memory_deficit(t) > 0, floor=floor)
            if decision.action == "quantize":
                self._pressure_streak = 0
            return decision
        self._pressure_streak = 0
        return self._maybe_restore(t)

    def _pressure(self, t: Telemetry) -> tuple[list[str], int]:
        """Triggered pressure signals (empty if none) and the KV block deficit (>= 1 under pressure)."""
        c = self.config
        triggers: list[str] = []
        deficit = 0
        if t.kv_usage > c.kv_high:
            triggers.append(f"kv usage {t.kv_usage:.1%} > kv_high {c.kv_high:.0%}")
            # Blocks to add so that used / total falls back to kv_high.
            deficit = max(deficit, math.ceil(t.kv_blocks_used / c.kv_high - 1e-9) - t.kv_blocks_total)
        if t.oldest_wait_s > c.queue_delay_high_s:
            triggers.append(f"queueing delay {t.oldest_wait_s * 1e3:.0f} ms > {c.queue_delay_high_s * 1e3:.0f} ms")
        if t.blocks_needed_waiting > t.kv_blocks_free:
            triggers.append(f"waiting prompts need {t.blocks_needed_waiting} blocks > {t.kv_blocks_free} free")
            deficit = max(deficit, t.blocks_needed_waiting - t.kv_blocks_free)
        if t.num_waiting and t.ttft_p95_s is not None and t.ttft_p95_s > c.ttft_slo_s:
            triggers.append(f"ttft_p95 {t.ttft_p95_s:.3f} s > SLO {c.ttft_slo_s} s with {t.num_waiting} waiting")
        if c.critical_decodes_high is not None and t.critical_decodes_unscheduled >= c.critical_decodes_high:
            triggers.append(f"{t.critical_decodes_unscheduled} critical decode(s) left out of the last batch "
                            f">= {c.critical_decodes_high}")
        if (c.ttft_slack_low_s is not None and t.min_ttft_slack_s is not None
                and t.min_ttft_slack_s < c.ttft_slack_low_s):
            triggers.append(f"a waiting request's TTFT target is {t.min_ttft_slack_s * 1e3:.0f} ms away "
                            f"< {c.ttft_slack_low_s * 1e3:.0f} ms")
        return triggers, (max(deficit, 1) if triggers else 0)

    def _memory_deficit(self, t: Telemetry) -> int:
        """Blocks short: of the waiting prompts' needs, or of bringing KV usage back under ``kv_high``."""
        deficit = max(0, t.blocks_needed_waiting - t.kv_blocks_free)
        if t.kv_usage > self.config.kv_high:
            deficit = max(deficit, math.ceil(t.kv_blocks_used / self.config.kv_high - 1e-9) - t.kv_blocks_total)
        return deficit

    def _quantize_step(self, t: Telemetry, triggers: list[str], deficit: int, memory: bool,
                       always_pays: bool = False, floor: FloorVerdict | None = None) -> MorphDecision:
        c = self.config
        if floor is not None and floor.hold:
            return MorphDecision.nothing(f"pressure ({'; '.join(triggers)}) but the quality floor holds: "
                                         f"{floor.reason} {describe(t)}")
        ladder = self.ladder(t)
        precision_of = t.precision_of
        extent = t.blocks_per_layer_extent
        room = self.max_quantized_layers - len(precision_of)
        candidates: list[int] = []
        target, milder, gain, what = ladder[0], "full", 0, ""
        if room > 0:
            candidates = [layer for layer in self.swap_order if layer not in precision_of][:room]
            gain = extent.get(target, 0)
            what = f"{room} layer(s) left under max_quantized_fraction {c.max_quantized_fraction}"
        else:
            for milder, target in zip(ladder, ladder[1:]):
                candidates = [layer for layer in self.swap_order if precision_of.get(layer) == milder]
                if candidates:
                    gain = extent.get(target, 0) - extent.get(milder, 0)
                    what = f"max_quantized_fraction reached, {len(candidates)} layer(s) at {milder} can go to {target}"
                    break
        if not candidates:
            return MorphDecision.nothing(
                f"pressure ({'; '.join(triggers)}) but nothing left to quantize: "
                f"{len(precision_of)}/{self.max_quantized_layers} layers at the last ladder step; "
                f"preemption is the fallback {describe(t)}"
            )
        # with the KV rung each freed slot becomes kv_blocks_per_freed_slot 8-bit blocks under pressure
        worth = math.floor(gain * t.kv_blocks_per_freed_slot)
        needed = math.ceil(deficit / worth) if worth > 0 else 1
        k = min(needed, c.max_layers_per_step, len(candidates))
        costed = ""
        if self.costs is not None and not always_pays:
            verdict = (cost_rule.memory_step_pays(t, self.costs, target, milder, k, worth) if memory
                       else cost_rule.compute_step_pays(t, self.costs, target, milder, k))
            if not verdict.pays:
                return MorphDecision.nothing(
                    f"pressure ({'; '.join(triggers)}) but the step does not pay on {self.costs.device}: "
                    f"{verdict.reason} {describe(t)}")
            costed = f", pays: {verdict.reason}"
        return MorphDecision(
            "quantize", tuple(candidates[:k]), target,
            f"pressure ({'; '.join(triggers)}) for {c.persist_iters} iteration(s): deficit {deficit} blocks, "
            f"{gain} blocks/layer{f' ({worth} as 8-bit KV)' if worth != gain else ''} -> {needed} layer(s) needed, "
            f"at most {c.max_layers_per_step}/step, {what} "
            f"-> quantize {k} to {target}{costed} {describe(t)}",
        )

    def _slow_top(self, t: Telemetry) -> bool:
        """Cost-aware: the newest transition's precision makes this machine's steps slower."""
        if self.costs is None or not t.quantized_layers:
            return False
        precision = t.quantized_layers[-1][1]
        return cost_rule.layer_is_slower(t, self.costs, precision, self._milder_precision(precision, t))

    def _maybe_restore(self, t: Telemetry) -> MorphDecision:
        c = self.config
        slow = self._slow_top(t)
        not_calm = []
        if t.num_waiting:
            not_calm.append(f"{t.num_waiting} waiting")
        if t.kv_usage >= c.kv_low and not slow:
            not_calm.append(f"kv usage {t.kv_usage:.1%} >= kv_low {c.kv_low:.0%}")
        if t.ttft_p95_s is not None and t.ttft_p95_s > c.ttft_slo_s and not slow:
            not_calm.append(f"ttft_p95 {t.ttft_p95_s:.3f} s > SLO {c.ttft_slo_s} s")
        if not_calm:
            self._calm_since = None
            return MorphDecision.nothing(f"no pressure, not calm enough to restore ({'; '.join(not_calm)}) "
                                         f"{describe(t)}")
        if self._calm_since is None:
            self._calm_since = t.now_s
        if not t.quantized_layers:
            return MorphDecision.nothing(f"calm, nothing quantized {describe(t)}")
        if t.top_is_yielded:
            return MorphDecision.nothing(f"calm, but the newest transition gave its bytes back: reclaim decides "
                                         f"when they return {describe(t)}")
        calm_for = t.now_s - self._calm_since
        persist, persist_name = (c.slow_restore_persist_s, "slow_restore_persist_s (the layer is slower here)") \
            if slow else (c.restore_persist_s, "restore_persist_s")
        if calm_for < persist:
            return MorphDecision.nothing(f"calm for {calm_for:.2f} s < {persist_name} {persist} s {describe(t)}")
        layer, precision = t.quantized_layers[-1]
        if not t.pending_restore_extent_free:
            return MorphDecision.nothing(
                f"calm for {calm_for:.2f} s but layer {layer}'s KV extent is still in use; restore waits {describe(t)}"
            )
        target = self._milder_precision(precision, t)
        extent = t.blocks_per_layer_extent.get(precision, 0) - (t.blocks_per_layer_extent.get(target, 0) if target
                                                                else 0)
        remaining = t.kv_blocks_total - extent
        projected = t.kv_blocks_used / remaining if remaining > 0 else math.inf
        if projected > c.kv_high:
            return MorphDecision.nothing(
                f"calm, but restoring layer {layer} would leave {remaining} blocks at {projected:.1%} usage "
                f"> kv_high {c.kv_high:.0%} {describe(t)}"
            )
        self._calm_since = t.now_s
        return MorphDecision(
            "restore", (layer,), target,
            f"calm for {calm_for:.2f} s >= {persist} s, layer {layer} ({precision}) extent free "
            f"-> restore it to {target or 'full precision'} (LIFO), pool shrinks by {extent} blocks to "
            f"{projected:.1%} usage {describe(t)}",
        )

    def cover_deficit(self, t: Telemetry, deficit: int) -> MorphDecision:
        """Quantize before preempt: the running requests need ``deficit`` more KV blocks than are free this
        iteration. Take the next quantize step at once (no persistence wait: the alternative is throwing
        away a running request's KV cache), sized to the deficit; nothing when the mode has no room left,
        and then the scheduler preempts as before."""
        if self.config.strategy != "dynamic" or deficit <= 0:
            return MorphDecision.nothing(f"no deficit to cover in mode {self.config.mode} {describe(t)}")
        return self._quantize_step(t, [f"running requests short of {deficit} KV blocks (quantize before preempt)"],
                                   deficit, memory=True, always_pays=True,
                                   floor=self.floor.holds(t.quality, bool(t.quantized_layers) or t.quality is not None,
                                                          t.running_tiers))

    def _floor_restore(self, t: Telemetry, floor: FloorVerdict) -> MorphDecision:
        """The quality floor restores the newest transition first (LIFO), once its KV extent is free."""
        layer, precision = t.quantized_layers[-1]
        if t.top_is_yielded:
            return MorphDecision.nothing(f"{floor.reason}; but the newest transition gave its bytes back: reclaim "
                                         f"decides when they return {describe(t)}")
        if not t.pending_restore_extent_free:
            return MorphDecision.nothing(f"{floor.reason}; layer {layer}'s KV extent is still in use, the restore "
                                         f"waits for it {describe(t)}")
        self._calm_since = t.now_s
        self.floor.restored(t.now_s)
        target = self._milder_precision(precision, t)
        return MorphDecision("restore", (layer,), target, f"{floor.reason} -> restore layer {layer} ({precision}) to "
                                                          f"{target or 'full precision'} (LIFO) {describe(t)}")

    def _milder_precision(self, precision: str, t: Telemetry) -> str | None:
        """The ladder step a restore returns to: one step back on the ladder, or full precision (None)."""
        ladder = self.ladder(t)
        if precision in ladder and ladder.index(precision) > 0:
            return ladder[ladder.index(precision) - 1]
        return None
