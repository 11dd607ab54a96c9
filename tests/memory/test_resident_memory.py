"""Resident memory stays flat under long load: what could grow is bounded, and the soak reports it.

- oneDNN compiles a matmul for every new row count and keeps it (~0.6 MiB, up to 1024 per cache by default);
  importing ``serve`` bounds both of its caches (serve/__init__.py), so new batch shapes stop adding memory
  once the cache is full, while a value exported before the import is kept. Checked in a fresh process
  (oneDNN reads the settings at its first op) by the C heap's bytes in use (glibc's mallinfo2).
- Setup run through ``on_short_lived_thread`` (the engine's load) leaves no freed heap resident behind it, and
  the executor hands the heap's free pages back every ``HEAP_RELEASE_INTERVAL_S`` between batches.
- bench.soak's second-half growth figure and its pass mark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import serve
from bench.soak import RSS_FLAT_MIB, second_half_growth
from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.executor import HEAP_RELEASE_INTERVAL_S
from serve.engine.sampling_params import SamplingParams
from serve.process.heap import release_free_heap
from serve.process.omp_threads import on_short_lived_thread

REPO_ROOT = Path(__file__).resolve().parents[2]
linux_glibc = pytest.mark.skipif(not Path("/proc/self/status").is_file() or not release_free_heap(),
                                 reason="needs Linux /proc and glibc")

# Fill the cache with 2 x capacity new row counts, then measure what 2 x capacity more add.
PROBE = """
import ctypes, json, os, sys
import serve
import torch
from serve.model.linear import onednn_available, onednn_linear

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def in_use():
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd

if not onednn_available():
    print(json.dumps({"skip": "torch has no oneDNN linear"}))
    sys.exit(0)
torch.set_num_threads(1)
n = 2 * serve.ONEDNN_CACHE_CAPACITY
w = torch.randn(64, 64)
for rows in range(3, 3 + n):
    onednn_linear(torch.randn(rows, 64), w)
before = in_use()
for rows in range(3 + n, 3 + 2 * n):
    onednn_linear(torch.randn(rows, 64), w)
print(json.dumps({"growth_mib": (in_use() - before) / 2**20, "new_shapes": n,
                  "env": {k: os.environ.get(k) for k in serve.ONEDNN_CACHE_DEFAULTS}}))
"""


def _probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in serve.ONEDNN_CACHE_DEFAULTS}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True, timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(got["skip"])
    return got


@linux_glibc
def test_importing_serve_bounds_onednn_caches_so_new_batch_shapes_stop_adding_memory() -> None:
    bounded = _probe()
    cap = str(serve.ONEDNN_CACHE_CAPACITY)
    assert bounded["env"] == {"LRU_CACHE_CAPACITY": cap, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": cap}
    # oneDNN's own default (1024), exported by the user: kept, and then every new shape adds its ~0.6 MiB
    unbounded = _probe(LRU_CACHE_CAPACITY="1024", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024")
    assert unbounded["env"] == {"LRU_CACHE_CAPACITY": "1024", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}
    print(f"C heap growth over {bounded['new_shapes']} new row counts once the cache is full: "
          f"bounded {bounded['growth_mib']:.1f} MiB, oneDNN's default {unbounded['growth_mib']:.1f} MiB")
    assert bounded["growth_mib"] < 8
    assert unbounded["growth_mib"] > 10 * max(bounded["growth_mib"], 1.0)


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _churn() -> list[torch.Tensor]:
    """256 MiB of 64 KiB temporaries (glibc's heap, not mmap), every 16th kept: the other 240 MiB are freed as
    holes between live blocks, which free() alone never hands back (a fragmented heap in miniature)."""
    junk = [torch.ones(16384) for _ in range(4096)]
    return junk[::16]


@linux_glibc
def test_setup_on_a_short_lived_thread_leaves_no_freed_heap_resident() -> None:
    held: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: held.append(_churn()))
    t.start()
    t.join()
    plain = _rss_mib()
    release_free_heap()
    left_by_plain_thread = plain - _rss_mib()
    held.append(on_short_lived_thread(_churn, name="setup"))
    short = _rss_mib()
    release_free_heap()
    left_by_short_lived = short - _rss_mib()
    print(f"freed heap left resident: plain thread {left_by_plain_thread:.0f} MiB, "
          f"on_short_lived_thread {left_by_short_lived:.0f} MiB")
    assert left_by_plain_thread > 128  # the churn does leave its temporaries resident without the trim
    assert left_by_short_lived < 16


@linux_glibc
def test_the_executor_hands_the_free_heap_back_between_batches_once_the_interval_has_passed(tiny) -> None:
    engine = LLMEngine(EngineConfig(num_kv_blocks=16, block_size=4, max_model_len=64), loaded=tiny)
    now = [0.0]
    ex = engine.executor
    ex.clock, ex._next_release = (lambda: now[0]), HEAP_RELEASE_INTERVAL_S
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.generate([[1, 2, 3]], params)
    held = [_churn()]  # freed temporaries on the stepping thread's heap, as a step's activations leave them
    before = _rss_mib()
    now[0] = HEAP_RELEASE_INTERVAL_S - 1
    engine.generate([[1, 2, 3]], params)
    assert ex.heap_releases == 0 and _rss_mib() > before - 64  # not due yet: the freed pages stay resident
    now[0] = HEAP_RELEASE_INTERVAL_S
    engine.generate([[1, 2, 3]], params)
    after = _rss_mib()
    print(f"resident memory across the release: {before:.0f} -> {after:.0f} MiB")
    assert ex.heap_releases == 1 and after < before - 128
    engine.generate([[1, 2, 3]], params)
    assert ex.heap_releases == 1  # at most once per interval
    assert held


def test_soak_second_half_growth_and_its_pass_mark() -> None:
    samples = [(0.0, 1000.0), (10.0, 1100.0), (20.0, 1150.0), (30.0, 1160.0), (40.0, 1155.0), (50.0, 1170.0)]
    h = second_half_growth(samples, duration_s=50.0)
    assert (h["from_s"], h["to_s"], h["growth_mib"], h["max_minus_min_mib"]) == (30.0, 50.0, 10.0, 15.0)
    assert h["limit_mib"] == RSS_FLAT_MIB == 16.0 and h["flat"] is True
    rising = second_half_growth(samples + [(60.0, 1200.0)], duration_s=60.0)
    assert (rising["from_s"], rising["growth_mib"], rising["flat"]) == (30.0, 40.0, False)
    assert second_half_growth([(0.0, 1.0), (10.0, 2.0)], duration_s=60.0)["flat"] is None  # too few samples


def test_peers_run_with_their_own_onednn_cache_defaults() -> None:
    from bench.vllm_server import peer_env

    env = peer_env()
    for name in serve.ONEDNN_CACHE_DEFAULTS:
        assert os.environ.get(name) is not None  # ours, set on import (or exported before)
        assert (name in env) == (name in serve.INHERITED_ONEDNN), name
