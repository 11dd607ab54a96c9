"""Start the tritonserver bundled in the nvidia-pytriton wheel on a model repository, on 127.0.0.1 only:
``with TritonServer(params={"engine_dir": "engines/x"}) as srv: srv.wait_ready()`` (then ``srv.http_url``,
``grpc_url``, ``metrics_url``), or from a shell ``python -m serve.triton --help``.

How the bundled binary is made to run in place: serve/triton/install.py; how parameters reach the
model (a rendered private copy of config.pbtxt): serve/triton/repository.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from serve.logging_setup import get_logger
from serve.triton.client_apis import open_apis, triton_restrictions
from serve.triton.front_ends import FrontEnds
from serve.triton.grpc_front import DEFAULT_MAX_MESSAGE_BYTES
from serve.triton.http_front import FrontOptions
from serve.triton.install import (
    TritonInstall,
    TritonLaunchError,
    find_triton_install,
    gpu_present,
    make_backend_dir,
    server_env,
)
from serve.triton.llmapi_config import BlsSettings
from serve.triton.operator_port import post_control
from serve.triton.repository import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_REPOSITORY,
    FRONT_MODEL_NAMES,
    REPO_ROOT,
    read_config_parameters,
    render_model_repository,
)
from serve.triton.stale import end_stale, mark, wait_group_gone

LOOPBACK = "127.0.0.1"


log = get_logger("triton_launcher")


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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

    Secure by default (docs/hardening.md): clients reach inference, health, metadata and statistics only
    (serve/triton/client_apis.py; ``client_apis`` opens shared-memory, logging or trace); the model repository
    is closed (``--model-control-mode=none``) unless ``repository_api=True`` (explicit mode: any local process
    can then load a Python model that runs as this user). Ports busy before start fail at once.
    ``exit_timeout_s`` is how long tritonserver drains in-flight requests after SIGTERM.

    ``http_port`` and ``grpc_port`` are the project's front ends (serve/triton/front_ends.py: bounded bodies and
    messages, typed inputs, closed APIs; ``front_options``, ``grpc_max_message_bytes`` set their limits); tritonserver's
    own servers listen on internal loopback ports behind them (``http_front`` / ``grpc_front=False``: Triton's own).

    ``operator_port`` (a free one by default) is where the model serves the operator's controls (memory yield,
    drain; serve/triton/operator_port.py), loopback only, when its config.pbtxt declares an ``operator_port``
    parameter; ``drain()`` asks the engine there to admit nothing new.
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
        also_load: Sequence[str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        repository_api: bool = False,
        http_front: bool = True,
        front_options: FrontOptions | None = None,
        triton_http_port: int | None = None,
        operator_port: int | None = None,
        grpc_front: bool = True,
        client_apis: Sequence[str] = (),
        grpc_max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        llmapi: BlsSettings | None = None,
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        self.model_name = model_name
        self.params = dict(params or {})
        # Models loaded beside model_name: by default TensorRT-LLM's names (BLS models over the engine
        # model) when the repository has them and the engine model is the default one.
        self.llmapi = llmapi  # the tensorrt_llm model's own settings over its model.yaml's (None: as written)
        if also_load is None:
            also_load = [n for n in FRONT_MODEL_NAMES if model_name == DEFAULT_MODEL_NAME
                         and (self.model_repository / n / "config.pbtxt").is_file()]
        self.also_load = [n for n in also_load if n != model_name]
        self.cwd = Path(cwd) if cwd is not None else REPO_ROOT  # the server's working directory
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.opened = open_apis(tuple(client_apis), repository_api)
        self.front_ends = FrontEnds(self.http_port, self.grpc_port, (triton_http_port or free_port()) if http_front
                           else self.http_port, free_port() if grpc_front else self.grpc_port, http_front, grpc_front,
                           front_options, self.opened, grpc_max_message_bytes)
        self.triton_http_port, self.http_front = self.front_ends.triton_http_port, http_front
        cfg = self.model_repository / model_name / "config.pbtxt"
        declared = cfg.is_file() and "operator_port" in read_config_parameters(cfg.read_text())
        given = str(self.params.get("operator_port", "")).strip()
        self.operator_port: int | None = (int(given) or None) if declared and given else None  # given 0: none
        if declared and not given:
            self.operator_port = self.params["operator_port"] = operator_port or free_port()
        if len({self.http_port, self.grpc_port, self.metrics_port, *self.front_ends.internal_ports()}) != \
                3 + http_front + grpc_front:
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
        self.repository_api = repository_api
        self._restrict_key = f"morphserve-{secrets.token_hex(16)}"
        self.shm_prefix = f"morphserve_{secrets.token_hex(6)}_"
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
    def triton_http_url(self) -> str:
        """host:port of tritonserver's own HTTP server (internal, behind the front end; = http_url without it)."""
        return f"{LOOPBACK}:{self.triton_http_port}"

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
            *self._repository_flags(),
            "--disable-auto-complete-config",
            "--strict-readiness=true",
            f"--http-address={LOOPBACK}",
            f"--http-port={self.triton_http_port}",
            f"--grpc-address={LOOPBACK}",
            f"--grpc-port={self.front_ends.triton_grpc_port}",
            f"--metrics-address={LOOPBACK}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--allow-cpu-metrics=true",
            f"--allow-gpu-metrics={'true' if self.use_gpu else 'false'}",
            "--metrics-interval-ms=1000",
            "--backend-config=python,shm-default-byte-size=4194304",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
        ]
        if not self.use_gpu:
            cmd += ["--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0"]
        return cmd + self.extra_args

    def _repository_flags(self) -> list[str]:
        """Model-control flags (closed by default, explicit when asked for) and, on tritonserver's own ports, every
        API closed to clients restricted to a random header value nobody is told."""
        control = (["--model-control-mode=explicit", f"--load-model={self.model_name}",
                    *[f"--load-model={name}" for name in self.also_load]] if self.repository_api
                   else ["--model-control-mode=none"])
        return control + triton_restrictions(self.opened, self._restrict_key, secrets.token_hex(16))

    def busy_ports(self) -> list[int]:
        """Which of this server's ports cannot be bound on 127.0.0.1 right now."""
        busy = []
        ports = [self.http_port, self.grpc_port, self.metrics_port, *self.front_ends.internal_ports()]
        if self.operator_port is not None:
            ports.append(self.operator_port)
        for port in self.front_ends.running_ports():  # the front ends keep their ports across restarts of tritonserver
            ports.remove(port)
        for port in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "busy"
                try:
                    s.bind((LOOPBACK, port))
                except OSError:
                    busy.append(port)
        return busy

    def shm_leftovers(self) -> list[Path]:
        """Python-backend shared-memory segments of this server still in /dev/shm."""
        return sorted(Path("/dev/shm").glob(f"{self.shm_prefix}*"))

    def _remove_shm(self) -> None:
        for seg in self.shm_leftovers():
            with contextlib.suppress(OSError):
                seg.unlink()
                log.info("shm_segment_removed", path=str(seg))

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> TritonServer:
        """Spawn tritonserver (does not wait for readiness; see wait_ready)."""
        if self.proc is not None and self.proc.poll() is None:
            raise TritonLaunchError("server already running")
        inst = find_triton_install()
        busy = self.busy_ports()
        if busy:
            raise TritonLaunchError(
                f"port(s) {busy} on {LOOPBACK} already in use (another server?); pick free ports"
            )
        if not (self.model_repository / self.model_name / "config.pbtxt").is_file():
            raise TritonLaunchError(
                f"no {self.model_name}/config.pbtxt in model repository {self.model_repository}"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        backend_dir = make_backend_dir(self.workdir / "backends", inst)
        repository = self.model_repository
        if self.params or not self.repository_api:  # control mode none loads all it finds: render exactly ours
            repository = render_model_repository(
                self.model_repository, self.workdir / "model_repository", self.model_name, self.params,
                also=tuple(self.also_load), llmapi=self.llmapi,
            )
        ended = end_stale(self.model_repository)  # model processes a killed launcher of this repository left
        if ended:
            log.warning("stale_processes_ended", pids=ended, repository=str(self.model_repository))
        env = mark(server_env(self.python_bin_dir, self.use_gpu), self.model_repository)
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
            shm_prefix=self.shm_prefix,  # the Python backend's /dev/shm segments of this server (none may outlive it)
        )
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(  # noqa: S603 - fixed binary, no shell
            cmd,
            cwd=str(self.cwd),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, not the server; we stop it.
            preexec_fn=_set_parent_death_signal if self.die_with_parent else None,  # noqa: PLW1509
        )
        try:
            self.front_ends.start()
        except OSError as e:
            self.stop()
            raise TritonLaunchError(str(e)) from None
        return self

    def drain(self) -> None:
        """Refuse new requests (503) and report not ready on the HTTP front end, and tell the engine to admit nothing
        new (gRPC clients get 503 draining too); in-flight requests go on."""
        if self.front_ends.drain():
            log.info("draining", http_port=self.http_port)
        if self.operator_port is not None and self.proc is not None and self.proc.poll() is None:
            try:
                post_control(self.operator_port, "drain", timeout=5.0)
            except (OSError, ValueError) as e:  # the model is not up (or never bound its port): nothing to drain
                log.warning("engine_drain_failed", operator_port=self.operator_port, error=str(e))

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
        base = f"http://{self.triton_http_url}"
        if (self.front_ends.http and self.front_ends.http_front is None) or (self.front_ends.grpc
                                                                             and self.front_ends.grpc_front is None):
            return False
        return self._get(f"{base}/v2/health/ready") == 200 and all(
            self._get(f"{base}/v2/models/{name}/ready") == 200 for name in (self.model_name, *self.also_load))

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

    def stop(self, grace_s: float | None = None, keep_front: bool = False) -> int | None:
        """SIGTERM, wait ``grace_s`` (default exit timeout + 10 s), then SIGKILL the whole process group
        (the server and its Python-backend stubs), then close the HTTP front end unless ``keep_front`` (the
        supervisor keeps it between restarts: clients get 503 "restarting" instead of a refused
        connection). Returns the exit code; safe to call twice."""
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
            # Stubs normally exit with the server; make sure none outlives it, and that all are gone before a restart.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if left := wait_group_gone(proc.pid):
                log.error("tritonserver_processes_left", pids=left)
            rc = proc.returncode
            self._remove_shm()  # left behind when the server or a stub was killed
            log.info("tritonserver_stopped", model=self.model_name, returncode=rc)
        if not keep_front:
            self.front_ends.stop()
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

