"""Walking a decoder layer's weight tensors: list them, or rebuild the layer with each tensor replaced.

A layer variant is a small object graph (DecoderLayer -> DenseLinear / ConcatLinear / Int8WeightOnly /
Int4WeightOnly / Fp8WeightOnly -> tensors). Placing it in the arena, pinning it in host memory or copying
it to a device are all "the same layer, each weight tensor mapped through f"; the norms are shared by
every variant of a layer and live outside the arena, so they are never mapped.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch

from serve.memory.arena import placed_nbytes

SHARED_FIELDS = ("input_norm", "post_attention_norm")


def _children(obj: object) -> Iterator[tuple[str, object]]:
    for name, value in vars(obj).items():
        if name in SHARED_FIELDS:
            continue
        if isinstance(value, (torch.Tensor, list)) or hasattr(value, "__dict__"):
            yield name, value


def weight_tensors(obj: object) -> list[torch.Tensor]:
    """Every weight tensor of a layer (or op), in a fixed walk order; shared norms excluded."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list):
        return [t for x in obj for t in weight_tensors(x)]
    if hasattr(obj, "__dict__"):
        return [t for _, v in _children(obj) for t in weight_tensors(v)]
    return []


def remap(obj, f: Callable[[torch.Tensor], torch.Tensor]):
    """A shallow copy of ``obj`` whose weight tensors are ``f(tensor)`` (same walk order as weight_tensors);
    other attributes (group size, layout, precision, the shared norms) are kept as they are."""
    if isinstance(obj, torch.Tensor):
        return f(obj)
    if isinstance(obj, list):
        return [remap(x, f) for x in obj]
    if hasattr(obj, "__dict__"):
        new = copy.copy(obj)
        for name, value in _children(obj):
            setattr(new, name, remap(value, f))
        return new
    return obj


def arena_nbytes(layer: object) -> int:
    """Bytes the layer's weights take in the arena (each tensor ALIGN-aligned)."""
    return placed_nbytes(weight_tensors(layer))
