"""Giving the C heap's free pages back to the operating system (glibc's ``malloc_trim``).

glibc keeps what a process frees in its heap for reuse and returns only the top of it, so a burst of temporaries
(loading and packing the weights: ~0.9 GB for smollm2-135m at fp32) stays resident after it is freed.
``malloc_trim(0)`` releases every free page of every arena (``madvise``), in ~30 ms after a load and ~1 ms
otherwise; the next allocation there maps fresh pages. Elsewhere (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_size_t,)
    fn.restype = ctypes.c_int
    return fn


def release_free_heap() -> bool:
    """Return the C heap's free pages to the OS; False where that cannot be done (no glibc)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
