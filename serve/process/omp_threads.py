"""One OpenMP thread team per process: the thread that steps the model.

libgomp keeps a team (a pool of worker threads) for every thread that has started a parallel region, and counts
the workers of all of them. Once that count exceeds the CPUs, it throttles how long an idle worker spins before
it sleeps: from ``GOMP_SPINCOUNT`` (serve/__init__.py sets 200000) down to 1000 spins. A decode step runs ~120
short parallel regions; with a throttled spin the worker is asleep at the start of nearly every one, and each
region then pays a futex wake-up. On the 2-core VM the README measures on, that left about half of both cores idle
in our Triton server: loading the engine on the stub's main thread, then stepping it on the engine thread, made two
teams of two threads on two CPUs.

So the serving process keeps exactly one team, the stepping thread's:
- :func:`on_short_lived_thread` runs heavy setup (loading and packing the weights) on a thread that exits after,
  and libgomp frees a thread's team when the thread exits (the setup's freed temporaries go back to the OS
  then too: serve/process/heap.py);
- :func:`serial_torch_here` makes a long-lived helper thread (the morph runtime's copy worker) run its torch ops
  without a team of its own.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from serve.process.heap import release_free_heap

T = TypeVar("T")


def on_short_lived_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` run on a new thread that ends when it returns: its OpenMP team goes with it, and the C heap's free
    pages (the setup's temporaries) go back to the OS. Returns what ``fn`` returns and raises what it raises, in
    the caller."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller below
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)  # Ctrl-C during a load does not wait for it
    thread.start()
    thread.join()
    release_free_heap()
    if error:
        raise error[0]
    return result[0]


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime torch loaded (found in /proc/self/maps), or None (another OpenMP runtime or OS)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith("libgomp"):
            return ctypes.CDLL(path)
    return None


def serial_torch_here() -> bool:
    """Run this thread's torch CPU ops without an OpenMP team (the other threads keep theirs). Returns False where
    that cannot be done (torch not on libgomp); the thread then works as before."""
    torch.get_num_threads()  # torch sets a thread's OpenMP thread count on its first op there; ours must come after
    lib = _libgomp()
    if lib is None:
        return False
    lib.omp_set_num_threads(1)  # OpenMP's nthreads-var is per thread: only this one changes
    return torch.get_num_threads() == 1
