"""One OpenMP team per serving process (serve/process/omp_threads.py): loading leaves no team behind, the stepping
thread has the only one, and the morph runtime's copy worker runs its torch ops without one. Threads are counted
in /proc, so these tests see the real libgomp workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from serve.process.omp_threads import _libgomp, on_short_lived_thread, serial_torch_here
from tests.morph_support import morph

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir() or _libgomp() is None,
                                reason="needs Linux /proc and torch on GNU OpenMP")

# A fresh process, so that no earlier test has given the calling thread a team already.
PROBE = """
import json, os, threading, time
import serve
import torch
from serve.config import EngineConfig
from serve.engine import LLMEngine, SamplingParams

def tasks():
    return len(os.listdir("/proc/self/task"))

def settled(want, timeout=10.0):
    # libgomp's workers leave shortly after the thread that owned them
    end = time.monotonic() + timeout
    while tasks() != want and time.monotonic() < end:
        time.sleep(0.05)
    return tasks()

torch.set_num_threads(2)  # torch starts its own helper pool here, before counting
before = tasks()
engine = LLMEngine(EngineConfig(model="smollm2-135m", num_threads=2))
after_build = settled(before)
engine.start_background()
done = threading.Event()
engine.add_request("The capital of France is", SamplingParams(max_tokens=8, ignore_eos=True),
                   callback=lambda out: out.finished and done.set())
assert done.wait(120)
after_serving = settled(before + 2)
print(json.dumps({"before": before, "after_build": after_build, "after_serving": after_serving}))
"""


def test_loading_leaves_no_team_and_the_stepping_thread_has_the_only_one() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after_build"] == got["before"], "loading the engine left an OpenMP team in the caller's process"
    # serving adds the engine thread and the one worker of its team (2 threads), nothing else
    assert got["after_serving"] == got["before"] + 2


def test_the_swap_workers_torch_ops_start_no_team(tiny) -> None:
    from tests.morph.test_morph import morph_engine

    engine = morph_engine(tiny, "performance")
    workers = morph(engine).bank._workers
    here = torch.get_num_threads()
    assert workers.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == here  # only the worker's own thread count changed
    src, dst = torch.randn(4_000_000), torch.empty(4_000_000)  # far above torch's grain size: a parallel copy
    threads = len(os.listdir("/proc/self/task"))
    workers.submit(dst.copy_, src).result()
    assert len(os.listdir("/proc/self/task")) == threads
    assert torch.equal(dst, src)


def test_serial_torch_here_applies_to_its_own_thread_only() -> None:
    seen: dict[str, int | bool] = {}
    here = torch.get_num_threads()

    def worker() -> None:
        seen["ok"] = serial_torch_here()
        seen["worker"] = torch.get_num_threads()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"ok": True, "worker": 1}
    assert torch.get_num_threads() == here


def test_on_short_lived_thread_returns_and_raises_in_the_caller() -> None:
    caller = threading.get_ident()
    assert on_short_lived_thread(threading.get_ident, name="t") != caller
    with pytest.raises(KeyError, match="missing"):
        on_short_lived_thread(lambda: {}["missing"], name="t")
