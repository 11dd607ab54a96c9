"""The KV-precision rung's decision rule: pure (stdlib only, time passed in), a reason on every decision.

Under KV pressure the cheapest lever goes first. Turning free full-precision KV slots into 8-bit blocks
(serve/engine/kv_rung.py executes it) grows the pool by ``blocks_per_slot - 1`` blocks per slot (2.75 on
SmolLM2-135M fp32: an int8 block is 1/3.75 of an fp32 one) at a quality price proportional to the share of KV held
in 8 bits; a layer swap grows it by one layer extent at the price of that layer's quantization. Both prices are
stated (``KV_PRICE_PCT``, ``LAYER_PRICE_PCT``: perplexity increase, measured, docs/morphing.md "KV-cache
precision"), and their measured time cost is: a conversion is bookkeeping (no copy: the slots are free), int8 decode
attention reads a quarter of the bytes (bench.kv_decode gives its speed), a swap copies a layer and runs it slower
(policy/cost_rule.py). The rule converts while the rung's price per block gained is below a layer swap's; at the
stated prices it is one to three orders of magnitude below (~1000x on SmolLM2 at a 1200 MiB budget), so the rung goes
first and layer swaps take over once no free
full-precision slot is left to convert (or the conversion cannot cover the pressure).

Then running sequences' cold blocks (every token computed, held by that sequence alone, oldest first; the engine lists
them as ``cold_blocks``): each one converted is re-written as an 8-bit block inside the bytes it and the other
converted slots free, so it gains ``blocks_per_slot - 1`` blocks as a free slot does, but it rounds KV a running
request already attends to. So the rule converts only as many as the pressure needs (:meth:`KVRungRule.blocks_needed`:
the waiting prompts' blocks beyond what is free after the free slots, and at ``kv_high`` the blocks that bring usage
back to the middle of the band), never more, and only while the price per block is below a layer swap's.

Convert: KV usage at or above ``kv_high``, or the waiting prompts needing more blocks than are free: every free
full-precision slot. Not just "enough": allocation takes the lowest ids, full-precision blocks first, so the free
slots left unconverted are the next ones handed out, and at the next sign of pressure there are none left to
convert (measured: converting only what brought usage to the middle of the band left the morph runtime to swap a
layer a few steps later in tests/memory/test_kv_rung.py's burst). The price of converting all is the share of KV
written in 8 bits, which the rule weighs. Revert (the newest conversion, LIFO, only when its 8-bit extent is the pool's
newest and entirely free): usage after the revert at or below ``kv_low`` for ``calm_s`` seconds. 8-bit blocks in
use are never converted back: they live until freed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

KV_PRICE_PCT = {"int8": 0.05, "fp8": 0.3}
"""Perplexity increase (%) with every KV block 8-bit. int8: measured +0.033 % on SmolLM2-135M (4,096 held-out Botchan
tokens, ``python -m bench.kv_precision``, 2026-12-04; docs/morphing.md "KV-cache precision"), rounded up; fp8 (e4m3,
3 mantissa bits against int8's 7): a stated bound, not measured (no GPU ran it)."""
LAYER_PRICE_PCT = {"int8": 0.05, "int4": 0.57, "fp8": 0.1}
"""Perplexity increase (%) per quantized layer: int4 +8.6 % with 15 of SmolLM2-135M's 30 layers (docs/morphing.md),
int8 below 1 % at half the layers; fp8 a stated bound."""


@dataclass(frozen=True)
class KVRungTelemetry:
    now_s: float
    kv_blocks_total: int
    kv_blocks_used: int
    free_full_slots: int          # free full-precision blocks the rung may convert (base pool and layer extents)
    blocks_per_slot: float        # 8-bit blocks per converted slot (full block bytes / 8-bit block bytes)
    kv_blocks_8bit: int           # 8-bit blocks the rung holds now
    top_free: bool                # the newest conversion's extent is the pool's newest and entirely free
    top_blocks: int = 0           # its 8-bit blocks
    top_slots: int = 0            # the full-precision slots it took
    blocks_needed_waiting: int = 0  # KV blocks the waiting requests' prompts need
    layer_extent_blocks: int = 0   # blocks a layer swap would add now (0: no layer swap available)
    layer_precision: str = "int4"  # the precision that swap would quantize to
    cold_blocks: int = 0          # running sequences' blocks the rung may re-write as 8-bit (filled under pressure)

    @property
    def usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class KVRungDecision:
    action: Literal["none", "convert", "revert"]
    slots: int
    reason: str
    blocks: int = 0  # convert: running sequences' cold blocks to re-write as 8-bit blocks, oldest first


class KVRungRule:
    def __init__(self, kv_cache_dtype: str, kv_high: float, kv_low: float, calm_s: float) -> None:
        if kv_cache_dtype not in KV_PRICE_PCT:
            raise ValueError(f"the KV rung writes int8 or fp8 blocks, got {kv_cache_dtype!r}")
        if not 0 < kv_low < kv_high <= 1:
            raise ValueError(f"need 0 < kv_low < kv_high <= 1, got {kv_low}, {kv_high}")
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_high, self.kv_low, self.calm_s = kv_high, kv_low, calm_s
        self._calm_since: float | None = None

    def price_per_block(self, t: KVRungTelemetry, slots: int) -> tuple[float, float | None]:
        """(the rung's, a layer swap's) perplexity price per block gained: the rung's is its stated all-8-bit price
        times the share of the pool its new 8-bit blocks would be, per block gained; None when no swap is left."""
        gained = slots * (t.blocks_per_slot - 1)
        new8 = slots * t.blocks_per_slot
        share = new8 / (t.kv_blocks_total + gained) if gained > 0 else 1.0
        rung = KV_PRICE_PCT[self.kv_cache_dtype] * share / gained if gained > 0 else math.inf
        layer = None
        if t.layer_extent_blocks > 0:
            layer = LAYER_PRICE_PCT.get(t.layer_precision, LAYER_PRICE_PCT["int4"]) / t.layer_extent_blocks
        return rung, layer

    def under_pressure(self, t: KVRungTelemetry) -> bool:
        """KV usage at ``kv_high`` or more, or the waiting prompts needing more blocks than are free."""
        return t.usage >= self.kv_high or t.blocks_needed_waiting > t.kv_blocks_total - t.kv_blocks_used

    def blocks_needed(self, t: KVRungTelemetry, slots: int, short: int | None = None) -> int:
        """Running sequences' cold blocks to convert after ``slots`` free slots: enough for ``short`` more free
        blocks (a shortfall), else for the waiting prompts and, at ``kv_high``, for usage back at the middle of the
        band; at most ``cold_blocks``."""
        per = t.blocks_per_slot - 1
        if per <= 0 or t.cold_blocks <= 0:
            return 0
        gained = slots * per
        if short is not None:
            deficit = short - gained
        else:
            free = t.kv_blocks_total - t.kv_blocks_used + gained
            deficit = t.blocks_needed_waiting - free
            if t.usage >= self.kv_high:
                mid = (self.kv_low + self.kv_high) / 2
                deficit = max(deficit, t.kv_blocks_used / mid - (t.kv_blocks_total + gained))
        return min(t.cold_blocks, math.ceil(deficit / per)) if deficit > 0 else 0

    def for_shortfall(self, t: KVRungTelemetry, short: int) -> KVRungDecision:
        """The scheduler is ``short`` blocks short and would preempt: the free slots that cover it, then running
        sequences' cold blocks for the rest."""
        per = t.blocks_per_slot - 1
        slots = min(t.free_full_slots, math.ceil(short / per)) if per > 0 and short > 0 else 0
        return self._convert(t, slots, self.blocks_needed(t, slots, short), f"shortfall of {short} block(s)", "")

    def _convert(self, t: KVRungTelemetry, slots: int, blocks: int, why: str, state: str) -> KVRungDecision:
        if t.blocks_per_slot <= 1:
            return KVRungDecision("none", 0, f"{why}: an 8-bit block is no smaller than a full one {state}")
        if slots <= 0 and blocks <= 0:
            more = "no free full-precision slot" + (" and no cold running block needed" if t.cold_blocks else
                                                    " and no cold running block")
            return KVRungDecision("none", 0, f"{why}: {more} to convert {state}")
        rung, layer = self.price_per_block(t, slots + blocks)
        if layer is not None and rung > layer:
            if slots <= 0:
                return KVRungDecision("none", 0, f"{why}: a layer swap to {t.layer_precision} costs less quality "
                                                 f"per block ({layer:.2e} % vs {rung:.2e} %) {state}")
            blocks = 0  # the free slots alone, when they are still the cheaper lever
            rung, layer = self.price_per_block(t, slots)
            if rung > layer:
                return KVRungDecision("none", 0, f"{why}: a layer swap to {t.layer_precision} costs less quality "
                                                 f"per block ({layer:.2e} % vs {rung:.2e} %) {state}")
        gained = int((slots + blocks) * (t.blocks_per_slot - 1))
        running = f" and {blocks} cold block(s) of running sequences" if blocks else ""
        return KVRungDecision("convert", slots, (
            f"{why}: write {slots} free slot(s){running} as 8-bit blocks "
            f"(~{gained} more blocks, {rung:.2e} % perplexity per block vs a layer swap's "
            f"{'none left' if layer is None else f'{layer:.2e} %'}) {state}"), blocks)

    def decide(self, t: KVRungTelemetry) -> KVRungDecision:
        usage = t.usage
        free = t.kv_blocks_total - t.kv_blocks_used
        state = (f"(KV {t.kv_blocks_used}/{t.kv_blocks_total} = {usage:.2f}, waiting need {t.blocks_needed_waiting}, "
                 f"{t.free_full_slots} free full-precision slots, {t.kv_blocks_8bit} 8-bit blocks)")
        if self.under_pressure(t):
            self._calm_since = None
            why = f"KV usage {usage:.2f} >= kv_high {self.kv_high}" if usage >= self.kv_high else \
                f"waiting prompts need {t.blocks_needed_waiting} blocks, {free} free"
            return self._convert(t, t.free_full_slots, self.blocks_needed(t, t.free_full_slots), why, state)
        if t.kv_blocks_8bit == 0:
            self._calm_since = None
            return KVRungDecision("none", 0, f"no pressure, nothing converted {state}")
        after = t.kv_blocks_total - t.top_blocks + t.top_slots
        after_usage = t.kv_blocks_used / after if after else 1.0
        if not t.top_free or after_usage > self.kv_low:
            self._calm_since = None
            why = "the newest 8-bit extent is in use or not the pool's newest" if not t.top_free else \
                f"usage after reverting would be {after_usage:.2f} > kv_low {self.kv_low}"
            return KVRungDecision("none", 0, f"8-bit blocks stay: {why} {state}")
        if self._calm_since is None:
            self._calm_since = t.now_s
        held = t.now_s - self._calm_since
        if held < self.calm_s:
            return KVRungDecision("none", 0, f"calm for {held:.2f} s of {self.calm_s} s before reverting {state}")
        self._calm_since = None
        return KVRungDecision("revert", t.top_slots, (
            f"calm {held:.2f} s, usage after {after_usage:.2f} <= kv_low {self.kv_low}: the newest 8-bit extent "
            f"({t.top_blocks} blocks) becomes {t.top_slots} full-precision slots again {state}"))
