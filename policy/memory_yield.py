"""Yield and reclaim: memory given back to another tenant of the device (or host), and taken back later.

MorphServe's usual trade turns the bytes a quantized layer frees into KV cache. Under *outside* pressure
(another process on the GPU, another container on the host) the same bytes can instead be handed back:

* **Yield** when the outside memory (``Telemetry.memory_free_bytes``) is below ``memory_floor_bytes``, or an
  operator asked for bytes (``yield_request_bytes``) the engine has not yielded yet. The shortfall is
  covered, in this order, by (1) the newest transition's KV extent when every block of it is free (nothing
  is recomputed, no request loses anything), then (2) layers moved down the ladder as a quantize step
  moves them (fresh layers to the mildest ladder step in swap order, then one ladder step down), sized to the
  shortfall. Unlike a KV quantize step a yield may use every layer: the alternative is another tenant's
  out-of-memory error. It acts at once, without persistence: the reading is a fact, not a noisy signal.
* **Reclaim** the newest yielded transition (LIFO, one per decision) when, after taking its bytes back,
  the outside memory would still be at or above ``memory_reclaim_bytes`` (default: the floor), the
  operator's request would still be met, and both have held for ``memory_reclaim_calm_s`` seconds; the next
  transitions follow at the next decisions while that still holds (the calm period restarts only when the
  condition breaks).

Only dynamic modes yield (a static mode's layers are fixed, mode off holds no quantized variants). A
transition that yielded is never undone by the KV restore rule; reclaim owns it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .decision import MorphDecision
from .modes import PolicyConfig
from .telemetry import Telemetry


def mib(n: int | float) -> str:
    return f"{n / 2**20:.1f} MiB"


class YieldRule:
    """The yield/reclaim part of the controller. Keeps one piece of state: since when reclaim has been possible."""

    def __init__(self, config: PolicyConfig, swap_order: Sequence[int]) -> None:
        self.config = config
        self.swap_order = tuple(swap_order)
        self._reclaimable_since: float | None = None
        self.short_bytes = 0
        """The shortfall the last ``decide`` saw (0: none): the controller returns a ``none`` then too."""

    @property
    def active(self) -> bool:
        return self.config.strategy == "dynamic"

    def shortfall(self, t: Telemetry) -> tuple[int, list[str]]:
        """Bytes still to yield (0: none) and why."""
        short, why = 0, []
        floor = self.config.memory_floor_bytes
        if floor is not None and t.memory_free_bytes is not None and t.memory_free_bytes < floor:
            short = floor - t.memory_free_bytes
            why.append(f"{t.memory_source or 'outside'} free {mib(t.memory_free_bytes)} < floor {mib(floor)}")
        if t.yield_request_bytes is not None and t.yielded_bytes < t.yield_request_bytes:
            short = max(short, t.yield_request_bytes - t.yielded_bytes)
            why.append(f"operator asked to yield {mib(t.yield_request_bytes)}, {mib(t.yielded_bytes)} yielded")
        return short, why

    def decide(self, t: Telemetry, ladder: Sequence[str], describe: Callable[[Telemetry], str]) -> MorphDecision | None:
        """A yield or reclaim decision, a ``none`` that says why a needed yield cannot happen, or None when
        memory asks for nothing (the KV rules decide)."""
        self.short_bytes = 0
        if not self.active:
            return None
        short, why = self.shortfall(t)
        self.short_bytes = short
        if short > 0:
            self._reclaimable_since = None
            return self._yield(t, ladder, short, "; ".join(why), describe(t))
        return self._reclaim(t, ladder, describe)

    def _extent_bytes(self, t: Telemetry, precision: str, milder: str | None) -> int:
        extent = t.blocks_per_layer_extent
        return (extent.get(precision, 0) - (extent.get(milder, 0) if milder else 0)) * t.block_bytes

    @staticmethod
    def _milder(precision: str, ladder: Sequence[str]) -> str | None:
        i = list(ladder).index(precision) if precision in ladder else 0
        return ladder[i - 1] if i > 0 else None

    def _yield(self, t: Telemetry, ladder: Sequence[str], short: int, why: str, describe: str) -> MorphDecision:
        if t.quantized_layers and not t.top_is_yielded and t.pending_restore_extent_free:
            layer, precision = t.quantized_layers[-1]
            size = self._extent_bytes(t, precision, self._milder(precision, ladder))
            if size > 0:
                return MorphDecision("yield", (layer,), None,
                                     f"yield: {why}; short {mib(short)} -> release layer {layer}'s free KV extent "
                                     f"({precision}, {mib(size)}) {describe}")
        precision_of = t.precision_of
        fresh = [layer for layer in self.swap_order if layer not in precision_of]
        candidates, target, gain = fresh, ladder[0], self._extent_bytes(t, ladder[0], None)
        if not fresh:
            candidates = []
            for milder, target in zip(ladder, ladder[1:]):
                candidates = [layer for layer in self.swap_order if precision_of.get(layer) == milder]
                if candidates:
                    gain = self._extent_bytes(t, target, milder)
                    break
        if not candidates or gain <= 0:
            return MorphDecision.nothing(f"yield: {why}; short {mib(short)} but every layer is at the last ladder step "
                                         "and "
                                         f"no free KV extent is on top: nothing left to give back {describe}")
        k = min(len(candidates), math.ceil(short / gain))
        return MorphDecision("yield", tuple(candidates[:k]), target,
                             f"yield: {why}; short {mib(short)}, {mib(gain)} per layer -> move {k} layer(s) to "
                             f"{target} and give the bytes back {describe}")

    def _reclaim(self, t: Telemetry, ladder: Sequence[str],
                 describe_t: Callable[[Telemetry], str]) -> MorphDecision | None:
        if not (t.quantized_layers and (t.top_is_yielded or t.yielded_layers)):
            self._reclaimable_since = None
            return None
        if t.top_is_yielded:  # the newest transition: its bytes come back and the layer is restored
            layer, precision = t.quantized_layers[-1]
            target = self._milder(precision, ladder)
            how = f"{precision} -> {target or 'full precision'}, LIFO"
        else:  # buried under KV transitions (load went on): the bytes come back as that layer's KV extent, and
            # its precision returns later under the restore rule, in LIFO order
            layer = t.yielded_layers[-1]
            precision = t.precision_of[layer]
            target = precision
            how = f"as KV blocks under newer transitions; {precision} until the restore rule reaches it"
        size = self._extent_bytes(t, precision, self._milder(precision, ladder))
        c = self.config
        describe = describe_t(t)
        blocked = []
        if t.yield_request_bytes is not None and t.yielded_bytes - size < t.yield_request_bytes:
            blocked.append(f"the operator's request of {mib(t.yield_request_bytes)} holds it")
        mark = c.memory_reclaim_bytes if c.memory_reclaim_bytes is not None else c.memory_floor_bytes
        if mark is not None:
            if t.memory_free_bytes is None:
                blocked.append("no reading of outside memory")
            elif t.memory_free_bytes - size < mark:
                blocked.append(f"{t.memory_source or 'outside'} free {mib(t.memory_free_bytes)} - {mib(size)} "
                               f"< reclaim mark {mib(mark)}")
        if blocked:
            self._reclaimable_since = None
            return MorphDecision.nothing(f"reclaim of layer {layer} waits: {'; '.join(blocked)} {describe}")
        if self._reclaimable_since is None:
            self._reclaimable_since = t.now_s
        held = t.now_s - self._reclaimable_since
        calm = c.memory_reclaim_calm_s if mark is not None else 0.0  # a manual reclaim acts at once
        if held < calm:
            return MorphDecision.nothing(f"reclaim of layer {layer} possible for {held:.2f} s < "
                                         f"memory_reclaim_calm_s {calm} s {describe}")
        # the calm period is not restarted: once room has held that long, the yielded transitions come back one
        # per decision while it still holds (each decision re-checks the room after its own take-back)
        return MorphDecision("reclaim", (layer,), target,
                             f"reclaim: {mib(size)} back from layer {layer} ({how}) after {held:.2f} s with room "
                             f"{describe}")
