"""What every end-to-end test module against a real tritonserver shares: skipping when tritonserver is not
installed (failing under CI=true, which installs it), and one server on free loopback ports for the module (stopped
afterwards, with no Python-backend shared-memory segment left behind)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from serve.triton.install import TritonLaunchError, find_triton_install
from serve.triton.server import TritonServer
from tests.ci_skip_policy import skip_outside_ci


def skip_module_without_triton() -> None:
    """Call at module level: skips the whole module when no tritonserver can be found (fails it under CI=true)."""
    try:
        find_triton_install()
    except TritonLaunchError as exc:  # pragma: no cover - nvidia-pytriton is a dependency
        skip_outside_ci(f"tritonserver unavailable: {exc}", allow_module_level=True)


@contextmanager
def running_server(params: dict[str, Any], log_dir: Path, **options: Any) -> Iterator[TritonServer]:
    """A started and ready server with ``params`` (and TritonServer's ``options``); its log is
    ``log_dir``/tritonserver.log."""
    srv = TritonServer(params=params, log_path=log_dir / "tritonserver.log", **options)
    srv.start()
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()
        assert not srv.shm_leftovers(), "the stopped server left shared memory behind"
