"""Giving whole pages of a CPU tensor back to the kernel, and taking them again.

``madvise(MADV_DONTNEED)`` on private anonymous memory drops the pages at once: the process's resident
memory falls by their size, and the next touch maps fresh zero pages. Only the page-aligned interior of a
byte range can go (a partial page at either end stays), so a release returns at most one page less per end
than it was asked for. The arena's big buffer is one glibc ``mmap`` chunk, so nothing else shares its pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

MADV_DONTNEED = 4  # <sys/mman.h> on Linux
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def page_interior(start: int, end: int, page: int = PAGE) -> tuple[int, int]:
    """The page-aligned [first, last) inside [start, end) (empty: first >= last)."""
    first = (start + page - 1) // page * page
    last = end // page * page
    return first, max(first, last)


def release_pages(start: int, end: int) -> int:
    """Drop the whole pages inside the address range [start, end); returns the bytes dropped."""
    first, last = page_interior(start, end)
    if last <= first:
        return 0
    if _libc.madvise(first, last - first, MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) of {last - first} bytes failed: {os.strerror(err)}")
    return last - first


def resident_bytes() -> int:
    """This process's resident set (VmRSS), for tests and the demo."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")
