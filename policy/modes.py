"""Controller thresholds and the named serving modes.

The paper names three dynamic modes (default, performance, accuracy) but does not
publish their thresholds; the numbers below are ours, anchored on the paper's
example triggers (KV usage > 85 %, queueing delay > 100 ms) and its TTFT SLO (2 s).
``off`` and the two ``static-*`` modes are the FP16 and static-quantization
baselines run through the same engine.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal

from .precisions import QUANTIZED_PRECISIONS
from .quality import tier_floors

Strategy = Literal["off", "static", "dynamic"]
KV_RUNGS = ("auto", "int8", "fp8")



@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds of the MorphServe controller.

    Pressure (any one of):
      * KV usage (used / total blocks) above ``kv_high``;
      * the oldest waiting request has queued longer than ``queue_delay_high_s``;
      * the waiting requests' prompts need more KV blocks than are free;
      * P95 TTFT above ``ttft_slo_s`` while requests are waiting;
      * SLO pressure from the slai scheduler: at least ``critical_decodes_high`` decodes at their
        deadline were left out of the last batch, or a waiting request's own TTFT target is less than
        ``ttft_slack_low_s`` away (None disables either; FCFS reports neither).
    Pressure must hold on ``persist_iters`` consecutive ``decide()`` calls before a
    quantize step; each step moves at most ``max_layers_per_step`` layers, and at
    most ``max_quantized_fraction`` of all layers are ever quantized.

    Restore needs calm (no pressure, nothing waiting, KV usage below ``kv_low``,
    TTFT within SLO) held for ``restore_persist_s`` seconds of engine time.

    ``ladder`` lists precisions from mildest to most aggressive: layers are first
    quantized to ``ladder[0]``; once ``max_quantized_fraction`` is reached, already
    quantized layers move one ladder step down (e.g. int8 -> int4) in swap order.
    """

    mode: str = "default"
    """Name of the preset this config came from (labels only)."""
    strategy: Strategy = "dynamic"
    """off: never morph; static: quantize every layer once, never restore; dynamic: MorphServe."""
    kv_high: float = 0.85
    kv_low: float = 0.60
    queue_delay_high_s: float = 0.10
    persist_iters: int = 3
    restore_persist_s: float = 5.0
    max_layers_per_step: int = 2
    max_quantized_fraction: float = 0.5
    ladder: tuple[str, ...] = ("int4",)
    ttft_slo_s: float = 2.0
    critical_decodes_high: int | None = 1
    ttft_slack_low_s: float | None = 0.5
    cost_aware: bool = False
    """Weigh each quantize step with the measured per-precision step costs (``policy/cost_rule.py``): take it
    only when the KV it frees pays for the slowdown; order the ladder by measured cost. Without measured
    costs the controller behaves as the cost-blind one."""
    slow_restore_persist_s: float = 0.5
    """Cost-aware only: calm needed before restoring a layer whose precision makes steps slower here (nothing
    waiting, no pressure, the pool after the shrink at most ``kv_high``): such a layer costs every step."""
    memory_floor_bytes: int | None = None
    """Yield (``policy/memory_yield.py``): when the memory outside the engine (NVML: the device's free bytes,
    every process counted; CPU: the host's or the cgroup's room) falls below this, quantize layers and give
    the freed bytes back instead of turning them into KV. None (the default): never yield on pressure,
    because giving memory away changes the model's precision without the operator asking."""
    memory_reclaim_bytes: int | None = None
    """Reclaim the newest yielded bytes only when the outside memory stays at or above this *after* taking
    them back (None: ``memory_floor_bytes``); a mark above the floor adds hysteresis."""
    memory_reclaim_calm_s: float = 10.0
    """Seconds the reclaim condition must hold unbroken before each reclaim (one transition, LIFO)."""
    kv_rung: str | None = None
    """The KV-precision rung (``policy/kv_rung.py``, dynamic modes on a full-precision KV cache): under KV pressure
    free full-precision KV slots (the base pool's and the extents layer swaps add) become 8-bit blocks of this format
    (int8; fp8 on CUDA) before any layer is swapped, and turn back when calm (``kv_low``, ``restore_persist_s``).
    ``auto`` (the ``default`` mode): int8 where it is verified, a CPU engine computing in fp32 over a full-precision
    cache, and no rung elsewhere (:func:`resolve_kv_rung`). None: no rung."""

    quality_floor: float | None = None
    """The quality floor (policy/quality.py ``FloorRule``, docs/quality.md): while the quality meter's lower bound on
    top-1 agreement with full precision is under it, no further quantizing step; when it stays under for
    ``quality_restore_s`` (and the measured agreement is under it too), the newest transition is restored first.
    None (the default): off."""
    quality_floor_by_tier: tuple[tuple[int, float], ...] = ()
    """Floors of their own for SLO tiers, (tier, floor) pairs (``--policy quality_floor_by_tier='{"0": 0.97}'``): the
    floor in force is the strictest of ``quality_floor`` and the floors of the tiers with a request running
    (policy/quality.py ``floor_in_force``): every running request is served by the same layers. Empty: none."""
    quality_confidence: float = 0.95
    """Two-sided confidence of the meter's Wilson interval (its lower bound is what the floor reads)."""
    quality_restore_s: float = 5.0
    """Seconds the lower bound must stay under ``quality_floor`` before each restore the floor asks for."""

    def __post_init__(self) -> None:
        errors: list[str] = []
        if self.quality_floor is not None and not 0.0 < self.quality_floor <= 1.0:
            errors.append(f"quality_floor must be in (0, 1] or null, got {self.quality_floor!r}")
        try:
            if tier_floors(self.quality_floor_by_tier) != self.quality_floor_by_tier:
                errors.append(f"quality_floor_by_tier must be (tier, floor) pairs sorted by tier, got "
                              f"{self.quality_floor_by_tier!r}")
        except ValueError as exc:
            errors.append(str(exc))
        if not 0.0 < self.quality_confidence < 1.0:
            errors.append(f"quality_confidence must be in (0, 1), got {self.quality_confidence!r}")
        if not 0 <= self.quality_restore_s < float("inf"):
            errors.append(f"quality_restore_s must be a finite number >= 0, got {self.quality_restore_s!r}")
        if self.strategy not in ("off", "static", "dynamic"):
            errors.append(f"strategy must be off, static or dynamic, got {self.strategy!r}")
        if not 0.0 < self.kv_low < self.kv_high <= 1.0:
            errors.append(f"need 0 < kv_low < kv_high <= 1, got kv_low={self.kv_low}, kv_high={self.kv_high}")
        if not self.queue_delay_high_s > 0:
            errors.append(f"queue_delay_high_s must be > 0, got {self.queue_delay_high_s}")
        if isinstance(self.persist_iters, bool) or not isinstance(self.persist_iters, int) or self.persist_iters < 1:
            errors.append(f"persist_iters must be an int >= 1, got {self.persist_iters!r}")
        if not self.restore_persist_s >= 0:
            errors.append(f"restore_persist_s must be >= 0, got {self.restore_persist_s}")
        if (
            isinstance(self.max_layers_per_step, bool)
            or not isinstance(self.max_layers_per_step, int)
            or self.max_layers_per_step < 1
        ):
            errors.append(f"max_layers_per_step must be an int >= 1, got {self.max_layers_per_step!r}")
        if not 0.0 <= self.max_quantized_fraction <= 1.0:
            errors.append(f"max_quantized_fraction must be in [0, 1], got {self.max_quantized_fraction}")
        if not isinstance(self.ladder, tuple):
            errors.append(f"ladder must be a tuple, got {type(self.ladder).__name__}")
        elif self.strategy != "off":
            if not self.ladder:
                errors.append("ladder must name at least one precision")
            unknown = [p for p in self.ladder if p not in QUANTIZED_PRECISIONS]
            if unknown:
                errors.append(f"unknown precision(s) {unknown} in ladder; known: {list(QUANTIZED_PRECISIONS)}")
            if len(set(self.ladder)) != len(self.ladder):
                errors.append(f"ladder repeats a precision: {self.ladder}")
            if self.strategy == "static" and len(self.ladder) != 1:
                errors.append(f"a static mode takes exactly one precision, got {self.ladder}")
        if not self.ttft_slo_s > 0:
            errors.append(f"ttft_slo_s must be > 0, got {self.ttft_slo_s}")
        c = self.critical_decodes_high
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            errors.append(f"critical_decodes_high must be an int >= 1 or None, got {c!r}")
        if self.ttft_slack_low_s is not None and not 0 <= self.ttft_slack_low_s < float("inf"):
            errors.append(f"ttft_slack_low_s must be a finite number >= 0 or None, got {self.ttft_slack_low_s!r}")
        if not isinstance(self.cost_aware, bool):
            errors.append(f"cost_aware must be true or false, got {self.cost_aware!r}")
        if not self.slow_restore_persist_s >= 0:
            errors.append(f"slow_restore_persist_s must be >= 0, got {self.slow_restore_persist_s}")
        for name in ("memory_floor_bytes", "memory_reclaim_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                errors.append(f"{name} must be an integer number of bytes >= 0 or None, got {v!r}")
        if self.memory_reclaim_bytes is not None and self.memory_floor_bytes is not None \
                and isinstance(self.memory_reclaim_bytes, int) and isinstance(self.memory_floor_bytes, int) \
                and self.memory_reclaim_bytes < self.memory_floor_bytes:
            errors.append(f"memory_reclaim_bytes ({self.memory_reclaim_bytes}) must be >= memory_floor_bytes "
                          f"({self.memory_floor_bytes}), or reclaiming would fall straight back under the floor")
        if not 0 <= self.memory_reclaim_calm_s < float("inf"):
            errors.append(f"memory_reclaim_calm_s must be a finite number >= 0, got {self.memory_reclaim_calm_s!r}")
        if self.kv_rung is not None and self.kv_rung not in KV_RUNGS:
            errors.append(f"kv_rung must be one of {', '.join(KV_RUNGS)} or null, got {self.kv_rung!r}")
        if errors:
            raise ValueError("invalid PolicyConfig: " + "; ".join(errors))

    @classmethod
    def for_mode(cls, name: str, **overrides: object) -> PolicyConfig:
        """The preset called ``name``, with any field replaced by ``overrides``."""
        try:
            preset = MODES[name]
        except KeyError:
            raise ValueError(f"unknown policy mode {name!r}; valid modes: {', '.join(MODES)}") from None
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown PolicyConfig field(s) {unknown}; fields: {sorted(fields)}")
        ladder = overrides.get("ladder")
        if isinstance(ladder, str):  # --policy ladder=int8,int4
            overrides = {**overrides, "ladder": tuple(p.strip() for p in ladder.split(",") if p.strip())}
        elif isinstance(ladder, list):  # --policy ladder='["int8","int4"]' parses as a JSON list
            overrides = {**overrides, "ladder": tuple(ladder)}
        if "quality_floor_by_tier" in overrides:  # a JSON object of tier -> floor, from --policy or config.pbtxt
            try:
                overrides = {**overrides, "quality_floor_by_tier": tier_floors(overrides["quality_floor_by_tier"])}
            except ValueError as exc:
                raise ValueError(f"invalid PolicyConfig: {exc}") from None
        errors = [_type_error(k, v) for k, v in overrides.items()]
        errors = [e for e in errors if e]
        if errors:
            raise ValueError("invalid PolicyConfig: " + "; ".join(errors))
        return dataclasses.replace(preset, **overrides)  # type: ignore[arg-type]


def resolve_kv_rung(policy: PolicyConfig, device_type: str, computes_fp32: bool, kv_cache_dtype: str) -> PolicyConfig:
    """``policy`` with ``kv_rung="auto"`` made concrete for an engine on ``device_type``: int8 on a CPU engine
    computing in fp32 over a full-precision KV cache (``kv_cache_dtype`` auto) in a dynamic mode, the configuration
    measured (docs/morphing.md "KV-cache precision"); None elsewhere: on CUDA the fp8 KV rung has not run on a GPU yet
    (``kv_rung=fp8`` asks for it), and a static 8-bit cache has nothing to convert. Other values pass unchanged."""
    if policy.kv_rung != "auto":
        return policy
    verified = (policy.strategy == "dynamic" and device_type == "cpu" and computes_fp32
                and kv_cache_dtype == "auto")
    return dataclasses.replace(policy, kv_rung="int8" if verified else None)


def _type_error(key: str, value: object) -> str | None:
    """Why ``value`` cannot be PolicyConfig field ``key`` (None when it can): a wrong type names the key
    instead of surfacing later as a TypeError from a comparison."""
    hint = typing.get_type_hints(PolicyConfig)[key]
    args = typing.get_args(hint)
    if type(None) in args:  # X | None
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if hint is bool:
        ok, want = isinstance(value, bool), "true or false"
    elif hint is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif hint is float:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif key == "quality_floor_by_tier":
        ok, want = isinstance(value, tuple), "an object of tier -> floor"
    elif typing.get_origin(hint) is tuple:
        ok, want = isinstance(value, tuple) and all(isinstance(v, str) for v in value), "a list of precisions"
    else:  # str, or a Literal of strings (strategy)
        ok, want = isinstance(value, str), "a string"
    if ok:
        return None
    none = " or null" if type(None) in args else ""
    return f"{key} must be {want}{none}, got {value!r}"


MODES: dict[str, PolicyConfig] = {
    "off": PolicyConfig(mode="off", strategy="off", ladder=()),
    "static-int8": PolicyConfig(
        mode="static-int8", strategy="static", ladder=("int8",), max_quantized_fraction=1.0
    ),
    "static-int4": PolicyConfig(
        mode="static-int4", strategy="static", ladder=("int4",), max_quantized_fraction=1.0
    ),
    # Conservative: act late and slowly, prefer int8, touch few layers, give them back soon.
    "accuracy": PolicyConfig(
        mode="accuracy",
        kv_high=0.90,
        kv_low=0.70,
        queue_delay_high_s=0.25,
        persist_iters=6,
        restore_persist_s=2.0,
        max_layers_per_step=1,
        max_quantized_fraction=0.25,
        ladder=("int8", "int4"),
        critical_decodes_high=2,
        ttft_slack_low_s=0.25,
    ),
    # The paper's evaluated configuration: INT4 (AWQ) layers, moderate hysteresis; each step weighed with the
    # measured costs of this machine (--policy cost_aware=false gives the paper's cost-blind controller).
    # With the KV rung first where it is verified (kv_rung auto: int8 on fp32 CPU engines): under a burst it turns
    # free KV slots, and the slots each layer swap frees, into 3.75x the 8-bit blocks, so fewer layers are swapped.
    "default": PolicyConfig(mode="default", cost_aware=True, kv_rung="auto"),
    # Aggressive: act on the first sign of pressure, many layers at once, keep them longer.
    "performance": PolicyConfig(
        mode="performance",
        kv_high=0.80,
        kv_low=0.50,
        queue_delay_high_s=0.05,
        persist_iters=1,
        restore_persist_s=10.0,
        max_layers_per_step=8,
        max_quantized_fraction=0.75,
        ladder=("int4",),
        ttft_slack_low_s=1.0,
        cost_aware=True,
    ),
}
"""Named presets; ``PolicyConfig.for_mode`` copies one and applies overrides."""
