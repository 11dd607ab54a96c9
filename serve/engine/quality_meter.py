"""The quality meter: while layers are quantized or KV blocks are 8-bit, how often the served next token is the one
full precision would give on the same context, measured live on positions of running sequences.

A resource manager (serve/resource_seam.py) hosted after the levers; its rules are policy/quality.py's. After each
executed batch (``after_execute``, before the engine samples from the logits) it asks the sampling rule how many of
the batch's sampled positions it may afford, picks them at random and, for each, runs the full-precision model over
the position's whole context in scratch state: the layer bank's full-precision source of every layer served
quantized (the model's own layer where it is full precision), a full-precision KV cache of its own allocated for
the sample and dropped after it, one prefill. It compares that next-token distribution with the logits row the
served configuration produced for the same position (top-1 agreement, total variation). Nothing it runs writes the
served model, the served KV cache, the block pool or the logits, so it never changes a served token or the block
accounting; the tests check both.

A sample is taken and finished inside the step, so a request that is preempted, cancelled or finishes later is
simply not sampled again; prefix reuse does not matter to it (the reference recomputes the whole context). With
speculation on, a verified chunk's first row (its context as it stood, before any draft token) is the one sampled.

It also counts, per request and in total, the tokens served while layers were quantized and while the request read
8-bit KV blocks (the tokens a step emitted, counted at the next boundary or when the request ends). While nothing
is quantized it does nothing but look at the layers' precisions and the pool's 8-bit extents.

On CUDA the bank's full-precision sources are pinned host copies: each sample copies the quantized layers'
sources to the device (``LayerBank.detached``, the copy a restore makes), which has not run on a GPU yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from policy import FULL
from policy.quality import QualityReading, QualityWindow, SamplingRule
from serve.engine.scheduler import ScheduledChunk
from serve.engine.sequence import Sequence as EngineSequence
from serve.engine.spec_executor import rows_of
from serve.memory.block_pool import BlockPool
from serve.model.kv_cache import PagedKVCache
from serve.model.llama import DecoderLayer, ForwardBatch, LlamaModel, PrefillChunk
from serve.morph.layer_bank import LayerBank
from serve.resource_seam import ResourceManagerBase, SchedulerView

MAX_CONTEXT = 2048
"""Longest context sampled: one sample is one prefill of its context, and a longer one would stall its step for
that long (the budget is an average). Positions past it are not sampled (docs/quality.md says so)."""


@dataclass(frozen=True)
class QualityStats:
    """The meter's snapshot (``EngineStats.resources["quality"]``)."""

    reading: QualityReading | None
    samples_total: int
    agreed_total: int
    divergence_total: float
    tokens_quantized_layers: int  # tokens served while some layer was quantized
    tokens_kv_8bit: int           # tokens served to a request reading 8-bit KV blocks
    meter_seconds: float          # spent on reference forwards
    earned_seconds: float         # the budget earned: cost fraction x step time while something was quantized

    def engine_fields(self) -> dict[str, Any]:
        r = self.reading
        return {"quality_agreement": r.agreement if r else None, "quality_agreement_lower": r.lower if r else None,
                "quality_divergence": r.divergence if r else None, "quality_samples_total": self.samples_total,
                "tokens_quantized_layers_total": self.tokens_quantized_layers,
                "tokens_kv_8bit_total": self.tokens_kv_8bit, "quality_meter_seconds_total": self.meter_seconds}


@dataclass
class _Served:
    """A request's tokens before this step's append, and what served them."""

    seq: EngineSequence
    tokens_before: int
    quantized_layers: bool
    kv_8bit: bool


class QualityMeter(ResourceManagerBase):
    name = "quality"

    def __init__(self, model: LlamaModel, full_layer: Callable[[int], DecoderLayer], pool: BlockPool,
                 kv: PagedKVCache, rule: SamplingRule, window: QualityWindow,
                 clock: Callable[[], float]) -> None:
        """``full_layer(i)``: layer i's full-precision source, on the model's device (the bank's)."""
        self.model, self.full_layer, self.pool, self.kv = model, full_layer, pool, kv
        self.rule, self.window, self.clock = rule, window, clock
        self.block_size = kv.block_size
        self.tokens_quantized_layers = self.tokens_kv_8bit = 0
        self._step_started: float | None = None
        self._served: dict[str, _Served] = {}
        self._scheduler: SchedulerView | None = None

    # ---- what is served now -------------------------------------------------------------------------------------
    def layers_quantized(self) -> bool:
        return any(layer.precision != FULL for layer in self.model.layers)

    def kv_8bit_in_pool(self) -> bool:
        return self.kv.is_quantized or self.pool.num_quantized_extents > 0

    def reads_8bit(self, seq: EngineSequence) -> bool:
        return self.kv.is_quantized or any(self.pool.is_quantized(b) for b in seq.block_ids)

    # ---- the seam -------------------------------------------------------------------------------------------------
    def before_schedule(self, scheduler: SchedulerView) -> None:
        self._settle_all()
        self._scheduler = scheduler

    def after_schedule(self, num_tokens: int) -> None:
        self._step_started = self.clock()

    def after_execute(self, sampled: Sequence[Any], logits: Any) -> None:
        """The batch ran: ``logits`` holds ``rows_of(c)`` rows per chunk of ``sampled``, in order."""
        started, self._step_started = self._step_started, None
        layers_q = self.layers_quantized()
        kv8 = self.kv_8bit_in_pool()
        active = layers_q or kv8
        self.rule.step(self.clock() - started if started is not None else 0.0, active)
        if not active or not sampled:
            return
        rows, row = [], 0
        for c in sampled:
            rows.append(row)
            row += rows_of(c)
            self._served[c.seq.request_id] = _Served(c.seq, c.seq.num_output_tokens, layers_q,
                                                     kv8 and self.reads_8bit(c.seq))
        contexts = [c.start + c.num_tokens for c in sampled]
        candidates = [i for i, n in enumerate(contexts) if n <= MAX_CONTEXT]
        waiting = self._scheduler.num_waiting() if self._scheduler is not None else 0  # left by this schedule
        room = tbt_room(sampled, self.clock())
        for j in self.rule.choose([contexts[i] for i in candidates], active, waiting, room):
            i = candidates[j]
            self._sample(sampled[i], logits[rows[i]])

    def on_request_finished(self, request_id: str) -> None:
        served = self._served.pop(request_id, None)
        if served is not None:
            self._settle(served)

    def resource_stats(self) -> QualityStats:
        w = self.window
        return QualityStats(w.reading(), w.samples_total, w.agreed_total, w.divergence_total,
                            self.tokens_quantized_layers, self.tokens_kv_8bit, self.rule.spent_s, self.rule.earned_s)

    def reading(self) -> QualityReading | None:
        """The window's estimate while something is quantized (what the controller's quality floor reads,
        policy/quality.py ``QualitySource``); None once everything is back at full precision, which meets any floor
        (the window keeps the samples of the configurations gone, and the metrics keep showing them)."""
        return self.window.reading() if self.layers_quantized() or self.kv_8bit_in_pool() else None

    # ---- tokens served per configuration ----------------------------------------------------------------------------
    def _settle_all(self) -> None:
        for served in self._served.values():
            self._settle(served)
        self._served.clear()

    def _settle(self, served: _Served) -> None:
        n = max(0, served.seq.num_output_tokens - served.tokens_before)
        if served.quantized_layers:
            self.tokens_quantized_layers += n
            served.seq.served_quantized_tokens += n
        if served.kv_8bit:
            self.tokens_kv_8bit += n
            served.seq.served_kv_8bit_tokens += n

    # ---- one sample
    # ---------------------------------------------------------------------------------------------------
    def _sample(self, chunk: ScheduledChunk, served_row: torch.Tensor) -> None:
        t0 = self.clock()
        context = chunk.seq.token_ids[: chunk.start + chunk.num_tokens]
        served = torch.softmax(served_row.float(), dim=-1)
        full = torch.softmax(self.reference(context).float(), dim=-1)
        agreed = bool(served.argmax() == full.argmax())
        tv = min(1.0, float(0.5 * (served - full).abs().sum()))
        self.window.add(agreed, tv)
        chunk.seq.quality_samples += 1
        chunk.seq.quality_agreed += int(agreed)
        self.rule.spent(self.clock() - t0, len(context))

    def reference_layers(self) -> list[DecoderLayer]:
        return [layer if layer.precision == FULL else self.full_layer(i) for i, layer in enumerate(self.model.layers)]

    @torch.inference_mode()
    def reference(self, context: list[int]) -> torch.Tensor:
        """Full-precision logits of the token after ``context``: every layer at full precision over a full-precision
        KV cache of the sample's own (never the served one)."""
        m, n = self.model, len(context)
        scratch = PagedKVCache.standalone(m.config, -(-n // self.block_size), self.block_size, m.device, m.dtype)
        pos = torch.arange(n, device=m.device)
        batch = ForwardBatch(input_ids=torch.tensor(context, device=m.device), positions=pos, slot_mapping=pos,
                             num_decodes=0, prefills=[PrefillChunk(0, n, 0, None)],
                             sample_indices=torch.tensor([n - 1], device=m.device))
        return m.forward(batch, scratch, layers=self.reference_layers())[0]


def tbt_room(sampled: Sequence[Any], now: float) -> float:
    """How much longer this step may last before one of its requests' next token misses its TBT target: the least
    of (TBT target - time since its last token) over the batch's requests with a token out (inf if none)."""
    rooms = [c.seq.slo.tbt_s - (now - c.seq.last_token_time) for c in sampled
             if c.seq.slo.tbt_s is not None and c.seq.last_token_time is not None]
    return min(rooms, default=float("inf"))


def build_quality_meter(fraction: float, confidence: float, model: LlamaModel | None, bank: Any, pool: BlockPool,
                        kv: Any, clock: Callable[[], float], seed: int = 0,
                        floor_set: bool = False) -> QualityMeter | None:
    """The meter over the engine's model and layer bank; None when it is off (``fraction`` 0), simulated (no model)
    or there is no bank to read full precision from. It samples only in steps that leave nobody waiting unless
    ``floor_set`` (a quality floor needs readings under pressure): ``SamplingRule.defer_while_waiting``."""
    if fraction <= 0 or model is None or not isinstance(bank, LayerBank) or not isinstance(kv, PagedKVCache):
        return None
    if model.device.type == "cpu":
        def full_layer(i: int) -> DecoderLayer:
            return bank.host[i][FULL]
    else:
        def full_layer(i: int) -> DecoderLayer:
            return bank.detached(i, FULL)
    rule = SamplingRule(fraction, seed=seed, defer_while_waiting=not floor_set)
    return QualityMeter(model, full_layer, pool, kv, rule, QualityWindow(confidence=confidence), clock)
