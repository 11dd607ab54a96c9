"""Every precision variant of every decoder layer, held in host memory, and the copy that is resident.

A variant is a DecoderLayer whose linear ops run at one precision. Host variants never change; swapping a
layer means materializing a resident copy of another variant (a real copy: memcpy on CPU, an async
host-to-device copy from pinned memory on CUDA) and installing it in the model at an iteration boundary.
The norms are shared between variants, so the bytes a swap frees are exactly the linears' difference.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping

import torch

from policy import FULL
from serve.model.layers import PROJECTIONS
from serve.model.linear import ConcatLinear, LinearOp
from serve.model.llama import DecoderLayer, LlamaModel
from serve.model.quantized_linear import Int8WeightOnly


def _fuse(ops: list, bias: torch.Tensor | None) -> LinearOp:
    """One kernel call for int8 (per-channel scales concatenate exactly); otherwise run each op."""
    if bias is None and all(isinstance(op, Int8WeightOnly) for op in ops):
        return Int8WeightOnly(torch.cat([op.weight for op in ops]), torch.cat([op.scales for op in ops]))
    return ConcatLinear(ops, bias)


def quantized_layer(full: DecoderLayer, linears: Mapping[str, LinearOp], precision: str) -> DecoderLayer:
    missing = [p for p in PROJECTIONS if p not in linears]
    if missing:
        raise ValueError(f"{precision} variant lacks projections {missing}")
    qkv_bias = getattr(full.qkv, "bias", None)
    return DecoderLayer(
        input_norm=full.input_norm, post_attention_norm=full.post_attention_norm,
        qkv=_fuse([linears["q_proj"], linears["k_proj"], linears["v_proj"]], qkv_bias),
        o=linears["o_proj"],
        gate_up=_fuse([linears["gate_proj"], linears["up_proj"]], None),
        down=linears["down_proj"],
        precision=precision,
    )


def materialize(obj, device: torch.device):
    """A deep copy of a layer/op whose tensors live freshly on `device` (shared norms stay shared)."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj.clone()
        return obj.to(device, non_blocking=True)
    if isinstance(obj, list):
        return [materialize(x, device) for x in obj]
    if hasattr(obj, "__dict__"):
        new = copy.copy(obj)
        for name, value in vars(obj).items():
            if name in ("input_norm", "post_attention_norm"):
                continue
            if isinstance(value, (torch.Tensor, list)) or hasattr(value, "__dict__"):
                setattr(new, name, materialize(value, device))
        return new
    return obj


class LayerBank:
    def __init__(self, model: LlamaModel, host_variants: dict[int, dict[str, DecoderLayer]]) -> None:
        self.model = model
        self.device = model.device
        self.host: dict[int, dict[str, DecoderLayer]] = {}
        for i, layer in enumerate(model.layers):
            self.host[i] = {FULL: layer, **host_variants.get(i, {})}
        if model.device.type == "cuda":  # pinned host copies make the H2D swap copies asynchronous
            for i in self.host:
                self.host[i] = {p: (v if p == FULL else materialize(v, torch.device("cpu")))
                                for p, v in self.host[i].items()}
        self._workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="morphserve-swap")

    @property
    def precisions(self) -> set[str]:
        return set.intersection(*(set(v) for v in self.host.values())) - {FULL}

    def precision_of(self, i: int) -> str:
        return self.model.layers[i].precision

    def nbytes(self, i: int, precision: str) -> int:
        return self.host[i][precision].nbytes

    def resident_nbytes(self, i: int) -> int:
        return self.model.layers[i].nbytes

    def prepare(self, i: int, precision: str) -> Future[DecoderLayer]:
        """Start copying layer i's `precision` variant into a fresh resident copy (in a worker thread)."""
        if precision not in self.host[i]:
            raise KeyError(f"layer {i} has no {precision} variant (have {sorted(self.host[i])})")
        return self._workers.submit(self._copy, i, precision)

    def _copy(self, i: int, precision: str) -> DecoderLayer:
        layer = materialize(self.host[i][precision], self.device)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return layer

    def install(self, i: int, layer: DecoderLayer) -> None:
        """Make `layer` the one the next forward uses (call only between iterations)."""
        self.model.layers[i] = layer

    def shutdown(self) -> None:
        self._workers.shutdown(wait=True)
