"""One snapshot of the serving engine's signals, as the controller sees them.

The engine builds a ``Telemetry`` at every iteration boundary and passes it to
``MorphController.decide``. Everything the controller needs is in here, including
the time (``now_s``), so the policy never reads a clock of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .quality import QualityReading


@dataclass(frozen=True)
class Telemetry:
    """Engine signals at one iteration boundary.

    Contract with the engine (``serve``):

    * ``quantized_layers`` lists every layer that is currently quantized, as
      ``(layer, precision)``, ordered by each layer's most recent transition: it
      is the swap stack, and its last entry owns the newest KV extent. A
      re-quantization (int8 -> int4) moves the layer to the end, because it adds a
      new extent on top. Swaps the engine has accepted but is still copying must
      already be listed, so the controller never asks twice.
    * ``pending_restore_extent_free`` describes the last entry of
      ``quantized_layers``: True only if every KV block of that layer's newest
      extent is free, i.e. its most recent transition could be undone right now.
    * ``blocks_per_layer_extent[p]`` is the number of KV blocks quantizing one
      full-precision layer to precision ``p`` adds (all Llama layers are the
      same size, so one number per precision).
    * ``kv_blocks_per_freed_slot`` is how many KV blocks each of those becomes
      under pressure: 1, or with the KV-precision rung (policy/kv_rung.py) the
      8-bit blocks it writes into a free full-precision slot (3.75 on
      SmolLM2-135M fp32), so a swap is worth that many times its extent.
    """

    now_s: float
    kv_blocks_total: int
    kv_blocks_used: int
    num_layers: int
    num_running: int = 0
    num_waiting: int = 0
    oldest_wait_s: float = 0.0
    """Queueing delay of the oldest waiting request; 0 when nothing waits."""
    blocks_needed_waiting: int = 0
    """KV blocks the waiting requests' prompts would need; 0 when nothing waits."""
    ttft_p95_s: float | None = None
    """P95 time-to-first-token over the engine's sliding window; None without data."""
    tbt_p99_s: float | None = None
    """P99 time-between-tokens over the sliding window; None without data."""
    critical_decodes_unscheduled: int = 0
    """SLO pressure (slai scheduler): decodes at or past their last schedulable time that the last batch
    could not fit (budget, decode cap or KV blocks); 0 under FCFS."""
    min_ttft_slack_s: float | None = None
    """SLO pressure (slai scheduler): least time left before a waiting request misses its own TTFT target
    (negative once missed); None when nothing waits or the scheduler tracks no deadlines (FCFS)."""
    step_tokens: int = 0
    """Tokens the last batch ran (decodes + prefill chunk tokens); 0 when unknown. The cost rule reads the
    measured step cost at this size."""
    step_token_budget: int = 0
    """Most tokens one batch may run (the scheduler's token budget); 0 when unknown (no cap)."""
    block_tokens: int = 16
    """Tokens per KV block (turns the waiting prompts' blocks into prompt tokens for the cost rule)."""
    device_mem_used_bytes: int | None = None
    device_mem_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    """Memory free outside the engine's budget as its pressure source reads it (NVML: the device's total
    minus every process's use; CPU: the host's MemAvailable or the cgroup's limit minus usage); None when
    no source is read."""
    memory_source: str = ""
    """Which source ``memory_free_bytes`` came from (nvml, cgroup, meminfo, a test's name)."""
    yield_request_bytes: int | None = None
    """Bytes an operator asked to keep yielded (a standing request until cleared); None: no request."""
    yielded_bytes: int = 0
    """Bytes the engine has given back and not reclaimed."""
    top_is_yielded: bool = False
    """The newest transition (last of ``quantized_layers``) gave its bytes back instead of to the KV pool."""
    yielded_layers: tuple[int, ...] = ()
    """Layers whose newest transition gave its bytes back, oldest first (the top one included)."""
    block_bytes: int = 0
    """Bytes of one KV block (= one arena slot): turns ``blocks_per_layer_extent`` into bytes."""
    quantized_layers: tuple[tuple[int, str], ...] = ()
    pending_restore_extent_free: bool = False
    blocks_per_layer_extent: Mapping[str, int] = field(default_factory=dict)
    kv_blocks_per_freed_slot: float = 1.0
    quality: QualityReading | None = None
    """The quality meter's reading (policy/quality.py): top-1 agreement with full precision over its window of
    samples, with its bound; None without a meter or before its first sample. The quality floor reads it."""
    running_tiers: tuple[int, ...] = ()
    """The SLO tiers (0 = strict) with a request running, each once: the quality floor in force is the strictest of
    theirs (``PolicyConfig.quality_floor_by_tier``) and the server's."""

    def __post_init__(self) -> None:
        if self.kv_blocks_total < 0 or self.kv_blocks_used < 0:
            raise ValueError("KV block counts must be >= 0")
        if self.kv_blocks_used > self.kv_blocks_total:
            raise ValueError(
                f"kv_blocks_used ({self.kv_blocks_used}) > kv_blocks_total ({self.kv_blocks_total})"
            )
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if min(self.num_running, self.num_waiting, self.blocks_needed_waiting, self.step_tokens,
               self.step_token_budget) < 0 or self.block_tokens < 1:
            raise ValueError("num_running, num_waiting, blocks_needed_waiting, step_tokens and step_token_budget "
                             "must be >= 0, block_tokens >= 1")
        if self.critical_decodes_unscheduled < 0:
            raise ValueError(f"critical_decodes_unscheduled must be >= 0, got {self.critical_decodes_unscheduled}")
        if self.yielded_bytes < 0 or self.block_bytes < 0:
            raise ValueError("yielded_bytes and block_bytes must be >= 0")
        if self.kv_blocks_per_freed_slot < 1:
            raise ValueError(f"kv_blocks_per_freed_slot must be >= 1, got {self.kv_blocks_per_freed_slot}")
        if self.oldest_wait_s < 0:
            raise ValueError(f"oldest_wait_s must be >= 0, got {self.oldest_wait_s}")
        layers = [layer for layer, _ in self.quantized_layers]
        if len(set(layers)) != len(layers):
            raise ValueError(f"quantized_layers lists a layer twice: {self.quantized_layers}")
        if any(not 0 <= layer < self.num_layers for layer in layers):
            raise ValueError(
                f"quantized_layers has a layer outside [0, {self.num_layers}): {self.quantized_layers}"
            )

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0.0 for an empty pool)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def precision_of(self) -> dict[int, str]:
        """Map layer -> precision for the quantized layers."""
        return dict(self.quantized_layers)
