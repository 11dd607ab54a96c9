"""A measurement that knows when it measured badly: with a planted busy loop beside it (two CPU-burning processes on
this machine), the host-load reading says others took the CPUs, the step costs' verdict refuses the table with that
reason, and ``python -m builder.step_costs`` stores neither the table nor the kernel crossovers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from serve.process.host_load import HostLoad

BURN = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end: pass\n"


@contextmanager
def busy_loop() -> Iterator[None]:
    """One CPU-burning process per CPU, for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)  # running before the measurement starts
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_host_load_sees_other_processes() -> None:
    with busy_loop(), HostLoad() as load:
        time.sleep(1.0)
    assert load.known and load.other_share > 0.5, load.other_share


def test_a_busy_host_makes_the_step_costs_untrusted(tiny) -> None:
    from serve.model.llama import LlamaModel
    from serve.model.step_costs import measure_checked

    model = LlamaModel(tiny.config, tiny.weights, device=torch.device("cpu"), dtype=torch.float32, max_positions=64)
    layers = {"full": model.layers[0]}
    shape = (tiny.config.hidden_size, tiny.config.q_size, tiny.config.intermediate_size)
    with busy_loop():
        costs, conditions, verdict = measure_checked(layers, shape, torch.device("cpu"), torch.float32, repeats=3)
    assert not verdict.trusted and any("other processes" in r for r in verdict.reasons), verdict
    assert (costs.meta["trusted"] is False
            and costs.meta["conditions"]["other_share"] == round(conditions.other_share, 4))


@pytest.mark.slow
def test_the_builder_stores_nothing_measured_beside_a_busy_loop(tiny_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "MORPHSERVE_CACHE_DIR": str(cache)}
    with busy_loop():
        proc = subprocess.run([sys.executable, "-m", "builder.step_costs", "--model", str(tiny_dir), "--force",
                               "--attempts", "2", "--pause", "0", "--repeats", "3", "--strict"],
                              capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "NOT STORED" in proc.stdout and "other processes used" in proc.stdout
    for name in ("step_costs.json", "kernel_crossovers.json"):
        stored = cache / name
        assert not stored.exists() or json.loads(stored.read_text()) == {}, name
