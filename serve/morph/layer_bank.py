"""Every precision of every decoder layer in host memory, and the copies that move them into the arena.

Host side: ``host[i][precision]`` holds layer i at every precision the mode can use, full precision
included (the source of every restore). On CUDA the host copies are pinned, so copies are asynchronous,
and int4 weights are already packed for the CUDA kernel, so a swap is a plain memcpy.

Device side: layer i owns the arena slots ``regions[i]``. A variant of precision p sits at the *tail* of
the region, from slot ``start + R - slots(p)`` on (full precision fills all R slots); the head slots in
front of it are free for KV blocks. One staging range holds the single copy in flight.

Copies run off the forward's critical path: a worker thread on CPU; on CUDA a dedicated stream that first
waits for the compute stream (the forward still reading the old bytes) and records an event the compute
stream waits on before the copied layer is used. Nothing calls a device-wide synchronize.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from policy import FULL
from serve.memory.arena import Arena, SlotRange
from serve.model.linear import ConcatLinear
from serve.model.llama import DecoderLayer, LlamaModel
from serve.model.quantized_linear import host_packed
from serve.morph.placement import arena_nbytes, remap, weight_tensors
from serve.process.omp_threads import serial_torch_here


def host_copy(layer: DecoderLayer, device: torch.device) -> DecoderLayer:
    """The host-memory source of a layer for ``device``: CPU tensors (pinned when the device is CUDA), each op
    packed as its format's host rule says (int4: in ``device``'s kernel layout)."""
    layer = remap_ops(layer, lambda op: host_packed(op, device))
    if device.type == "cuda":
        return remap(layer, lambda t: t.detach().to("cpu").pin_memory())
    return remap(layer, lambda t: t.detach().to("cpu").clone())


def remap_ops(layer: DecoderLayer, f) -> DecoderLayer:
    """The layer with each linear op (and each op inside a ConcatLinear) replaced by ``f(op)``."""
    def op(x):
        if isinstance(x, ConcatLinear):
            return ConcatLinear([f(o) for o in x.ops], x.bias)
        return f(x)
    return DecoderLayer(layer.input_norm, layer.post_attention_norm, op(layer.qkv), op(layer.o), op(layer.gate_up),
                        op(layer.down), layer.precision)


@dataclass
class CopyJob:
    """One copy in flight: the layer being built, and how to tell when its bytes have landed."""

    layer: DecoderLayer | None
    future: Future | None = None         # CPU: the worker's result
    event: torch.cuda.Event | None = None  # CUDA: recorded on the copy stream after the last copy
    device: torch.device | None = None

    def done(self) -> bool:
        if self.future is not None:
            return self.future.done()
        return self.event is None or self.event.query()

    def result(self) -> DecoderLayer:
        if self.future is not None:
            self.layer = self.future.result()
        elif self.event is not None:  # later work on the compute stream waits for the copy, the host does not
            torch.cuda.current_stream(self.device).wait_event(self.event)
        assert self.layer is not None
        return self.layer


class ServedLayer(Protocol):
    precision: str


class ServedModel(Protocol):
    layers: list[Any]  # each a ServedLayer: what the next forward runs, at its precision


class CopyInFlight(Protocol):
    def done(self) -> bool: ...

    def result(self) -> Any: ...


class ReleasableSlots(Protocol):
    """The arena's give-back (memory yield): serve/memory/arena.py."""

    @property
    def can_release(self) -> bool: ...

    def release(self, r: SlotRange) -> int: ...

    def recommit(self, r: SlotRange) -> int: ...


class MorphBank(Protocol):
    """What the morph runtime moves layers with: the real :class:`LayerBank`, or the planner's byte-counting one
    (sim/bank.py), whose layers are their precision and whose copies take time on a virtual clock."""

    model: ServedModel
    device: torch.device
    arena: ReleasableSlots
    regions: list[SlotRange]
    staging: SlotRange
    host: Mapping[int, Mapping[str, Any]]  # host[i][precision]: layer i's source at that precision

    @property
    def precisions(self) -> set[str]: ...

    def precision_of(self, i: int) -> str: ...

    def slots(self, i: int, precision: str) -> int: ...

    def tail(self, i: int, precision: str) -> SlotRange: ...

    def copy_async(self, src: Any, dest: SlotRange) -> CopyInFlight: ...

    def copy_now(self, src: Any, dest: SlotRange) -> Any: ...

    def install(self, i: int, layer: Any) -> None: ...

    def shutdown(self) -> None: ...


class BankSlots:
    """The slot arithmetic of a layer bank, shared by :class:`LayerBank` and the planner's: layer i at precision p
    sits at the tail of its region (all of it at full precision). Subclasses give ``nbytes``."""

    model: Any
    regions: list[SlotRange]
    host: Mapping[int, Mapping[str, Any]]
    slot_bytes: int

    @property
    def precisions(self) -> set[str]:
        return set.intersection(*(set(v) for v in self.host.values())) - {FULL}

    def precision_of(self, i: int) -> str:
        return self.model.layers[i].precision

    def nbytes(self, i: int, precision: str) -> int:
        raise NotImplementedError

    def slots(self, i: int, precision: str) -> int:
        """Slots layer i occupies at ``precision``: all of its region at full precision."""
        if precision == FULL:
            return self.regions[i].num_slots
        return -(-self.nbytes(i, precision) // self.slot_bytes)

    def tail(self, i: int, precision: str) -> SlotRange:
        r = self.regions[i]
        n = self.slots(i, precision)
        return SlotRange(r.end - n, n)

    def install(self, i: int, layer: Any) -> None:
        """Make ``layer`` the one the next forward uses (call only between iterations)."""
        self.model.layers[i] = layer


class LayerBank(BankSlots):
    def __init__(self, model: LlamaModel, arena: Arena, regions: list[SlotRange], staging: SlotRange,
                 host: dict[int, dict[str, DecoderLayer]]) -> None:
        self.model = model
        self.device = model.device
        self.arena = arena
        self.regions = regions
        self.staging = staging
        self.host = host
        self.slot_bytes = arena.slot_bytes
        # the full-precision layers as views into their regions (valid whenever the region holds full weights)
        self.full_views = [model.layers[i] for i in range(len(model.layers))]
        # The copy worker runs its copies serially: a team of its own would throttle the stepping thread's
        # (serve/process/omp_threads.py), and a layer's memcpy needs no second core.
        self._workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="morphserve-swap",
                                           initializer=serial_torch_here)
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def nbytes(self, i: int, precision: str) -> int:
        """Arena bytes of layer i at ``precision`` (tensors ALIGN-aligned)."""
        return arena_nbytes(self.host[i][precision])

    # ---- copies -----------------------------------------------------------------------------------
    def copy_async(self, src: DecoderLayer, dest: SlotRange) -> CopyJob:
        """Start copying ``src``'s weights into the arena slots ``dest`` (front to back)."""
        alloc = self.arena.allocator(dest)
        if self._copy_stream is None:
            return CopyJob(None, future=self._workers.submit(remap, src, alloc.place))
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)  # the forward may still read these bytes
        with torch.cuda.stream(self._copy_stream):
            layer = remap(src, lambda t: alloc.place(t, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        return CopyJob(layer, event=event, device=self.device)

    def copy_now(self, src: DecoderLayer, dest: SlotRange) -> DecoderLayer:
        """Copy ``src`` into ``dest`` on the compute stream (device-local, at an iteration boundary)."""
        alloc = self.arena.allocator(dest)
        return remap(src, alloc.place)

    def detached(self, i: int, precision: str) -> DecoderLayer:
        """Layer i at ``precision`` in fresh device tensors outside the arena (evaluation tools only)."""
        return remap(self.host[i][precision], lambda t: t.to(self.device, copy=True))

    def resident_ranges(self, i: int) -> list[tuple[int, int]]:
        """(first byte, end) of each weight tensor of the installed layer i (tests check addresses)."""
        return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t
                in weight_tensors(self.model.layers[i])]

    def shutdown(self) -> None:
        self._workers.shutdown(wait=True)
