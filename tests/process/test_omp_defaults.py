"""The OpenMP defaults importing ``serve`` sets (serve/__init__.py): applied before torch loads its OpenMP runtime,
never over a policy the user exported, and taken back out of the environment peers run in (bench.peer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, os, sys
import serve
import torch
from bench.vllm_server import peer_env, vllm_env
keys = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
print(json.dumps({"ours": {k: os.environ.get(k) for k in keys}, "peer": {k: peer_env().get(k) for k in keys},
                  "vllm": {k: vllm_env(2).get(k) for k in keys}}))
"""


def _probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_serve_sets_a_bounded_active_wait_and_peers_get_their_own_defaults() -> None:
    got = _probe()
    assert got["ours"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "200000"}
    assert got["peer"] == got["vllm"] == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}


def test_an_exported_wait_policy_is_kept_for_us_and_for_peers() -> None:
    got = _probe(OMP_WAIT_POLICY="PASSIVE")
    assert got["ours"] == got["peer"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
    got = _probe(OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT="5")
    assert got["ours"] == got["peer"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "5"}


ORDER_PROBE = """
import importlib, json, sys
order = []

class Recorder:
    def find_spec(self, name, path, target=None):
        if name in ("serve", "torch"):
            order.append(name)
        return None

sys.meta_path.insert(0, Recorder())
importlib.import_module(sys.argv[1])
print(json.dumps(order))
"""


@pytest.mark.parametrize("module", ["bench.peer", "bench.quant_kernels", "serve.generate", "serve.triton.server"])
def test_entry_points_import_the_package_before_torch(module: str) -> None:
    """libgomp reads the policy once, when torch loads it, so ``serve`` must come first: packages run with
    ``-m`` import their __init__ before the module's own imports (bench/__init__.py imports serve)."""
    out = subprocess.run([sys.executable, "-c", ORDER_PROBE, module], cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True, timeout=120)
    order = json.loads(out.stdout.strip().splitlines()[-1])
    assert order and order[0] == "serve", order
