"""The simulated executor: TorchExecutor's contract (chunks in, logits and the sampled chunks out, decodes
first), with the step's time taken from a step model and added to the virtual clock instead of computed."""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from serve.engine.scheduler import ScheduledChunk
from sim.bank import SimLayerBank
from sim.clock import VirtualClock
from sim.step_model import BatchShape


class StepModel(Protocol):
    def step_s(self, batch: BatchShape, precisions: Sequence[str]) -> float: ...


def batch_shape(chunks: list[ScheduledChunk]) -> tuple[BatchShape, list[ScheduledChunk]]:
    decodes = [c for c in chunks if c.is_decode]  # TorchExecutor.prepare's split
    prefills = [c for c in chunks if not c.is_decode]
    sampled = [c for c in decodes if c.samples] + [c for c in prefills if c.samples]
    shape = BatchShape(decode_kv_lens=[c.start + 1 for c in decodes],
                       prefill_chunks=[(c.start, c.start + c.num_tokens) for c in prefills], sampled=len(sampled))
    return shape, sampled


class SimExecutor:
    def __init__(self, step_model: StepModel, bank: SimLayerBank | None, num_layers: int, clock: VirtualClock,
                 token_id: int) -> None:
        self.step_model = step_model
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
        shape, sampled = batch_shape(chunks)
        dt = self.step_model.step_s(shape, self.precisions()) if chunks else 0.0
        self.clock.advance(dt)
        self.steps += 1
        self.busy_s += dt
        logits = torch.full((len(sampled), self.token_id + 1), -1e9)
        logits[:, self.token_id] = 0.0
        return logits, sampled
