"""A CUDA arena whose segments can go back to the driver: CUDA virtual memory management (VMM).

A ``cudaMalloc``'d buffer (what ``torch.empty`` gives, through torch's caching allocator) can only be freed
whole, and freeing it returns it to torch's cache, not to the device. Yield needs part of the arena back
on the device for another process, so on CUDA the arena is built the way the driver API documents for
growable or sparse buffers: one reserved virtual address range (``cuMemAddressReserve``), backed by
physical segments of ``segment_bytes`` (``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``). Releasing a
byte range unmaps and releases every segment that lies wholly inside it (``cuMemUnmap`` + ``cuMemRelease``:
the device's used memory falls, NVML shows it); recommitting creates and maps them again at the same
addresses, so every tensor view into the arena stays valid. Torch sees the range as one uint8 tensor
through ``__cuda_array_interface__``.

Status: written against the CUDA driver API reference (Virtual Memory Management, CUDA 10.2+); the segment
arithmetic is tested on CPU with a recording driver; the calls themselves have not run here (no GPU).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Protocol

import torch

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
DEFAULT_SEGMENT_BYTES = 4 * 2**20  # 2 MiB granularity on current GPUs; 70 GiB is ~18k segments


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class Driver(Protocol):
    """The five driver operations the arena needs (a recording fake implements them in tests)."""

    def granularity(self) -> int: ...
    def reserve(self, size: int) -> int: ...
    def map_new(self, address: int, size: int) -> int: ...  # create + map + set access; returns the handle
    def unmap_release(self, address: int, size: int, handle: int) -> None: ...
    def free_reservation(self, address: int, size: int) -> None: ...


class CudaDriver:
    """ctypes bindings to libcuda for one device ordinal (the context torch made current)."""

    def __init__(self, device_ordinal: int) -> None:
        self._cu = ctypes.CDLL("libcuda.so.1")
        self._prop = _AllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                                     location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, device_ordinal))
        self._access = _AccessDesc(location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, device_ordinal),
                                   flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE)

    def _check(self, name: str, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")

    def granularity(self) -> int:
        g = ctypes.c_size_t()
        self._check("cuMemGetAllocationGranularity", self._cu.cuMemGetAllocationGranularity(
            ctypes.byref(g), ctypes.byref(self._prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        return g.value

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self._check("cuMemAddressReserve", self._cu.cuMemAddressReserve(
            ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0)))
        return ptr.value

    def map_new(self, address: int, size: int) -> int:
        handle = ctypes.c_uint64()
        self._check("cuMemCreate", self._cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size),
                                                         ctypes.byref(self._prop), ctypes.c_ulonglong(0)))
        try:
            self._check("cuMemMap", self._cu.cuMemMap(ctypes.c_uint64(address), ctypes.c_size_t(size),
                                                      ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)))
        except RuntimeError:
            self._cu.cuMemRelease(handle)
            raise
        self._check("cuMemSetAccess", self._cu.cuMemSetAccess(ctypes.c_uint64(address), ctypes.c_size_t(size),
                                                              ctypes.byref(self._access), ctypes.c_size_t(1)))
        return handle.value

    def unmap_release(self, address: int, size: int, handle: int) -> None:
        self._check("cuMemUnmap", self._cu.cuMemUnmap(ctypes.c_uint64(address), ctypes.c_size_t(size)))
        self._check("cuMemRelease", self._cu.cuMemRelease(ctypes.c_uint64(handle)))

    def free_reservation(self, address: int, size: int) -> None:
        self._check("cuMemAddressFree", self._cu.cuMemAddressFree(ctypes.c_uint64(address), ctypes.c_size_t(size)))


@dataclass
class VmmBuffer:
    """``nbytes`` (rounded up to whole segments) of device memory at one fixed address range."""

    driver: Driver
    nbytes: int
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    address: int = 0
    handles: dict[int, int] = field(default_factory=dict)  # segment index -> physical allocation handle

    def __post_init__(self) -> None:
        g = self.driver.granularity()
        self.segment_bytes = max(g, -(-self.segment_bytes // g) * g)
        self.num_segments = -(-self.nbytes // self.segment_bytes)
        self.address = self.driver.reserve(self.num_segments * self.segment_bytes)
        for i in range(self.num_segments):
            self._map(i)

    def _map(self, i: int) -> None:
        self.handles[i] = self.driver.map_new(self.address + i * self.segment_bytes, self.segment_bytes)

    def segments_inside(self, offset: int, end: int) -> range:
        """Segments lying wholly inside the byte range [offset, end) of the buffer."""
        first = -(-offset // self.segment_bytes)
        last = end // self.segment_bytes
        return range(first, max(first, last))

    def release(self, offset: int, end: int) -> int:
        """Give every mapped segment wholly inside [offset, end) back to the driver; returns the bytes given."""
        given = 0
        for i in self.segments_inside(offset, end):
            handle = self.handles.pop(i, None)
            if handle is not None:
                self.driver.unmap_release(self.address + i * self.segment_bytes, self.segment_bytes, handle)
                given += self.segment_bytes
        return given

    def recommit(self, offset: int, end: int) -> int:
        """Map again every released segment wholly inside [offset, end); returns the bytes taken."""
        taken = 0
        for i in self.segments_inside(offset, end):
            if i not in self.handles:
                self._map(i)
                taken += self.segment_bytes
        return taken

    @property
    def mapped_bytes(self) -> int:
        return len(self.handles) * self.segment_bytes

    def as_tensor(self, device: torch.device) -> torch.Tensor:
        """The whole range as a uint8 CUDA tensor (no copy; the buffer outlives it)."""
        holder = type("_VmmArray", (), {})()
        holder.__cuda_array_interface__ = {"shape": (self.nbytes,), "typestr": "|u1",
                                           "data": (self.address, False), "version": 3, "strides": None}
        return torch.as_tensor(holder, device=device)

    def close(self) -> None:
        self.release(0, self.num_segments * self.segment_bytes)
        self.driver.free_reservation(self.address, self.num_segments * self.segment_bytes)
