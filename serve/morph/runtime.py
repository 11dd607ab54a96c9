"""Executes the MorphServe controller's decisions: layer swaps and KV pool resizing, with exact accounting.

At every iteration boundary: finish swaps whose copies are ready (install the layer, resize the pool), build a Telemetry
snapshot, ask the controller, start the copies it asks for. Quantizing layer p puts the variant at the tail of p's arena
region and adds the slots in front of it (where the milder variant's bytes were) to the KV pool as an extent owned by
that transition; undoing a transition first removes its extent (only when entirely free, LIFO), keeps the variant in
staging and copies the milder variant back into the region. One copy is in flight at a time. In-flight requests keep
their KV cache: weight-only quantization does not change the KV layout.

Yield (policy/memory_yield.py) runs the same copies, but a yielded transition's freed slots go back to the system
(``Arena.release``) instead of into the pool, or the newest transition's free KV extent leaves the pool and is released
as it stands; reclaim recommits the slots and undoes the transition as a restore does.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

from policy import FULL, MorphController, MorphDecision, PolicyConfig, StepCosts, Telemetry, signature
from policy.quality import QualitySource
from serve.logging_setup import get_logger
from serve.memory.arena import SlotRange
from serve.memory.block_pool import BlockPool
from serve.memory.budget import MemoryLedger, query_device_memory
from serve.memory.pressure import PressureSource
from serve.model.kv_cache import KVBlocks
from serve.morph.latency_window import LatencyWindow
from serve.morph.layer_bank import MorphBank
from serve.morph.swap_records import MorphResourceStats, MorphStats, PendingSwap, Transition
from serve.resource_seam import ResourceManagerBase, SchedulerView

log = get_logger("morphserve.morph")


class MorphRuntime(ResourceManagerBase):
    def __init__(self, config: PolicyConfig, swap_order: list[int], bank: MorphBank, pool: BlockPool,
                 ledger: MemoryLedger, kv: KVBlocks, block_size: int, window_s: float = 10.0,
                 clock: Callable[[], float] = time.perf_counter, costs: StepCosts | None = None,
                 prefix_cache: str = "exact", pressure: PressureSource | None = None, step_token_budget: int = 0,
                 kv_blocks_per_freed_slot: float = 1.0, quality: QualitySource | None = None) -> None:
        """``step_token_budget``: the scheduler's token budget per batch (the cost rule reads it);
        ``kv_blocks_per_freed_slot``: the KV blocks each freed slot becomes under pressure (more than 1 when the
        KV-precision rung writes a layer extent's free slots as 8-bit blocks: serve/engine/kv_rung.py); ``quality``:
        the quality meter's reading, in the telemetry for the quality floor (None: no meter)."""
        self.config, self.quality = config, quality
        self.prefix_cache = prefix_cache  # EngineConfig.prefix_cache_across_morph
        self.costs = costs
        self.controller = MorphController(config, swap_order, costs)
        self.last_step_tokens = 0  # tokens in the last batch (after_schedule); the cost rule reads it
        self.step_token_budget = step_token_budget
        self.kv_blocks_per_freed_slot = kv_blocks_per_freed_slot
        self.bank, self.pool, self.ledger, self.kv = bank, pool, ledger, kv
        self.block_size, self.clock = block_size, clock
        self.stack: list[Transition] = []
        self.pending: list[PendingSwap] = []
        # Transitions accepted but not started: one copy is in flight at a time (one staging range), so a
        # multi-layer decision runs over consecutive iterations.
        self.queued: collections.deque[tuple[str, int, str, str]] = collections.deque()
        self.stats = MorphStats()
        self.pressure = pressure  # outside memory, read at each boundary (rate-limited by the source)
        self.yield_request: int | None = None  # an operator's standing request (bytes); set from other threads
        self.last_free = None
        self.events: collections.deque[dict] = collections.deque(maxlen=10_000)
        self.tokens_served = 0  # tokens generated so far; events carry it so logs give tokens per configuration
        self._ttfts = LatencyWindow(window_s)
        self._gaps = LatencyWindow(window_s)
        missing = [p for p in config.ladder if p not in bank.precisions]
        if missing:
            raise ValueError(f"morph mode {config.mode!r} needs precisions {missing} that the engine lacks "
                             f"(have {sorted(bank.precisions)}); rebuild the engine with them")
        region = bank.regions[0].num_slots
        self.blocks_per_layer_extent = {p: region - bank.slots(0, p) for p in bank.precisions}
        self._configuration_changed()  # the cache's tag names the starting configuration (all full precision)

    def quantized_layers(self) -> tuple[tuple[int, str], ...]:
        """The swap stack as the controller sees it: layers by their newest transition, in-flight included."""
        latest: dict[int, tuple[int, str]] = {}
        for i, tr in enumerate(self.stack):
            latest[tr.layer] = (i, tr.to_precision)
        # restores and reclaims left the stack when they started
        accepted = [(p.kind, p.layer, p.target) for p in self.pending if p.kind in ("quantize", "yield")]
        queued = [(k, layer, target) for k, layer, target, _ in self.queued]
        for j, (kind, layer, target) in enumerate(accepted + queued):
            if kind in ("quantize", "yield"):
                latest[layer] = (len(self.stack) + j, target)
            elif target == FULL:
                latest.pop(layer, None)
            else:
                latest[layer] = (latest.get(layer, (j, target))[0], target)
        return tuple((layer, prec) for layer, (_, prec) in sorted(latest.items(), key=lambda kv: kv[1][0]))

    def telemetry(self, now: float, scheduler: SchedulerView) -> Telemetry:
        oldest = scheduler.oldest_waiting_arrival()
        top = self.stack[-1] if self.stack else None
        top_free = top is not None and (not top.owner or self._extent_removable(top.owner))
        mem = query_device_memory(self.bank.device)
        critical_unscheduled, ttft_slack = scheduler.slo_signals(now)
        self.last_free = free = self.pressure.free(now) if self.pressure is not None else None
        idle = not self.pending and not self.queued
        return Telemetry(
            now_s=now, kv_blocks_total=self.pool.num_blocks, kv_blocks_used=self.pool.num_used,
            num_layers=len(self.bank.model.layers), num_running=scheduler.num_running(),
            num_waiting=scheduler.num_waiting(), oldest_wait_s=(now - oldest) if oldest is not None else 0.0,
            blocks_needed_waiting=scheduler.blocks_needed_by_waiting(),
            critical_decodes_unscheduled=critical_unscheduled, min_ttft_slack_s=ttft_slack,
            step_tokens=self.last_step_tokens, step_token_budget=self.step_token_budget, block_tokens=self.block_size,
            ttft_p95_s=self._ttfts.percentile(now, 95), tbt_p99_s=self._gaps.percentile(now, 99),
            device_mem_used_bytes=mem.used_bytes if mem else None, running_tiers=scheduler.running_tiers(),
            device_mem_total_bytes=mem.total_bytes if mem else None, quantized_layers=self.quantized_layers(),
            pending_restore_extent_free=top_free and idle, blocks_per_layer_extent=self.blocks_per_layer_extent,
            kv_blocks_per_freed_slot=self.kv_blocks_per_freed_slot, memory_free_bytes=free.free_bytes if free else None,
            memory_source=free.source if free else "", yield_request_bytes=self.yield_request,
            yielded_bytes=self.ledger.yielded_slots * self.ledger.slot_bytes,
            top_is_yielded=top is not None and top.yielded and idle, yielded_layers=self._yielded_layers(),
            block_bytes=self.ledger.slot_bytes, quality=self.quality.reading() if self.quality is not None else None)

    # ---- the iteration boundary: the engine loop's resource-manager seam (serve/resource_seam.py) ------------
    name = "morph"
    grows_pool = True

    def use_costs(self, costs: StepCosts) -> None:
        """A corrected step-cost table (serve/morph/cost_check.py): the controller weighs it from the next decision."""
        self.costs = costs
        self.controller.use_costs(costs)

    def before_schedule(self, scheduler: SchedulerView) -> MorphDecision | None:
        """The iteration boundary: land finished copies, ask the controller, start what it decides."""
        now = self.clock()
        self.complete_ready(wait=False)
        if self.pending or self.queued:
            return None  # one decision at a time keeps the stack order simple
        decision = self.controller.decide(self.telemetry(now, scheduler))
        if decision.action != "none":
            self.start(decision)
        return decision

    def start(self, decision: MorphDecision) -> None:
        if decision.action == "yield" and decision.precision is None:
            self._yield_extent(decision.layers[0], decision.reason)
            return
        if decision.action == "reclaim" and self.stack and self.stack[-1].layer != decision.layers[0]:
            self._reclaim_as_kv(decision.layers[0], decision.reason)
            return
        for layer in decision.layers:
            if decision.action in ("quantize", "yield"):
                self.queued.append((decision.action, layer, decision.precision, decision.reason))  # type: ignore[arg-type]
            else:
                self.queued.append((decision.action, layer, decision.precision or FULL, decision.reason))
        self._start_next()

    def _start_next(self) -> None:
        while not self.pending and self.queued:
            kind, layer, target, reason = self.queued.popleft()
            started = self._start_quantize(layer, target, reason, kind) if kind in ("quantize", "yield") else \
                self._start_restore(layer, target, reason, kind)
            if not started:
                self.queued.clear()  # the rest of the decision depended on this step

    def _yielded_layers(self) -> tuple[int, ...]:
        if not self.ledger.yielded_slots:  # the usual case, at every iteration boundary
            return ()
        newest = {tr.layer: tr for tr in self.stack}
        return tuple(tr.layer for tr in self.stack if tr.yielded and newest[tr.layer] is tr)

    def _reclaim_as_kv(self, layer: int, reason: str) -> None:
        """Take back the bytes of layer's yielded transition that newer (KV) transitions cover: recommit its
        slots and give them to the pool as its KV extent; the transition moves to the top of the stack (its
        extent is now the pool's newest), so the restore rule later undoes it in LIFO order as any other."""
        tr = next((t for t in reversed(self.stack) if t.layer == layer), None)
        if tr is None or not tr.yielded:
            self._event("reclaim_skipped", layer=layer, reason="the layer's newest transition gave nothing back")
            return
        recommitted = self.bank.arena.recommit(tr.slots)
        self.ledger.yielded_slots -= tr.blocks
        self._memory_moved()
        tr.owner, tr.yielded = (f"layer{layer}:{tr.from_precision}->{tr.to_precision}" if tr.blocks else ""), False
        if tr.blocks:
            extent = self.pool.add_extent(tr.owner, tr.blocks)
            self.kv.map_blocks(extent.start, list(range(tr.slots.start, tr.slots.end)))
            self.ledger.kv_blocks += tr.blocks
        self.stack.remove(tr)
        self.stack.append(tr)
        self.stats.reclaims += 1
        self.ledger.check()
        self._event("reclaim_memory", layer=layer, as_kv=True, bytes_reclaimed=tr.blocks * self.ledger.slot_bytes,
                    bytes_recommitted=recommitted, kv_blocks_total=self.pool.num_blocks, reason=reason)

    def _yield_extent(self, layer: int, reason: str) -> None:
        """Give the newest transition's KV extent back to the system as it stands (every block of it is free:
        the controller checked, and nothing ran since)."""
        top = self.stack[-1] if self.stack else None
        if top is None or top.layer != layer or top.yielded or not top.owner or not self._extent_removable(top.owner):
            self._event("yield_skipped", layer=layer, reason="the newest transition has no free KV extent")
            return
        extent = self.pool.remove_extent(top.owner)
        self.kv.unmap_blocks(extent.start, extent.num_blocks)
        self.ledger.kv_blocks -= top.blocks
        released = self.bank.arena.release(top.slots)
        self.ledger.yielded_slots += top.blocks
        self._memory_moved()
        top.owner, top.yielded = "", True
        self.stats.yields += 1
        self.ledger.check()
        self._event("yield", layer=layer, precision=top.to_precision, source="kv_chunk",
                    bytes_yielded=top.blocks * self.ledger.slot_bytes, bytes_released=released,
                    kv_blocks_total=self.pool.num_blocks, reason=reason)

    def _start_quantize(self, layer: int, target: str, reason: str, kind: str = "quantize") -> bool:
        """Copy the variant from the host bank into staging (asynchronously); installed at a later boundary."""
        before = self.bank.precision_of(layer)
        if self.bank.slots(layer, target) > self.bank.slots(layer, before):
            self._event("swap_skipped", layer=layer, to_precision=target,
                        reason=f"{target} is not smaller than {before}")
            return False
        job = self.bank.copy_async(self.bank.host[layer][target], self.bank.staging)
        self.pending.append(PendingSwap(kind, layer, target, job, reason, self.clock()))
        return True

    def _start_restore(self, layer: int, target: str, reason: str, kind: str = "restore") -> bool:
        """Undo the newest transition: its KV extent leaves the pool, the current variant moves to staging, and
        the milder variant is copied from the host bank back into the region (asynchronously)."""
        top = self.stack[-1] if self.stack else None
        if top is None or top.layer != layer or top.from_precision != target:
            self._event("restore_skipped", layer=layer, to_precision=target, reason="not the newest transition")
            return False
        if top.owner and not self._extent_removable(top.owner):
            self._event("restore_skipped", layer=layer, to_precision=target,
                        reason="its KV extent is in use (or a newer extent, the KV rung's, lies above it)")
            return False
        if top.yielded:  # the bytes come back before anything is copied over them
            recommitted = self.bank.arena.recommit(top.slots)
            self.ledger.yielded_slots -= top.blocks
            self._memory_moved()
            self._event("reclaim_memory", layer=layer, bytes_reclaimed=top.blocks * self.ledger.slot_bytes,
                        bytes_recommitted=recommitted)
        if top.owner:
            extent = self.pool.remove_extent(top.owner)
            self.kv.unmap_blocks(extent.start, extent.num_blocks)
            self.ledger.kv_blocks -= top.blocks
            self._event("kv_shrink", layer=layer, blocks_removed=top.blocks, kv_blocks_total=self.pool.num_blocks)
        self.stack.pop()
        staged = self.bank.copy_now(self.bank.model.layers[layer], self.bank.staging)
        self.bank.install(layer, staged)  # serves from staging while the region is rewritten
        self.ledger.layer_slots[layer] = self.bank.slots(layer, target)
        job = self.bank.copy_async(self.bank.host[layer][target], self.bank.tail(layer, target))
        self.pending.append(PendingSwap("reclaim" if top.yielded else "restore", layer, target, job, reason,
                                        self.clock()))
        return True

    def complete_ready(self, wait: bool) -> None:
        """Install finished copies in order; each install starts the next queued copy. wait=True drains all."""
        while self.pending and (wait or self.pending[0].job.done()):
            p = self.pending.pop(0)
            try:
                layer_obj = p.job.result()
            except Exception as exc:  # noqa: BLE001 - a failed copy must not leave a half-moved layer
                layer_obj = self._recover_failed_copy(p, exc)
                if layer_obj is None:
                    continue
            before = self.bank.precision_of(p.layer)
            elapsed_ms = (self.clock() - p.started) * 1e3
            self.stats.swap_ms[f"{before}->{p.target}"].append(elapsed_ms)
            if p.kind in ("quantize", "yield"):
                self._finish_quantize(p, before, layer_obj, elapsed_ms)
            else:
                self.bank.install(p.layer, layer_obj)
                self._configuration_changed()
                if p.kind == "reclaim":
                    self.stats.reclaims += 1
                else:
                    self.stats.restores += 1
                self._event(p.kind, layer=p.layer, from_precision=before, to_precision=p.target,
                            time_ms=round(elapsed_ms, 3), reason=p.reason)
            self.ledger.check()
            self._start_next()

    def _recover_failed_copy(self, p: PendingSwap, exc: Exception) -> object | None:
        """A copy that failed mid-way. A quantize is dropped: nothing was installed and the pool is unchanged,
        so the layer stays at its precision (only staging holds partial bytes). A restore cannot be dropped:
        its KV extent is gone and the layer serves from staging, which the next quantize overwrites; it is
        copied again synchronously, and if that fails too the error propagates (an engine fault)."""
        self.stats.failed_copies += 1
        self._event("swap_failed", level="warning", layer=p.layer, kind=p.kind, to_precision=p.target,
                    error=f"{type(exc).__name__}: {exc}",
                    action="dropped" if p.kind == "quantize" else "copied again synchronously")
        if p.kind in ("restore", "reclaim"):
            return self.bank.copy_now(self.bank.host[p.layer][p.target], self.bank.tail(p.layer, p.target))
        self.queued.clear()  # the rest of the decision depended on this step
        self.ledger.check()
        return None

    def _finish_quantize(self, p: PendingSwap, before: str, staged, elapsed_ms: float) -> None:
        """Move the staged variant to the region's tail, install it, and give the slots in front of it (where
        the milder variant's bytes were) to the KV pool as this transition's extent."""
        old = self.bank.tail(p.layer, before)
        new = self.bank.tail(p.layer, p.target)
        self.bank.install(p.layer, self.bank.copy_now(staged, new))
        self._configuration_changed()
        freed = SlotRange(old.start, new.start - old.start)
        self.ledger.layer_slots[p.layer] = new.num_slots
        yielded = p.kind == "yield"
        owner = f"layer{p.layer}:{before}->{p.target}" if freed.num_slots and not yielded else ""
        released = 0
        if yielded:
            released = self.bank.arena.release(freed)
            self.ledger.yielded_slots += freed.num_slots
            self._memory_moved()
            self.stats.yields += 1
        elif freed.num_slots:
            extent = self.pool.add_extent(owner, freed.num_slots)
            self.kv.map_blocks(extent.start, list(range(freed.start, freed.end)))
            self.ledger.kv_blocks += freed.num_slots
        self.stack.append(Transition(p.layer, before, p.target, owner, freed.num_slots, freed, yielded))
        if yielded:
            self._event("yield", layer=p.layer, from_precision=before, to_precision=p.target, source="layer",
                        bytes_yielded=freed.num_slots * self.ledger.slot_bytes, bytes_released=released,
                        time_ms=round(elapsed_ms, 3), reason=p.reason)
            return
        self.stats.swaps += 1
        self._event("swap", layer=p.layer, from_precision=before, to_precision=p.target,
                    bytes_freed=freed.num_slots * self.ledger.slot_bytes, blocks_added=freed.num_slots,
                    kv_blocks_total=self.pool.num_blocks, time_ms=round(elapsed_ms, 3), reason=p.reason)

    def cover_shortfall(self, scheduler: SchedulerView, blocks: int) -> int:
        """Quantize before preempt (as the released MorphServe does): the scheduler is about to preempt because
        it is ``blocks`` KV blocks short of what it is scheduling (the shortfall it met, in its own order; the
        KV-cache manager calls this through the engine). Finish what is in flight and take quantize steps at once
        until that many more blocks are free. Returns the blocks it freed; 0 and the scheduler preempts as before
        when the mode has no room left."""
        if blocks <= 0:
            return 0
        free_before = self.pool.num_free
        wanted = free_before + blocks
        self.queued = collections.deque(q for q in self.queued if q[0] in ("quantize", "yield"))  # no restore now
        self.complete_ready(wait=True)
        while (left := wanted - self.pool.num_free) > 0:
            decision = self.controller.cover_deficit(self.telemetry(self.clock(), scheduler), left)
            if decision.action != "quantize":
                break
            before = self.pool.num_blocks
            self.apply_now(decision)
            if self.pool.num_blocks == before:
                break  # the step freed no whole block: preemption it is
        return max(0, self.pool.num_free - free_before)

    def apply_now(self, decision: MorphDecision) -> None:
        """Apply a decision synchronously, one layer at a time (static modes, before serving starts)."""
        for layer in decision.layers:
            self.start(MorphDecision(decision.action, (layer,), decision.precision, decision.reason))
            self.complete_ready(wait=True)

    def next_swap_blocks(self, precision: str) -> int:
        """The KV blocks the next layer quantized to ``precision`` would add: its extent, or 0 once the mode may
        quantize no more layers (what the KV-precision rung weighs its own price against)."""
        left = self.num_quantized < self.controller.max_quantized_layers
        return self.blocks_per_layer_extent[precision] if left else 0

    @property
    def num_quantized(self) -> int:
        return sum(1 for layer in self.bank.model.layers if layer.precision != FULL)

    def quantized_by_precision(self) -> dict[str, int]:
        counts: dict[str, int] = collections.Counter(layer.precision for layer in self.bank.model.layers)
        counts.pop(FULL, None)
        return dict(counts)

    def _configuration_changed(self) -> None:
        """A layer now serves at another precision: under ``exact`` the prefix cache serves only blocks this
        configuration computed (the others stay cached for when it returns); under ``preserve`` nothing changes."""
        if self.prefix_cache == "exact":
            self.pool.set_config_tag(self.config_signature().encode())

    def config_signature(self) -> str:
        """The model's current shape, one character per layer: f(ull), 8 (int8), 4 (int4), e (fp8)."""
        return signature(layer.precision for layer in self.bank.model.layers)

    # ---- the rest of the seam ---------------------------------------------------------------------------------
    def after_schedule(self, num_tokens: int) -> None:
        self.last_step_tokens = num_tokens

    def on_first_token(self, now: float, ttft_s: float) -> None:
        self._ttfts.add(now, ttft_s)
        self.tokens_served += 1

    def on_token_gap(self, now: float, gap_s: float) -> None:
        self._gaps.add(now, gap_s)
        self.tokens_served += 1

    def on_request_finished(self, request_id: str) -> None:
        return None  # a request's KV blocks are the scheduler's; layers are shared

    def extra_reachable_blocks(self, base_blocks: int, num_blocks: int) -> tuple[int, str]:
        """The KV blocks this mode can still add: a dynamic mode quantizing every layer it may to its deepest
        ladder step; a static mode has added them all already."""
        if self.config.strategy != "dynamic":
            return 0, f"layers fixed in mode {self.config.mode}"
        deepest = self.config.ladder[-1]
        layers = self.controller.max_quantized_layers
        extent = self.blocks_per_layer_extent[deepest]
        return (max(0, base_blocks + layers * extent - num_blocks),
                f"{base_blocks} base + {layers} layers at {deepest} x {extent} blocks")

    def resource_stats(self) -> MorphResourceStats:
        free = self.last_free
        return MorphResourceStats(
            layers_quantized=self.quantized_by_precision(), swaps_total=self.stats.swaps,
            restores_total=self.stats.restores, configuration=self.config_signature(),
            yielded_bytes=self.ledger.yielded_slots * self.ledger.slot_bytes,
            yield_request_bytes=self.yield_request or 0, yields_total=self.stats.yields,
            reclaims_total=self.stats.reclaims, outside_free_bytes=free.free_bytes if free else None,
            outside_source=free.source if free else "")

    def shutdown(self) -> None:
        self.bank.shutdown()

    def request_yield(self, nbytes: int | None) -> dict:
        """An operator's standing request: keep ``nbytes`` given back (None or 0: none; yielded bytes then
        return under the reclaim rule). Takes effect at the next iteration boundary."""
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
            raise ValueError(f"bytes to yield must be an integer >= 0, got {nbytes!r}")
        if self.config.strategy != "dynamic":
            raise ValueError(f"morph mode {self.config.mode!r} cannot yield memory: only dynamic modes "
                             "(default, performance, accuracy) change layers at run time")
        if nbytes and not self.bank.arena.can_release:
            raise ValueError("this arena cannot give memory back: on CUDA set memory_floor (which builds the "
                             "arena from CUDA VMM segments)")
        self.yield_request = nbytes or None
        return self.resource_stats().memory_yield()

    def is_at_rest(self) -> bool:
        """Nothing in flight, every layer at full precision and no outside memory to watch (the state an
        idle engine sleeps in; otherwise it keeps ticking so the controller can restore, yield or reclaim)."""
        watching = ((self.config.memory_floor_bytes is not None and self.pressure is not None)
                    or bool(self.yield_request))
        return not self.pending and not self.queued and not self.stack and not watching

    def _extent_removable(self, owner: str) -> bool:
        """Extents leave the pool LIFO: ``owner``'s must be the newest (the KV rung adds extents too) and free."""
        return self.pool.extents[-1].owner == owner and self.pool.extent_is_free(owner)

    def _memory_moved(self) -> None:
        if self.pressure is not None:
            self.pressure.invalidate()

    def _event(self, event: str, level: str = "info", **fields) -> None:
        record = {"event": event, **fields, "config": self.config_signature(), "tokens_served": self.tokens_served}
        self.events.append(record)
        getattr(log, level)(event, **{k: v for k, v in record.items() if k != "event"})
