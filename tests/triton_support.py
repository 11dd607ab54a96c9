"""What every end-to-end test module against a real tritonserver shares: skipping when tritonserver is not
installed, and one server on free loopback ports for the module (stopped afterwards, with no Python-backend
shared-memory segment left behind)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from serve.triton.install import TritonLaunchError, find_triton_install
from serve.triton.server import TritonServer


def skip_module_without_triton() -> None:
    """Call at module level: skips the whole module when no tritonserver can be found."""
    try:
        find_triton_install()
    except TritonLaunchError as exc:  # pragma: no cover - the wheel is a dev dependency
        pytest.skip(f"tritonserver unavailable: {exc}", allow_module_level=True)


@contextmanager
def running_server(params: dict[str, Any], log_dir: Path) -> Iterator[TritonServer]:
    """A started and ready server with ``params``; its log is ``log_dir``/tritonserver.log."""
    srv = TritonServer(params=params, log_path=log_dir / "tritonserver.log")
    srv.start()
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()
        assert not srv.shm_leftovers(), "the stopped server left shared memory behind"
