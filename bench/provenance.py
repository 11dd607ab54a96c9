"""What a benchmark result ran on, written by the tool into its own JSON (not added by hand afterwards): the
command line, the commit of the checkout (with ``-dirty`` when it has uncommitted changes), the CPU as the step
costs name it (model and ISA, cores), and the UTC time span of the run."""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from serve.model.step_costs import device_name

REPO_ROOT = Path(__file__).resolve().parents[1]


def commit() -> str | None:
    """The checkout's commit (short), ``-dirty`` when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def provenance(module: str, argv: Sequence[str], started: float, ended: float) -> dict[str, Any]:
    """The fields a tool adds to its result: ``command``, ``commit``, ``cpu``, ``started_utc``, ``ended_utc``."""
    return {"command": shlex.join(["python", "-m", module, *argv]), "commit": commit(),
            "cpu": device_name(torch.device("cpu")), "started_utc": utc(started), "ended_utc": utc(ended)}
