"""Start the tritonserver bundled in the nvidia-pytriton wheel on a model repository, on 127.0.0.1 only.

Usable from Python::

    with TritonServer(model_repository="triton_models", params={"engine_dir": "engines/x"}) as srv:
        srv.wait_ready(timeout=120)
        ...  # srv.http_url, srv.grpc_url, srv.metrics_url

and from a shell: ``python -m serve.triton_launcher --help``.

Why the set-up below (see /work/shared/notes/triton-on-cpu.md for the measurements):
- The binary runs in place inside site-packages (its RPATH is relative); we only build a backends
  folder of our own whose ``python/`` holds symlinks to the Python backend and the 3.11 stub.
- The stub finds ``sys.prefix`` through ``python3`` on PATH, so the venv's bin/ goes first on PATH and
  the model sees the venv's packages (PYTHONPATH alone is ignored).
- The stub links ``libpython3.11.so.1.0``; the base interpreter's LIBDIR goes first on
  LD_LIBRARY_PATH so that the library matches the venv's stdlib (otherwise a system libpython of a
  different patch level fails with ``'_thread.RLock' object has no attribute '_recursion_count'``).
- Model parameters (engine directory, limits, ...) live in config.pbtxt; overrides are applied by
  rendering a copy of the model's config.pbtxt into a private repository whose version folders are
  symlinks to the originals, so the source tree is never modified.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

from serve.logging_setup import configure_logging, get_logger

LOOPBACK = "127.0.0.1"
DEFAULT_MODEL_NAME = "morphserve"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "triton_models"
PYTHON_STUB_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"

log = get_logger("triton_launcher")


class TritonLaunchError(RuntimeError):
    """The server could not be started, exited early, or did not become ready in time."""


# --------------------------------------------------------------------------------------------------
# Locating the bundled server
# --------------------------------------------------------------------------------------------------


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


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------------------------
# config.pbtxt parameters
# --------------------------------------------------------------------------------------------------

_PARAM_RE = re.compile(
    r'(key\s*:\s*"(?P<key>[^"]+)"\s*value\s*:\s*\{\s*string_value\s*:\s*")(?P<value>(?:[^"\\]|\\.)*)(")',
    re.MULTILINE,
)


def read_config_parameters(config_text: str) -> dict[str, str]:
    """The ``parameters { key: "..." value: { string_value: "..." } }`` entries of a config.pbtxt."""
    return {m.group("key"): _unescape(m.group("value")) for m in _PARAM_RE.finditer(config_text)}


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"')


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", r"\1", v)


def fill_config_parameters(config_text: str, overrides: Mapping[str, object]) -> str:
    """Return ``config_text`` with the string values of the named parameters replaced.

    Only parameters already declared in the config can be overridden, so that a typo (``max_num_seq``)
    fails loudly instead of being silently ignored by the model.
    """
    known = read_config_parameters(config_text)
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise TritonLaunchError(f"unknown model parameter(s) {unknown}; the model declares {sorted(known)}")
    values = {k: _param_str(v) for k, v in overrides.items()}

    def sub(m: re.Match[str]) -> str:
        key = m.group("key")
        if key not in values:
            return m.group(0)
        return m.group(1) + _escape(values[key]) + m.group(4)

    return _PARAM_RE.sub(sub, config_text)


def _param_str(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    return str(v)


def render_model_repository(src: Path, dest: Path, model_name: str, overrides: Mapping[str, object]) -> Path:
    """Make ``dest/<model_name>`` a copy of ``src/<model_name>`` with parameter overrides applied.

    Only config.pbtxt is written; everything else (version folders, model.py) is symlinked so the
    server runs the source tree's code.
    """
    src_model = src / model_name
    cfg = src_model / "config.pbtxt"
    if not cfg.is_file():
        raise TritonLaunchError(f"{cfg} does not exist (model repository {src}, model {model_name!r})")
    out = dest / model_name
    out.mkdir(parents=True, exist_ok=True)
    for entry in src_model.iterdir():
        if entry.name == "config.pbtxt" or entry.name.startswith(".") or entry.name == "__pycache__":
            continue
        link = out / entry.name
        if not link.exists():
            link.symlink_to(entry.resolve())
    (out / "config.pbtxt").write_text(fill_config_parameters(cfg.read_text(), overrides))
    return dest


# --------------------------------------------------------------------------------------------------
# The server process
# --------------------------------------------------------------------------------------------------


def _set_parent_death_signal() -> None:
    """preexec_fn: make the kernel SIGTERM tritonserver if the launching process dies (Linux only).

    This keeps a killed test run or launcher from leaving a server bound to its ports.
    """
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class TritonServer:
    """A tritonserver process serving one model from a repository, bound to 127.0.0.1.

    Ports default to free ones picked at construction. ``params`` override the model's config.pbtxt
    parameters. The server's stdout/stderr (Triton's log and the model's JSON log lines) go to
    ``log_path`` (a file in the private work directory unless given). stop() deletes the private
    work directory, keeping its log only when ``keep_log`` is set or the server exited with an error.
    ``die_with_parent`` asks the kernel to SIGTERM the server if the creating thread's process dies.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike[str] = DEFAULT_MODEL_REPOSITORY,
        model_name: str = DEFAULT_MODEL_NAME,
        *,
        params: Mapping[str, object] | None = None,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        log_verbose: int = 0,
        exit_timeout_s: int = 5,
        python_bin_dir: str | os.PathLike[str] | None = None,
        use_gpu: bool | None = None,
        extra_args: Sequence[str] = (),
        workdir: str | os.PathLike[str] | None = None,
        die_with_parent: bool = True,
        keep_log: bool = False,
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        self.model_name = model_name
        self.params = dict(params or {})
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        if len({self.http_port, self.grpc_port, self.metrics_port}) != 3:
            raise TritonLaunchError(
                f"HTTP, gRPC and metrics ports must differ, got {self.http_port}, {self.grpc_port}, {self.metrics_port}"
            )
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.python_bin_dir = Path(python_bin_dir) if python_bin_dir else None
        self.use_gpu = gpu_present() if use_gpu is None else use_gpu
        self.extra_args = list(extra_args)
        self.die_with_parent = die_with_parent
        self.keep_log = keep_log
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="morphserve-triton-"))
        self.log_path = Path(log_path) if log_path else self.workdir / "tritonserver.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: object | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None

    # -- URLs ------------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """host:port for tritonclient.http and curl."""
        return f"{LOOPBACK}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:port for tritonclient.grpc."""
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """Full URL of the Prometheus text endpoint."""
        return f"http://{LOOPBACK}:{self.metrics_port}/metrics"

    # -- command ---------------------------------------------------------------------------------
    def command(self, inst: TritonInstall, backend_dir: Path, repository: Path) -> list[str]:
        """The tritonserver command line (flags as verified in the triton-on-cpu note)."""
        cmd = [
            str(inst.binary),
            f"--model-repository={repository}",
            f"--backend-directory={backend_dir}",
            "--model-control-mode=explicit",
            f"--load-model={self.model_name}",
            "--disable-auto-complete-config",
            "--strict-readiness=true",
            f"--http-address={LOOPBACK}",
            f"--http-port={self.http_port}",
            f"--grpc-address={LOOPBACK}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={LOOPBACK}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--allow-cpu-metrics=true",
            f"--allow-gpu-metrics={'true' if self.use_gpu else 'false'}",
            "--metrics-interval-ms=1000",
            "--backend-config=python,shm-default-byte-size=4194304",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
        ]
        if not self.use_gpu:
            cmd += ["--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0"]
        return cmd + self.extra_args

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> TritonServer:
        """Spawn tritonserver (does not wait for readiness; see wait_ready)."""
        if self.proc is not None and self.proc.poll() is None:
            raise TritonLaunchError("server already running")
        inst = find_triton_install()
        if not (self.model_repository / self.model_name / "config.pbtxt").is_file():
            raise TritonLaunchError(
                f"no {self.model_name}/config.pbtxt in model repository {self.model_repository}"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        backend_dir = make_backend_dir(self.workdir / "backends", inst)
        repository = self.model_repository
        if self.params:
            repository = render_model_repository(
                self.model_repository, self.workdir / "model_repository", self.model_name, self.params
            )
        env = server_env(self.python_bin_dir, self.use_gpu)
        cmd = self.command(inst, backend_dir, repository)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - closed in stop()
        log.info(
            "tritonserver_starting",
            model=self.model_name,
            repository=str(repository),
            http_port=self.http_port,
            grpc_port=self.grpc_port,
            metrics_port=self.metrics_port,
            params=self.params,
            log_path=str(self.log_path),
        )
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(  # noqa: S603 - fixed binary, no shell
            cmd,
            cwd=str(REPO_ROOT),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, not the server; we stop it.
            preexec_fn=_set_parent_death_signal if self.die_with_parent else None,  # noqa: PLW1509
        )
        return self

    def log_tail(self, n_lines: int = 40) -> str:
        """The last lines of the server log (for error messages)."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no server log)"
        lines = data.decode("utf-8", errors="replace").splitlines()
        return "\n".join(lines[-n_lines:])

    def error_summary(self, max_lines: int = 6) -> str:
        """Triton's error lines from the log (``E....`` records and ``error: ...``), minus known CPU noise."""
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        noise = ("CudaDriverHelper", "pinned memory", "Pinned memory", "GPU metrics")
        errors = [ln.strip() for ln in lines
                  if (re.match(r"^E\d{4} ", ln) or ln.startswith("error:")) and not any(n in ln for n in noise)]
        return "\n".join(errors[-max_lines:])

    def _failure(self, what: str) -> TritonLaunchError:
        summary = self.error_summary()
        head = f"{what}: {summary}" if summary else what
        return TritonLaunchError(f"{head}\n--- last lines of {self.log_path} ---\n{self.log_tail()}")

    def _get(self, url: str, timeout: float = 2.0) -> int:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback http only
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except (urllib.error.URLError, OSError):
            return 0

    def is_ready(self) -> bool:
        """Server ready and the model ready (one pair of HTTP probes)."""
        base = f"http://{self.http_url}"
        return (
            self._get(f"{base}/v2/health/ready") == 200
            and self._get(f"{base}/v2/models/{self.model_name}/ready") == 200
        )

    def wait_ready(self, timeout: float = 180.0, poll_s: float = 0.1) -> float:
        """Block until the server and the model report ready; return seconds since start().

        Raises TritonLaunchError with the tail of the server log when the process exits first or the
        timeout passes (in the latter case the server is left running; call stop()).
        """
        if self.proc is None or self.started_at is None:
            raise TritonLaunchError("wait_ready() before start()")
        deadline = time.monotonic() + timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise self._failure(f"tritonserver exited with code {rc} before becoming ready")
            if self.is_ready():
                self.ready_after_s = time.monotonic() - self.started_at
                log.info("tritonserver_ready", model=self.model_name, ready_after_s=round(self.ready_after_s, 3))
                return self.ready_after_s
            if time.monotonic() > deadline:
                raise self._failure(f"tritonserver not ready after {timeout:.0f} s")
            time.sleep(poll_s)

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM, wait ``grace_s`` (default exit timeout + 10 s), then SIGKILL the whole process group
        (the server and its Python-backend stubs). Returns the exit code; safe to call twice."""
        proc = self.proc
        rc: int | None = None
        if proc is not None:
            grace = self.exit_timeout_s + 10.0 if grace_s is None else grace_s
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    log.warning("tritonserver_kill", pid=proc.pid, grace_s=grace)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            # Stubs normally exit with the server; make sure none outlives it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.returncode
            log.info("tritonserver_stopped", model=self.model_name, returncode=rc)
        if self._log_file is not None:
            with contextlib.suppress(OSError):
                self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None
        if self._own_workdir:
            log_inside = self.workdir.resolve() in self.log_path.resolve().parents
            if not log_inside or (rc in (0, None) and not self.keep_log):
                shutil.rmtree(self.workdir, ignore_errors=True)
            else:
                # Keep the log (asked for, or the server failed); drop the rest.
                for sub in ("backends", "model_repository"):
                    shutil.rmtree(self.workdir / sub, ignore_errors=True)
        self.proc = None
        return rc

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

# Convenience flags that map to config.pbtxt parameters (anything else: --param KEY=VALUE).
_PARAM_FLAGS: dict[str, tuple[str, type, str]] = {
    "morph_mode": ("--morph-mode", str, "layer-morphing mode of the engine"),
    "device_memory": ("--device-memory", str, "device memory budget, e.g. 600MiB or 2GiB"),
    "max_num_seqs": ("--max-num-seqs", int, "most sequences in one batch"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", int, "token budget of one engine step"),
    "max_tokens_limit": ("--max-tokens-limit", int, "largest max_tokens a request may ask for"),
    "slo_ttft_s": ("--slo-ttft-s", float, "TTFT service-level objective in seconds"),
}


def _env_port(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a port number") from None


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m serve.triton_launcher",
        description=(
            "Serve the MorphServe model with the tritonserver bundled in nvidia-pytriton, on 127.0.0.1 "
            "only. Prints one line when the model is ready (with a curl example) and shuts the server "
            "down cleanly on Ctrl-C or SIGTERM. Triton's log and the model's JSON log lines go to "
            "--server-log."
        ),
        epilog=(
            "Endpoints: HTTP POST /v2/models/morphserve/generate and /generate_stream (JSON keys: "
            "text_input, max_tokens, temperature, top_p, top_k, seed, stop, stream); gRPC streaming "
            "(python -m serve.client); Prometheus text on the metrics port (/metrics, morphserve_* "
            "and nv_* families). Ports default to $HTTP_PORT, $GRPC_PORT, $METRICS_PORT, then "
            "8000/8001/8002; 0 picks a free port."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY, help="Triton model repository")
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help="model to load from the repository")
    p.add_argument(
        "--engine-dir",
        default=None,
        help="engine directory, GGUF file, HF directory, or 'smollm2-135m' (embedded default); "
        "overrides the engine_dir parameter of config.pbtxt",
    )
    p.add_argument("--http-port", type=int, default=_env_port("HTTP_PORT", 8000), help="HTTP port")
    p.add_argument("--grpc-port", type=int, default=_env_port("GRPC_PORT", 8001), help="gRPC port")
    p.add_argument("--metrics-port", type=int, default=_env_port("METRICS_PORT", 8002), help="metrics port")
    for key, (flag, typ, help_) in _PARAM_FLAGS.items():
        p.add_argument(flag, dest=key, type=typ, default=None, help=f"{help_} (parameter {key})")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any other config.pbtxt parameter (repeatable), e.g. --param max_model_len=2048",
    )
    p.add_argument("--server-log", type=Path, default=None, help="file for the server's output (default: a temp file)")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.add_argument("--log-level", default="warning", help="level of the launcher's own JSON log on stderr (info adds start/stop events)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the model to load")
    p.add_argument(
        "--gpu",
        choices=["auto", "yes", "no"],
        default="auto",
        help="'no' hides GPUs (CUDA_VISIBLE_DEVICES=) and disables GPU metrics and CUDA pools",
    )
    p.add_argument(
        "extra",
        nargs=argparse.REMAINDER,
        help="after `--`: extra tritonserver flags passed through verbatim",
    )
    return p


def params_from_args(args: argparse.Namespace) -> dict[str, object]:
    """config.pbtxt overrides gathered from the CLI flags."""
    params: dict[str, object] = {}
    if args.engine_dir is not None:
        params["engine_dir"] = args.engine_dir
    for key in _PARAM_FLAGS:
        v = getattr(args, key)
        if v is not None:
            params[key] = v
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--param expects KEY=VALUE, got {item!r}")
        params[key.strip()] = value
    return params


def curl_example(srv: TritonServer) -> str:
    """A one-line curl command that exercises the generate endpoint."""
    body = json.dumps({"text_input": "The capital of France is", "max_tokens": 16})
    return f"curl -s -X POST http://{srv.http_url}/v2/models/{srv.model_name}/generate -d '{body}'"


class _Terminate(Exception):
    """Raised from the SIGTERM handler to unwind the CLI's wait loop."""


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    extra = [a for a in args.extra if a != "--"]
    params = params_from_args(args)
    srv = TritonServer(
        args.model_repository,
        args.model_name,
        params=params,
        http_port=args.http_port or None,
        grpc_port=args.grpc_port or None,
        metrics_port=args.metrics_port or None,
        log_path=args.server_log,
        log_verbose=args.log_verbose,
        use_gpu={"auto": None, "yes": True, "no": False}[args.gpu],
        extra_args=extra,
        keep_log=True,
    )

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise _Terminate

    def on_second_signal(signum: int, frame: FrameType | None) -> None:
        # A second Ctrl-C / SIGTERM while shutting down: do not wait for Triton's exit timeout.
        if srv.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(srv.proc.pid, signal.SIGKILL)
        os._exit(130)

    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        srv.start()
        ready_s = srv.wait_ready(timeout=args.ready_timeout)
        sys.stdout.write(
            f"morphserve ready in {ready_s:.1f}s: http={srv.http_url} grpc={srv.grpc_url} "
            f"metrics={srv.metrics_url} log={srv.log_path} | try: {curl_example(srv)}\n"
        )
        sys.stdout.flush()
        assert srv.proc is not None
        while True:
            rc = srv.proc.poll()
            if rc is not None:
                log.error("tritonserver_exited", returncode=rc, log_tail=srv.log_tail(20))
                return rc or 1
            time.sleep(0.5)
    except TritonLaunchError as e:
        log.error("tritonserver_failed", error=str(e).splitlines()[0], log_path=str(srv.log_path))
        sys.stderr.write(f"morphserve failed to start: {e}\n")
        return 1
    except (KeyboardInterrupt, _Terminate):
        log.info("shutdown_requested")
        return 0
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, on_second_signal)
            signal.signal(signal.SIGINT, on_second_signal)
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
