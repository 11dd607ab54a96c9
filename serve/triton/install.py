"""Find the tritonserver bundled in the nvidia-pytriton wheel and the environment it needs to run in place.

Why (see ../shared/notes/triton-on-cpu.md for the measurements):
- The binary runs in place inside site-packages (its RPATH is relative); we only build a backends
  folder of our own whose ``python/`` holds symlinks to the Python backend and the 3.11 stub.
- The stub finds ``sys.prefix`` through ``python3`` on PATH, so the venv's bin/ goes first on PATH and
  the model sees the venv's packages (PYTHONPATH alone is ignored).
- The stub links ``libpython3.11.so.1.0``; the base interpreter's LIBDIR goes first on
  LD_LIBRARY_PATH so that the library matches the venv's stdlib (otherwise a system libpython of a
  different patch level fails with ``'_thread.RLock' object has no attribute '_recursion_count'``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PYTHON_STUB_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


class TritonLaunchError(RuntimeError):
    """The server could not be started, exited early, or did not become ready in time."""


@dataclass(frozen=True)
class TritonInstall:
    """Paths inside the nvidia-pytriton wheel."""

    root: Path  # .../site-packages/pytriton/tritonserver
    binary: Path
    python_backend_lib: Path
    python_backend_utils: Path
    python_stub: Path


def find_triton_install(stub_version: str = PYTHON_STUB_VERSION) -> TritonInstall:
    """Find the tritonserver shipped inside the installed ``pytriton`` package.

    Raises TritonLaunchError naming the missing file when the wheel is absent or incomplete.
    """
    try:
        import pytriton  # noqa: PLC0415 - optional dependency, only needed to serve
    except ImportError as e:
        raise TritonLaunchError(
            "the nvidia-pytriton package (which bundles tritonserver) is not installed in this "
            f"interpreter ({sys.executable}); run `make install`"
        ) from e
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    inst = TritonInstall(
        root=root,
        binary=root / "bin" / "tritonserver",
        python_backend_lib=root / "backends" / "python" / "libtriton_python.so",
        python_backend_utils=root / "backends" / "python" / "triton_python_backend_utils.py",
        python_stub=root / "python_backend_stubs" / stub_version / "triton_python_backend_stub",
    )
    for p in (inst.binary, inst.python_backend_lib, inst.python_backend_utils, inst.python_stub):
        if not p.exists():
            raise TritonLaunchError(f"incomplete pytriton install: {p} does not exist")
    return inst


def make_backend_dir(dest: Path, inst: TritonInstall) -> Path:
    """Create ``dest/python/`` with symlinks to the Python backend and the stub; return ``dest``."""
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    for target, name in (
        (inst.python_backend_lib, "libtriton_python.so"),
        (inst.python_backend_utils, "triton_python_backend_utils.py"),
        (inst.python_stub, "triton_python_backend_stub"),
    ):
        link = py / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return dest


def gpu_present() -> bool:
    """Cheap check for an NVIDIA driver with at least one GPU (no torch import, no NVML)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    with contextlib.suppress(OSError):
        if gpus.is_dir() and any(gpus.iterdir()):
            return True
    return False


def server_env(
    python_bin_dir: Path | None = None,
    use_gpu: bool | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for tritonserver: venv bin first on PATH, base LIBDIR first on LD_LIBRARY_PATH,
    and ``CUDA_VISIBLE_DEVICES=`` on hosts without a GPU (unless the caller already set it)."""
    env = dict(os.environ if base is None else base)
    bin_dir = Path(python_bin_dir) if python_bin_dir is not None else Path(sys.prefix) / "bin"
    if not (bin_dir / "python3").exists():
        raise TritonLaunchError(
            f"{bin_dir} has no python3: the Python backend stub finds its sys.prefix through "
            "`python3` on PATH; pass the bin/ folder of the venv that has the project installed"
        )
    env["PATH"] = os.pathsep.join([str(bin_dir), *[p for p in env.get("PATH", "").split(os.pathsep) if p]])
    libdir = sysconfig.get_config_var("LIBDIR")
    ld = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    if libdir:
        ld = [str(libdir), *[p for p in ld if p != str(libdir)]]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(ld)
    if use_gpu is None:
        use_gpu = gpu_present()
    if not use_gpu and "CUDA_VISIBLE_DEVICES" not in (base or os.environ):
        env["CUDA_VISIBLE_DEVICES"] = ""
    # The model must see the project even when started from elsewhere: editable installs cover this,
    # a plain checkout relies on the working directory, which we set to the repository root.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
