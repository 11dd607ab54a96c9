"""Step time of one engine iteration from its batch and the layers' current precisions.

A batch is described as the executor sees it: decodes (one token each, ``kv_len`` cached tokens) and prefill
chunks (tokens ``start..end`` of a prompt); ``m`` = all tokens of the step; ``sampled`` = rows that reach the
LM head (the engine computes the head for sampled rows only).

``TableStepModel`` (a GPU of aiconfigurator-core's tables), per iteration:
  sum over layers of [its four GEMMs at ``m`` rows in the layer's precision]
  + layers x [decode attention (generation table at the decodes' count and mean KV length)
              + each prefill chunk's context attention (context table at batch 1 and the chunk's end,
                times the chunk's share of the causal work, (end^2 - start^2) / end^2)
              + elementwise work (norms, RoPE, SwiGLU, residuals: ``ELEMENTWISE_PASSES`` reads/writes of
                ``m x hidden`` bf16 at the system's empirical bandwidth plus its constant latency each)]
  + the LM head GEMM at ``sampled`` rows + a fixed per-iteration overhead (``--overhead-ms``, host side:
  scheduling, sampling, launch; TensorRT-LLM's executor overlaps some of it, so it is a stated guess).
``LocalStepModel`` (``--system local``): this machine's measured per-precision layer costs (the engine's
StepCosts) plus attention, elementwise and per-iteration overhead fitted on a short calibration run of the
real engine (sim/local_calibration.py).
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from policy import FULL, StepCosts
from serve.model.model_config import ModelConfig
from sim.kernel_tables import KernelTables
from sim.model_specs import projections

ELEMENTWISE_PASSES = 12
ELEMENTWISE_KERNELS = 6
STEP_COST_TOKENS = (1, 8, 32, 128, 512)  # serve.model.step_costs.TOKEN_COUNTS: the controller's grid


@dataclass
class BatchShape:
    decode_kv_lens: list[int] = field(default_factory=list)
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)  # (start, end) token positions
    sampled: int = 0
    decode_kv8: float = 0.0  # the KV-precision rung: share of the decodes' KV in 8-bit blocks (by KV length)
    prefill_kv8: list[float] = field(default_factory=list)  # and of each prefill chunk's

    @property
    def num_tokens(self) -> int:
        return len(self.decode_kv_lens) + sum(e - s for s, e in self.prefill_chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.decode_kv_lens) + len(self.prefill_chunks)


def precision_counts(precisions: Sequence[str]) -> dict[str, int]:
    return dict(collections.Counter(precisions))


class StepModel(Protocol):
    """An iteration's seconds from its batch and the layers' precisions, and the per-precision StepCosts the
    cost-aware controller reads (what the engine would measure on that device)."""

    def step_s(self, batch: BatchShape, precisions: Sequence[str]) -> float: ...

    def step_costs(self, precisions: Sequence[str]) -> StepCosts: ...


class TableStepModel:
    def __init__(self, tables: KernelTables, cfg: ModelConfig, overhead_s: float, kv_cache_dtype: str = "auto",
                 kv_rung: str | None = None) -> None:
        """``kv_cache_dtype``: the KV the attention rows read (auto: bf16, or fp8); ``kv_rung``: the KV-precision
        rung's 8-bit format (fp8), whose blocks read its rows."""
        self.tables = tables
        self.cfg = cfg
        self.overhead_s = overhead_s
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_rung = kv_rung
        self.projections = projections(cfg)
        spec = tables.spec
        self._elementwise_bw = spec.mem_bw * 0.8

    def reading(self, kv_cache_dtype: str | None = None, kv_rung: str | None = None) -> TableStepModel:
        """This model with the attention rows of another KV format (the cache's, or the KV rung's beside it)."""
        out = copy.copy(self)
        out.kv_cache_dtype = kv_cache_dtype or self.kv_cache_dtype
        out.kv_rung = kv_rung or self.kv_rung
        return out

    def layer_linears_s(self, precision: str, m: int) -> float:
        return sum(self.tables.gemm_s(precision, m, p.n, p.k) for p in self.projections)

    def head_s(self, rows: int, precision: str = FULL) -> float:
        """The LM head GEMM at ``rows`` rows (``precision``: a self-speculative draft's head is quantized)."""
        return self.tables.gemm_s(precision, max(rows, 1), self.cfg.vocab_size, self.cfg.hidden_size)

    def _mixed(self, lookup, share8: float) -> float:
        """A lookup over the cache's KV: with the KV rung's 8-bit share, the full-precision rows' time and the 8-bit
        rows' weighted by their shares of the KV (attention at these lengths reads its KV once: its time follows the
        bytes, and each format's rows are measured whole)."""
        t = lookup(self.kv_cache_dtype)
        if share8 > 0 and self.kv_rung is not None:
            t = (1 - share8) * t + share8 * lookup(self.kv_rung)
        return t

    def attention_s(self, batch: BatchShape) -> float:
        t = 0.0
        if batch.decode_kv_lens:
            n, mean = len(batch.decode_kv_lens), sum(batch.decode_kv_lens) / len(batch.decode_kv_lens)
            t += self._mixed(lambda kv: self.tables.generation_attention_s(self.heads, n, mean, kv), batch.decode_kv8)
        shares = batch.prefill_kv8 or [0.0] * len(batch.prefill_chunks)
        for (start, end), share8 in zip(batch.prefill_chunks, shares):
            causal = (end * end - start * start) / (end * end)
            t += self._mixed(lambda kv: self.tables.context_attention_s(self.heads, 1, end, kv), share8) * causal
        return t

    def elementwise_s(self, m: int) -> float:
        return ELEMENTWISE_KERNELS * 3e-6 + ELEMENTWISE_PASSES * m * self.cfg.hidden_size * 2 / self._elementwise_bw

    def step_s(self, batch: BatchShape, precisions: Sequence[str], head: str = FULL) -> float:
        m = batch.num_tokens
        if m == 0:
            return 0.0
        linears = sum(n * self.layer_linears_s(p, m) for p, n in precision_counts(precisions).items())
        per_layer = self.attention_s(batch) + self.elementwise_s(m)
        return linears + len(precisions) * per_layer + self.head_s(batch.sampled, head) + self.overhead_s

    def step_costs(self, precisions: Sequence[str]) -> StepCosts:
        """The controller's StepCosts from the tables (what the engine would measure on that GPU)."""
        counts = STEP_COST_TOKENS
        return StepCosts(device=f"{self.tables.spec.device} (TensorRT-LLM {self.tables.spec.version} tables)",
                         token_counts=counts,
                         layer_s={p: tuple(self.layer_linears_s(p, n) for n in counts) for p in (FULL, *precisions)},
                         rest_s=tuple(self.head_s(n) for n in counts),
                         meta={"source": f"aiconfigurator-core {self.tables.spec.name}"})


@dataclass(frozen=True)
class LocalTerms:
    """Fitted on this machine (seconds): per layer, attention and elementwise work; per iteration, overhead."""

    per_layer_const: float
    per_layer_token: float          # x m
    per_layer_decode_ctx: float     # x sum of the decodes' KV lengths
    per_layer_prefill_work: float   # x sum over chunks of tokens x mean causal context
    step_const: float               # engine overhead per iteration
    step_per_seq: float             # engine overhead per scheduled sequence
    meta: Mapping[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("per_layer_const", "per_layer_token", "per_layer_decode_ctx",
                                              "per_layer_prefill_work", "step_const", "step_per_seq")} | \
            {"meta": dict(self.meta)}


def prefill_work(chunks: Sequence[tuple[int, int]]) -> float:
    """Sum over chunks of query tokens x mean causal context: the attention work of prefill chunks."""
    return sum((e - s) * (s + e) / 2 for s, e in chunks)


class LocalStepModel:
    def __init__(self, costs: StepCosts, terms: LocalTerms) -> None:
        self.costs = costs
        self.terms = terms

    def forward_s(self, batch: BatchShape, precisions: Sequence[str]) -> float:
        m = batch.num_tokens
        if m == 0:
            return 0.0
        t = self.terms
        linears = sum(n * self.costs.layer_cost_s(p, m) for p, n in precision_counts(precisions).items())
        per_layer = (t.per_layer_const + t.per_layer_token * m + t.per_layer_decode_ctx * sum(batch.decode_kv_lens)
                     + t.per_layer_prefill_work * prefill_work(batch.prefill_chunks))
        head = self.costs._interp(self.costs.rest_s, max(batch.sampled, 1)) if self.costs.rest_s else 0.0
        return linears + len(precisions) * max(per_layer, 0.0) + head

    def step_s(self, batch: BatchShape, precisions: Sequence[str]) -> float:
        if batch.num_tokens == 0:
            return 0.0
        return self.forward_s(batch, precisions) + self.terms.step_const + self.terms.step_per_seq * batch.num_seqs

    def step_costs(self, precisions: Sequence[str]) -> StepCosts:
        return self.costs
