"""Row counts at which the fp32 CPU paths hand over from our kernels to oneDNN: measured per machine, or defaults.

Three choices depend on the CPU (its SIMD width, caches, memory bandwidth and core count), not on the model alone:

- ``fp32_kernel_max_rows``: a plain-layout fp32 linear runs our AVX2 kernel (``fp32_linear``) up to this many rows
  and oneDNN's matmul above (serve/model/linear.py ``linear``);
- ``blocked_kernel_max_rows``: a weight in oneDNN's blocked layout (the decoder's projections, the LM head) runs our
  kernel for that layout (``fp32_blocked_linear``) up to this many rows, oneDNN on the same bytes above
  (``blocked_linear``);
- ``int8_head_max_rows``: an LM head held as exact int8 blocks (serve/model/lm_head.py) runs them up to this many
  sampled rows, the blocked fp32 head above (``LlamaModel.logits``).

``make build-engines`` measures them on the machine it runs on (builder/step_costs.py, the step that also measures
the step costs; serve/model/crossover_measure.py) and stores them beside the manifest and in the per-user cache,
keyed like the step costs (CPU model and ISA, threads, torch, kernel sources, the model's shapes). An engine reads
this machine's entry when it starts (``apply_measured``) and uses :data:`DEFAULTS` where nothing was measured. The
values are process-wide (one process serves one model), as the constants they replace were.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KernelCrossovers:
    fp32_kernel_max_rows: int
    blocked_kernel_max_rows: int
    int8_head_max_rows: int
    source: str = "defaults"

    def __post_init__(self) -> None:
        for name in ("fp32_kernel_max_rows", "blocked_kernel_max_rows", "int8_head_max_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: never our kernel), got {value!r}")

    def values(self) -> dict[str, int]:
        return {"fp32_kernel_max_rows": self.fp32_kernel_max_rows,
                "blocked_kernel_max_rows": self.blocked_kernel_max_rows,
                "int8_head_max_rows": self.int8_head_max_rows}

    @classmethod
    def from_values(cls, values: dict, source: str) -> KernelCrossovers:
        return cls(int(values["fp32_kernel_max_rows"]), int(values["blocked_kernel_max_rows"]),
                   int(values["int8_head_max_rows"]), source)


DEFAULTS = KernelCrossovers(fp32_kernel_max_rows=128, blocked_kernel_max_rows=8, int8_head_max_rows=8,
                            source="defaults (measured on a 2-core AMD EPYC 9004, Zen 4, AVX-512)")
"""What an engine uses where nothing was measured for its machine, and why (all on the 2-core AMD EPYC 9004, Zen 4,
AVX-512, where they were first derived; ``python -m bench.quant_kernels`` times each):

- fp32 128: a decoder's 30 layers of projections with their weights streamed from memory, GFLOPS at 32 / 64 / 128
  rows: ours 133 / 161 / 156, oneDNN 119 / 141 / 157, MKL 80 / 107 / 109; at 512 rows (cache-hot) oneDNN 18.2 ms per
  layer against MKL's 22.1 and ours 21.6 (README "fp32 kernels and paged decode attention");
- blocked 8: the projections of 30 decoder layers, weights streamed, milliseconds in all at 1 / 2 / 4 / 8 / 16 / 32
  rows: our blocked kernel 8.8 / 10.0 / 9.6 / 13.0 / 19.1 / 31.8, oneDNN on the blocked view 14.5 / 16.8 / 13.3 / 14.7
  / 18.6 / 28.1 (``python -m builder.step_costs --force``, 2026-12-05, after the several-row path of
  blocked_linear_avx2.cpp; the kernel before it was 2.6x its one-row time at 4 rows and the crossover was 2);
- int8 head 8: SmolLM2's head, 1.2 / 2.6 / 5.1 / 10.4 / 19.3 ms as int8 blocks against 3.6 / 5.3 / 6.6 / 7.6 / 12.4 ms
  for the blocked fp32 head at 1 / 4 / 8 / 16 / 32 rows (``--head``, median of 3): the int8 GEMV widens every weight
  to fp32, so its cost grows with the rows.

On other CPUs the crossovers move (a narrower SIMD unit or a larger cache favours oneDNN sooner or later), which is
why ``make build-engines`` measures them."""

_active: KernelCrossovers = DEFAULTS


def current() -> KernelCrossovers:
    """The crossovers every fp32 CPU linear and LM head of this process dispatches on."""
    return _active


def use(crossovers: KernelCrossovers) -> None:
    global _active
    _active = crossovers


@contextmanager
def using(crossovers: KernelCrossovers | None = None, **values: int) -> Iterator[KernelCrossovers]:
    """``crossovers`` (or the current ones with ``values`` replaced) for the duration of a with block."""
    before = _active
    chosen = replace(crossovers or before, **values) if values else (crossovers or before)
    use(chosen)
    try:
        yield chosen
    finally:
        use(before)
