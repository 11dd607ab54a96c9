"""One allocation for the whole memory budget, carved into KV-block-sized slots.

MorphServe's point is that bytes freed by quantizing a layer become KV cache. Here that is physical, not
bookkeeping: the engine makes a single byte buffer (the arena) on its device, and every full-precision
decoder-layer weight, the swap staging area and every KV block is a view into it. A KV block is one slot
(``slot_bytes`` = K and V of every layer for ``block_size`` tokens), so any slot can hold a block, and a
layer's region is a whole number of slots:

    [ layer 0 region | layer 1 region | ... | staging | base KV blocks ... ]

Quantizing layer i writes the variant into the tail slots of its region and hands the head slots to the
KV pool, at the very addresses the full weights had (the paper's in-place reuse). Nothing else is
allocated afterwards, so the process's resident memory (CPU: the arena is touched at start) or the
device's allocated memory (CUDA) does not grow while KV capacity does.

Yield (policy/memory_yield.py) goes the other way: ``release`` gives the whole pages (CPU, madvise) or
segments (CUDA, a VMM-backed arena: serve/memory/cuda_vmm.py) inside a slot range back to the system, and
``recommit`` takes them again at the same addresses; views into the arena stay valid throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.memory import host_pages
from serve.memory.cuda_vmm import CudaDriver, Driver, VmmBuffer

ALIGN = 64
"""Byte alignment of every tensor placed in the arena (the int8/int4 CPU kernels want 64-byte operands)."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def placed_nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes ``tensors`` take when placed one after another at ALIGN-aligned offsets."""
    return sum(align_up(t.numel() * t.element_size()) for t in tensors)


@dataclass(frozen=True)
class SlotRange:
    start: int
    num_slots: int

    @property
    def end(self) -> int:
        return self.start + self.num_slots


class Arena:
    """A uint8 buffer of ``num_slots * slot_bytes`` bytes on ``device``; typed views into it on demand."""

    def __init__(self, num_slots: int, slot_bytes: int, device: torch.device, touch: bool = True,
                 releasable: bool = False, driver: Driver | None = None) -> None:
        """``releasable`` on CUDA builds the buffer from VMM segments so ``release`` can return them to the
        driver (``driver``: the CUDA driver by default); on CPU every arena can release pages."""
        if num_slots <= 0 or slot_bytes <= 0 or slot_bytes % ALIGN:
            raise ValueError(f"arena needs num_slots > 0 and slot_bytes a positive multiple of {ALIGN}, "
                             f"got {num_slots} x {slot_bytes}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.device = device
        self.vmm: VmmBuffer | None = None
        if releasable and device.type == "cuda":
            self.vmm = VmmBuffer(driver or CudaDriver(device.index or 0), num_slots * slot_bytes)
            self.buf = self.vmm.as_tensor(device)
        else:
            self.buf = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, device=device)
        if touch:  # commit every page now: the budget is taken at start, not lazily as KV fills
            self.buf.zero_()

    @property
    def can_release(self) -> bool:
        return self.device.type == "cpu" or self.vmm is not None

    def release(self, r: SlotRange) -> int:
        """Give the whole pages (CPU) or segments (CUDA VMM) inside ``r`` back; returns the bytes given back.
        The slots' contents are lost; nothing may read them until ``recommit``."""
        start, end = r.start * self.slot_bytes, r.end * self.slot_bytes
        if self.vmm is not None:
            torch.cuda.synchronize(self.device)  # kernels already queued may still read the old bytes: unmap after
            return self.vmm.release(start, end)
        if self.device.type != "cpu":
            return 0
        base = self.buf.data_ptr()
        return host_pages.release_pages(base + start, base + end)

    def recommit(self, r: SlotRange) -> int:
        """Take the memory of ``r`` back (CPU: fault the pages in now, zeroed, so the bytes are ours again
        before anything is copied there; CUDA VMM: map fresh segments); returns the bytes taken."""
        start, end = r.start * self.slot_bytes, r.end * self.slot_bytes
        if self.vmm is not None:
            return self.vmm.recommit(start, end)
        if self.device.type != "cpu":
            return 0
        first, last = host_pages.page_interior(self.buf.data_ptr() + start, self.buf.data_ptr() + end)
        self.buf[start:end].zero_()
        return max(0, last - first)

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def data_ptr(self, slot: int) -> int:
        return self.buf.data_ptr() + slot * self.slot_bytes

    def slots_as(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole arena as ``[num_slots, *shape]`` of ``dtype`` (shape must fill one slot exactly)."""
        per_slot = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if per_slot != self.slot_bytes:
            raise ValueError(f"slot view {shape} of {dtype} is {per_slot} bytes, a slot is {self.slot_bytes}")
        return self.buf.view(dtype).view(self.num_slots, *shape)

    def allocator(self, r: SlotRange) -> SlotAllocator:
        return SlotAllocator(self, r)


class SlotAllocator:
    """Hands out ALIGN-aligned typed views inside one slot range, front to back (a bump allocator)."""

    def __init__(self, arena: Arena, r: SlotRange) -> None:
        self.arena = arena
        self.range = r
        self.offset = r.start * arena.slot_bytes
        self.limit = r.end * arena.slot_bytes

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        start = self.offset
        if start + nbytes > self.limit:
            raise MemoryError(f"slot range {self.range} is full: {nbytes} more bytes at offset "
                              f"{start - self.range.start * self.arena.slot_bytes}")
        self.offset = start + align_up(nbytes)
        return self.arena.buf[start: start + nbytes].view(dtype).view(shape)

    def place(self, t: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """A view in the range holding a copy of ``t`` (any device: host-to-device copies included)."""
        view = self.take(t.shape, t.dtype)
        view.copy_(t, non_blocking=non_blocking)
        return view
