"""The simulated executor: TorchExecutor's contract (chunks in, logits and the sampled chunks out, decodes
first), with the step's time taken from a step model (or, with self-speculative decoding modelled, from
sim/speculation.py) and added to the virtual clock instead of computed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, Sequence

import torch

from serve.engine.scheduler import ScheduledChunk
from serve.morph.layer_bank import MorphBank
from sim.bank import SimKV
from sim.clock import VirtualClock
from sim.step_model import BatchShape, StepModel


def batch_shape(chunks: list[ScheduledChunk],
                share_8bit: Callable[[list[int]], float] | None = None) -> tuple[BatchShape, list[ScheduledChunk]]:
    """The step's shape; ``share_8bit(block_ids)`` (the KV-precision rung's mixed cache): the share of 8-bit KV the
    decodes read (weighted by their KV lengths) and each prefill chunk's."""
    decodes = [c for c in chunks if c.is_decode]  # TorchExecutor.prepare's split
    prefills = [c for c in chunks if not c.is_decode]
    sampled = [c for c in decodes if c.samples] + [c for c in prefills if c.samples]
    shape = BatchShape(decode_kv_lens=[c.start + 1 for c in decodes],
                       prefill_chunks=[(c.start, c.start + c.num_tokens) for c in prefills], sampled=len(sampled))
    if share_8bit is not None:
        lens = shape.decode_kv_lens
        if decodes:
            shape.decode_kv8 = sum(share_8bit(c.seq.block_ids) * n for c, n in zip(decodes, lens)) / sum(lens)
        shape.prefill_kv8 = [share_8bit(c.seq.block_ids) for c in prefills]
    return shape, sampled


class SpeculativeStepModel(Protocol):
    def step_s(self, chunks: list[ScheduledChunk], shape: BatchShape, precisions: Sequence[str]) -> float: ...


class SimExecutor:
    """The Executor protocol (serve/engine/executor.py) on a virtual clock."""

    def __init__(self, step_model: StepModel, bank: MorphBank | None, num_layers: int, clock: VirtualClock,
                 token_id: int, kv: SimKV | None = None, speculation: SpeculativeStepModel | None = None) -> None:
        self.step_model = step_model
        self.speculation = speculation  # sim/speculation.py: the iteration's modelled time with drafting
        self.share_8bit = kv.share_8bit if kv is not None and kv.mixes_formats else None
        self.bank = bank
        self.num_layers = num_layers
        self.clock = clock
        self.token_id = token_id  # every sampled row yields this token (the replay forces output lengths)
        self.steps = 0
        self.busy_s = 0.0

    def precisions(self) -> list[str]:
        if self.bank is None:
            return ["full"] * self.num_layers
        return [layer.precision for layer in self.bank.model.layers]

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        shape, sampled = batch_shape(chunks, self.share_8bit)
        if not chunks:
            dt = 0.0
        elif self.speculation is not None:
            dt = self.speculation.step_s(chunks, shape, self.precisions())
        else:
            dt = self.step_model.step_s(shape, self.precisions())
        self.clock.advance(dt)
        self.steps += 1
        self.busy_s += dt
        logits = torch.full((len(sampled), self.token_id + 1), -1e9)
        logits[:, self.token_id] = 0.0
        return logits, sampled
