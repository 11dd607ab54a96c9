"""Engine configuration, validated once at construction."""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from serve.model.embedded import (
    EMBEDDED_MODEL,  # also read from here by serve.triton (which may not import serve.model)
)

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str | int) -> int:
    """'600MiB' / '1.5GiB' / '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {text!r} (examples: 600MiB, 1.5GiB, 1000000)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def without_none(hint: Any) -> Any:
    """A field's type without ``None``: ``int | None`` -> int; a union of several types -> str (read as text)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


SCHEDULERS = ("fcfs", "slai")
SLAI_ADMISSIONS = ("deadline", "shortest")
SLAI_THETA_BY_DEVICE: dict[str, tuple[float, float]] = {"cpu": (3.0, 6.0), "cuda": (5.0, 10.0)}
"""slai's (theta_low, theta_high) by device type, where the config leaves them unset. The margin ``theta x mean
batch`` must cover the spread of one batch's duration and stay well below the TBT targets (docs/slai.md
"Calibration"), so it depends on how batch times spread on the device. CPU 3 / 6: on the shared 2-core machines batches
averaged 1.2-2.1 s with P95 2.4-4x the mean, theta 1.5 left tier P99 TBT at or over target and 3 met both tiers'
(2026-11-30). CUDA 5 / 10: the paper's (arXiv 2508.01002), calibrated on GPU batches of tens of ms against 0.1 / 0.5 s
targets; not yet measured on this engine's GPU path (`make gpu-check` replays fcfs only)."""
PREFIX_CACHE_ACROSS_MORPH = ("exact", "preserve")
DEVICE_MEMORY_AUTO = "auto"
"""device_memory="auto": a budget sized by rule (serve/engine/memory_budget.py): on CPU the weights + a KV pool for
one request of the full context length; on CUDA ``AUTO_CUDA_FRACTION`` of the device."""
AUTO_CUDA_FRACTION = 0.9
KV_CACHE_MEMORY_DEFAULT = "1GiB"
"""The KV pool without a budget, when neither ``num_kv_blocks`` nor ``kv_cache_memory`` sizes it."""


def check_device_memory(text: str | None) -> None:
    """None, "auto", a fraction of the device in (0, 1] ('0.9', CUDA only) or a size ('600MiB')."""
    if text is None or str(text).strip() == DEVICE_MEMORY_AUTO:
        return
    try:
        fraction = float(str(text).strip())
    except ValueError:
        parse_size(text)
        return
    if not 0 < fraction <= 1:  # as serve/engine/memory_budget.py budget_bytes reads it
        raise ValueError(f"device_memory must be auto, a fraction in (0, 1] or a size such as 600MiB, got {text!r}")


@dataclass
class EngineConfig:
    model: str = EMBEDDED_MODEL        # embedded name, .gguf file, or Hugging Face directory
    # serve one morph level of the engine directory `model` (a name from its manifest, e.g. int4@25, or its directory
    # under hf/levels/): that level's unified checkpoint, static (morph_mode off); None: the model itself
    level: str | None = None
    device: str = "cpu"                # cpu | cuda[:N] | auto (CUDA when available)
    dtype: str | None = None           # default: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16
    num_kv_blocks: int | None = None   # overrides kv_cache_memory
    kv_cache_memory: str | None = None  # None: KV_CACHE_MEMORY_DEFAULT; set, it keeps device_memory="auto" off the pool
    # KV-cache storage (vLLM's --kv-cache-dtype): auto (the engine's dtype), int8 (int8 codes + per token-head
    # scales: ~3.75x the KV tokens of fp32 in the same bytes) or fp8 (e4m3 codes + scales, CUDA only);
    # serve/model/kv_format.py
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True  # reuse the KV of full blocks of a prompt prefix seen before (vLLM's APC)
    # Which cached prefixes serve after a layer changes precision: "exact" (only under the layer configuration
    # that computed them; they stay cached and serve again when it returns) or "preserve" (under any
    # configuration, as running requests keep their KV). docs/morphing.md gives the measurements.
    prefix_cache_across_morph: str = "exact"
    max_model_len: int | None = None   # default: the model's context length
    max_num_waiting: int | None = None  # admitted, not yet running; past it add_request raises EngineOverloaded
                                        # (None: unbounded, for offline replays; the Triton model sets 256)
    # The request lifecycle (serve/engine/lifecycle.py, docs/hardening.md). queue_timeout_s: a request with no first
    # token this many seconds after arrival is shed, ErrorKind.OVERLOADED (HTTP 503 + Retry-After); 0: no queue
    # deadline (offline replays; the Triton model's config.pbtxt and the Dynamo worker set 30). shed_on_arrival: with
    # a queue deadline, refuse at once a request the measured start rate says cannot start within it.
    # request_timeout_s: the deadline of a request that names no timeout_s (None: none).
    queue_timeout_s: float = 0.0
    shed_on_arrival: bool = True
    request_timeout_s: float | None = None
    num_threads: int | None = None     # torch intra-op threads; default: torch's choice
    guided_compile_timeout_s: float = 10.0  # structured output: CPU seconds a guide may compile; then stopped, refused
    guided_backend: str = "xgrammar"   # structured output's grammar engine: xgrammar | llguidance
    seed: int = 0
    # MorphServe: runtime quantized layer swapping + KV resizing (policy/ modes: off, static-int8,
    # static-int4, accuracy, default, performance)
    morph_mode: str = "off"
    device_memory: str | None = None   # budget: a size ('600MiB'), on CUDA a fraction ('0.9'), or 'auto' (the
                                       # Triton model's default; see DEVICE_MEMORY_AUTO); None: the KV pool is
                                       # num_kv_blocks / kv_cache_memory and the budget is what that needs
    memory_reserve: str = "16MiB"      # kept free inside the budget (activations, allocator slack)
    # Yield (docs/memory-yield.md): below this much free memory outside the engine (CUDA: NVML, every
    # process; CPU: the host's MemAvailable or the cgroup's room) a dynamic mode quantizes layers and gives
    # the bytes back; it takes them back above memory_reclaim_mark (default: the floor) after
    # memory_reclaim_calm_s. None (default): never on pressure, since it changes precision unasked. "0": no
    # floor, but the operator's yield control is armed (on CUDA this is what builds the arena from VMM segments).
    memory_floor: str | None = None
    memory_reclaim_mark: str | None = None
    memory_pressure_source: str = "auto"  # auto (NVML on CUDA, host on CPU) | nvml | host | none
    slo_ttft_s: float = 2.0
    morph_precisions: str = ""  # extra precisions to hold beyond the mode's ladder (e.g. "int8,int4" for evaluation)
    int4_group_size: int | None = None   # on-the-fly int4 group (default: 128 if it divides, else 64)
    policy_overrides: dict[str, Any] = field(default_factory=dict)  # PolicyConfig fields, e.g. kv_high
    # Scheduling: fcfs (vLLM-style) or slai (SLO-aware, per-request TBT deadlines; README "SLO-aware
    # scheduling"). Per-request targets default to slo_ttft_s (above), slo_tbt_s and default_priority.
    scheduler: str = "fcfs"
    slo_tbt_s: float = 1.0             # time-between-tokens target of a request that names none
    default_priority: int = 1          # tier of a request that names none (0 = strict, served first)
    slai_theta: float | None = None    # fixed theta; None = dynamic (slai_theta_low / slai_theta_high)
    slai_theta_low: float | None = None   # None: the device's (SLAI_THETA_BY_DEVICE: CPU 3, CUDA 5)
    slai_theta_high: float | None = None  # above slai_theta_kv_threshold KV usage; None: CPU 6, CUDA 10
    slai_theta_kv_threshold: float = 0.96
    slai_max_decodes: int | None = None  # decodes per batch; None = max_num_seqs
    # admission order (policy/slai_admission.py): "deadline" (near-deadline prompts by deadline, the rest shortest
    # first, prompts past their TTFT target last) or "shortest" (shortest remaining prompt first)
    slai_admission: str = "deadline"
    # self-speculative decoding (docs/speculation.md): off | auto (the controller drafts when the measured step
    # costs and the acceptance rate say it pays) | always (drafts whenever KV and the batch allow)
    speculation: str = "auto"
    # the quality meter (docs/quality.md): at most this fraction of measured step time spent comparing sampled
    # positions with full precision while something is quantized (0: off)
    quality_meter: float = 0.02

    def slai_thetas(self, device_type: str) -> tuple[float, float]:
        """(theta_low, theta_high) of the slai scheduler on a ``device_type`` device: the fields where set, else
        that device's calibration (SLAI_THETA_BY_DEVICE)."""
        low, high = SLAI_THETA_BY_DEVICE["cuda" if device_type == "cuda" else "cpu"]
        return (low if self.slai_theta_low is None else self.slai_theta_low,
                high if self.slai_theta_high is None else self.slai_theta_high)

    def __post_init__(self) -> None:
        """Every field checked once, by what it governs: a bad value is a ValueError naming the field."""
        self._check_requests()
        self._check_shape()
        self._check_memory()
        self._check_morphing()
        self._check_scheduling()

    def _check_requests(self) -> None:
        """Admission, the request lifecycle, prefix caching, structured output."""
        if self.max_num_waiting is not None and self.max_num_waiting <= 0:
            raise ValueError(f"max_num_waiting must be positive, got {self.max_num_waiting}")
        if not 0 <= self.queue_timeout_s < float("inf"):
            raise ValueError("queue_timeout_s must be >= 0 seconds (0: no queue deadline), got "
                             f"{self.queue_timeout_s!r}")
        if self.request_timeout_s is not None and not 0 < self.request_timeout_s < float("inf"):
            raise ValueError(f"request_timeout_s must be > 0 seconds (or unset), got {self.request_timeout_s!r}")
        if not isinstance(self.shed_on_arrival, bool):
            raise ValueError(f"shed_on_arrival must be true or false, got {self.shed_on_arrival!r}")
        if self.prefix_cache_across_morph not in PREFIX_CACHE_ACROSS_MORPH:
            raise ValueError(f"prefix_cache_across_morph must be one of {PREFIX_CACHE_ACROSS_MORPH}, "
                             f"got {self.prefix_cache_across_morph!r}")
        if self.guided_backend not in ("xgrammar", "llguidance"):
            raise ValueError(f"guided_backend must be xgrammar or llguidance, got {self.guided_backend!r}")
        if not self.guided_compile_timeout_s > 0:
            raise ValueError(f"guided_compile_timeout_s must be positive, got {self.guided_compile_timeout_s}")

    def _check_shape(self) -> None:
        """Blocks, batches, context, device and dtype."""
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.device not in ("cpu", "cuda", "auto") and not (
                self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    def _check_memory(self) -> None:
        """The memory knobs (resolved into one budget by serve/engine/memory_budget.py) and the KV format."""
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        from policy.precisions import KV_CACHE_DTYPES  # noqa: PLC0415

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        check_device_memory(self.device_memory)
        parse_size(self.memory_reserve)
        for name in ("memory_floor", "memory_reclaim_mark"):
            if getattr(self, name) is not None:
                parse_size(getattr(self, name))
        if self.memory_reclaim_mark is not None and self.memory_floor is None:
            raise ValueError("memory_reclaim_mark needs memory_floor")
        if self.memory_pressure_source not in ("auto", "nvml", "host", "none"):
            raise ValueError("memory_pressure_source must be auto, nvml, host or none, got "
                             f"{self.memory_pressure_source!r}")

    def _check_morphing(self) -> None:
        """The mode, its policy overrides, what a memory floor needs."""
        from policy import MODES, PolicyConfig  # the policy package is pure and cheap to import

        if self.morph_mode not in MODES:
            raise ValueError(f"unknown morph_mode {self.morph_mode!r}; valid: {sorted(MODES)}")
        if not isinstance(self.policy_overrides, dict):
            raise ValueError("policy overrides must be a mapping of PolicyConfig fields, got "
                             f"{self.policy_overrides!r}")
        try:
            policy = PolicyConfig.for_mode(self.morph_mode, **self.policy_overrides)  # validates the overrides
        except ValueError as exc:
            raise ValueError(f"policy overrides {self.policy_overrides} for morph_mode {self.morph_mode!r}: "
                             f"{exc}") from None
        if self.memory_floor is not None and policy.strategy != "dynamic":
            raise ValueError(f"memory_floor needs a dynamic morph mode (default, performance, accuracy); "
                             f"{self.morph_mode!r} never changes layers at run time")
        if self.memory_floor is not None:
            PolicyConfig.for_mode(self.morph_mode, **{**self.policy_overrides, **self.memory_policy()})

    def _check_scheduling(self) -> None:
        """SLO targets, the scheduler and its thetas, speculative decoding."""
        if self.slo_ttft_s <= 0:
            raise ValueError(f"slo_ttft_s must be positive, got {self.slo_ttft_s}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; valid: {list(SCHEDULERS)}")
        if not self.slo_tbt_s > 0:
            raise ValueError(f"slo_tbt_s must be positive, got {self.slo_tbt_s}")
        if isinstance(self.default_priority, bool) or not isinstance(self.default_priority, int) \
                or not 0 <= self.default_priority <= 9:
            raise ValueError(f"default_priority must be an integer tier in [0, 9], got {self.default_priority!r}")
        for name in ("slai_theta", "slai_theta_low", "slai_theta_high"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not 0 < self.slai_theta_kv_threshold <= 1:
            raise ValueError(f"slai_theta_kv_threshold must be in (0, 1], got {self.slai_theta_kv_threshold!r}")
        if self.slai_max_decodes is not None and self.slai_max_decodes < 1:
            raise ValueError(f"slai_max_decodes must be >= 1, got {self.slai_max_decodes!r}")
        if self.slai_admission not in SLAI_ADMISSIONS:
            raise ValueError(f"unknown slai_admission {self.slai_admission!r}; valid: {list(SLAI_ADMISSIONS)}")
        if not 0 <= self.quality_meter < float("inf"):
            raise ValueError(f"quality_meter must be a finite fraction of step time >= 0, got {self.quality_meter!r}")
        from policy.speculation import SPECULATION_MODES  # noqa: PLC0415

        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {list(SPECULATION_MODES)}, got {self.speculation!r}")

    def context_length(self, max_position_embeddings: int) -> int:
        """The context an engine serves (prompt + output tokens): ``max_model_len`` capped at the model's
        ``max_position_embeddings``, the model's own when unset. The one rule the engine's assembly, the memory
        budget and the planner apply."""
        return min(self.max_model_len or max_position_embeddings, max_position_embeddings)

    def policy_config(self):
        """The controller's PolicyConfig: the mode's preset, the TTFT SLO, --policy overrides, the memory floor."""
        from policy import PolicyConfig  # noqa: PLC0415

        return PolicyConfig.for_mode(self.morph_mode, **{"ttft_slo_s": self.slo_ttft_s, **self.policy_overrides,
                                                         **self.memory_policy()})

    def memory_policy(self) -> dict[str, int]:
        """``memory_floor`` / ``memory_reclaim_mark`` as PolicyConfig overrides (empty when unset; a floor of
        0 arms the operator's control without a floor)."""
        floor = parse_size(self.memory_floor) if self.memory_floor is not None else 0
        out = {"memory_floor_bytes": floor} if floor else {}
        if self.memory_reclaim_mark:
            out["memory_reclaim_bytes"] = parse_size(self.memory_reclaim_mark)
        return out


def parse_policy_overrides(pairs: list[str]) -> dict[str, Any]:
    """``--policy KEY=VALUE`` flags -> PolicyConfig overrides (values parsed as JSON where they are JSON)."""
    import json  # noqa: PLC0415

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--policy expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
