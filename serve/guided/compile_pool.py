"""The engine's side of the grammar compile worker (serve/guided/compile_worker.py): a bounded queue of compile jobs,
at most ``workers`` compiling at once, each stopped (its process killed) past ``timeout_s`` of CPU time or when its
last requester cancels it; nothing here ever blocks the caller of :meth:`CompilePool.submit`.

Two threads: ``morphserve-grammar`` starts the worker process (its start-up, a few seconds, runs here, never in a
request handler), sends jobs and cancellations; ``morphserve-grammar-reader`` reads its answers and resolves each
job's future (with ``convert``'s result: the deserialized grammar, built off the engine loop). A worker that dies
fails the jobs it had and is started again for the next ones."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serve.guided import frames
from serve.logging_setup import get_logger

_log = get_logger("serve.guided")

# The worker is single-threaded so that forking it is safe: no thread pools in the libraries it loads.
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}


class GuideError(ValueError):
    """A guide the grammar engine refuses (invalid schema, regex or grammar, one that accepts no text), or one too
    slow to compile: the client's error."""


class GuidesBusy(RuntimeError):
    """Too many guides are compiling or queued (``max_queued``): the request is refused, to retry later."""


class CompilerUnavailable(RuntimeError):
    """The compile worker could not be started or died: the server's fault, not the guide's."""


@dataclass(eq=False)
class CompileJob:
    kind: str
    source: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    id: int = 0
    holders: int = 1      # requests waiting for it (equal guides share one compile)
    sent: bool = False


def worker_python() -> str:
    """The interpreter for the worker: this environment's python3 (inside Triton's Python stub sys.executable is
    not an interpreter), else sys.executable."""
    candidate = Path(sys.prefix) / "bin" / "python3"
    return str(candidate) if candidate.exists() else sys.executable


class CompilePool:
    def __init__(self, init: Callable[[], dict[str, Any]], convert: Callable[[str], Any],
                 on_ready: Callable[[dict[str, Any]], None], workers: int, max_queued: int, timeout_s: float) -> None:
        self._init, self._convert, self._on_ready = init, convert, on_ready
        self.workers, self.max_queued, self.timeout_s = workers, max_queued, timeout_s
        self._cond = threading.Condition()
        self._queue: deque[CompileJob] = deque()
        self._inflight: dict[int, CompileJob] = {}
        self._cancels: list[int] = []
        self._by_key: dict[tuple[str, str], CompileJob] = {}
        self._next_id = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None   # the worker's stdin and stdout
        self._closed = False
        self._thread: threading.Thread | None = None

    # ---- the engine's calls (any thread, never blocking) -------------------------------------------------
    def submit(self, kind: str, source: str) -> CompileJob:
        """A job compiling ``source``; an equal one in progress is shared. GuidesBusy when the queue is full."""
        with self._cond:
            if self._closed:
                raise CompilerUnavailable("the grammar compiler is shut down")
            job = self._by_key.get((kind, source))
            if job is not None:
                job.holders += 1
                return job
            if len(self._queue) + len(self._inflight) >= self.max_queued:
                raise GuidesBusy(f"{len(self._queue) + len(self._inflight)} guides are compiling or waiting to "
                                 f"(at most {self.max_queued}); retry later")
            self._next_id += 1
            job = CompileJob(kind, source, id=self._next_id)
            self._by_key[(kind, source)] = job
            self._queue.append(job)
            self._start_thread()
            self._cond.notify_all()
        return job

    def cancel(self, job: CompileJob) -> None:
        """One requester no longer waits; the last one's cancel stops the compile (its process is killed)."""
        with self._cond:
            job.holders -= 1
            if job.holders > 0 or job.future.done():
                return
            self._by_key.pop((job.kind, job.source), None)
            if job in self._queue:
                self._queue.remove(job)
            elif job.id in self._inflight:
                self._cancels.append(job.id)
                self._cond.notify_all()
            job.future.cancel()

    @property
    def compiling(self) -> int:
        """Jobs compiling now or waiting to."""
        with self._cond:
            return len(self._queue) + len(self._inflight)

    def worker_pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            proc, self._proc = self._proc, None
            sock, self._sock = self._sock, None
            jobs = [*self._queue, *self._inflight.values()]
            self._queue.clear()
            self._inflight.clear()
        for job in jobs:
            job.future.cancel()
        if proc is not None and sock is not None:
            _stop(proc, sock)

    # ---- the dispatcher thread --------------------------------------------------------------------------
    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._dispatch, name="morphserve-grammar", daemon=True)
            self._thread.start()

    def _dispatch(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._cancels and not (
                        self._queue and len(self._inflight) < self.workers):
                    self._cond.wait()
                if self._closed:
                    return
                proc, sock = self._proc, self._sock
            if proc is None or sock is None or proc.poll() is not None:
                try:
                    self._start_worker()
                except (OSError, ValueError, CompilerUnavailable) as exc:
                    self._fail_queued(CompilerUnavailable(f"the grammar compiler could not start: {exc}"))
                continue
            with self._cond:
                cancels, self._cancels = self._cancels, []
                sends = []
                while self._queue and len(self._inflight) < self.workers:
                    job = self._queue.popleft()
                    self._inflight[job.id] = job
                    sends.append(job)
            try:
                for job_id in cancels:
                    _send(sock, {"cancel": job_id})
                for job in sends:
                    _send(sock, {"id": job.id, "kind": job.kind, "source": job.source, "timeout_s": self.timeout_s})
            except OSError:  # the worker died: the reader fails what it had
                pass

    def _start_worker(self) -> None:
        env = {**os.environ, **_WORKER_ENV}
        root = str(Path(__file__).resolve().parents[2])  # the same morphserve as this process
        env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
        # A socket, not pipes: a write to a dead worker must fail with an error, never with SIGPIPE (Triton's
        # Python stub may not ignore that signal, and it would kill the whole model process).
        sock, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen([worker_python(), "-m", "serve.guided.compile_worker"],  # noqa: S603 - fixed argv
                                    stdin=theirs.fileno(), stdout=theirs.fileno(), env=env, cwd=root)
        finally:
            theirs.close()
        ready, ok = threading.Event(), []
        threading.Thread(target=self._read, args=(proc, sock, ready, ok), name="morphserve-grammar-reader",
                         daemon=True).start()
        _send(sock, {"init": self._init()})
        ready.wait()
        if not ok or proc.poll() is not None:
            _stop(proc, sock)
            raise CompilerUnavailable(f"the compile worker exited during start-up (status {proc.poll()})")
        with self._cond:
            if self._closed:
                _stop(proc, sock)
                return
            self._proc, self._sock = proc, sock
        _log.info("guide_compiler_started", pid=proc.pid, workers=self.workers)

    def _fail_queued(self, exc: Exception) -> None:
        with self._cond:
            jobs = list(self._queue)
            self._queue.clear()
            for job in jobs:
                self._by_key.pop((job.kind, job.source), None)
        for job in jobs:
            _resolve(job, exc=exc)

    # ---- the reader thread -------------------------------------------------------------------------------
    def _read(self, proc: subprocess.Popen[bytes], sock: socket.socket, ready: threading.Event,
              ok: list[bool]) -> None:
        reader = frames.Reader()
        try:
            while True:
                data = sock.recv(1 << 20)
                if not data:
                    break
                for message in reader.feed(data):
                    if message.get("ready"):
                        self._on_ready(message)
                        ok.append(True)
                        ready.set()
                    else:
                        self._answer(message)
        except (OSError, ValueError) as exc:
            _log.error("guide_compiler_unreadable", error=str(exc))
        finally:
            ready.set()
            proc.wait()
            sock.close()
            self._worker_died(proc)

    def _answer(self, message: dict[str, Any]) -> None:
        with self._cond:
            job = self._inflight.pop(int(message["id"]), None)
            if job is not None:
                self._by_key.pop((job.kind, job.source), None)
            self._cond.notify_all()
        if job is None or job.future.done():
            return
        if "ok" in message:
            try:
                _resolve(job, result=self._convert(message["ok"]))
            except Exception as exc:  # noqa: BLE001 - an answer this process cannot load is the server's problem
                _resolve(job, exc=CompilerUnavailable(f"the compiled grammar could not be loaded: {exc}"))
        elif message.get("timeout"):
            _log.warning("guide_compile_timeout", kind=job.kind, guide_bytes=len(job.source), timeout_s=self.timeout_s)
            _resolve(job, exc=GuideError(f"the {job.kind} guide did not compile within {self.timeout_s:g} s of CPU "
                                         "time (guided_compile_timeout_s; its compile was stopped); simplify it"))
        else:
            _resolve(job, exc=GuideError(f"invalid {job.kind} guide: {message.get('error', '')}"))

    def _worker_died(self, proc: subprocess.Popen[bytes]) -> None:
        with self._cond:
            if self._proc is not proc:
                return
            self._proc = None
            jobs = list(self._inflight.values())
            self._inflight.clear()
            for job in jobs:
                self._by_key.pop((job.kind, job.source), None)
            self._cond.notify_all()
        if not self._closed:
            _log.error("guide_compiler_died", pid=proc.pid, returncode=proc.returncode, jobs_lost=len(jobs))
        for job in jobs:
            _resolve(job, exc=CompilerUnavailable(f"the grammar compiler exited (status {proc.returncode}) "
                                                  "while compiling this guide; retry"))


def _resolve(job: CompileJob, result: Any = None, exc: Exception | None = None) -> None:
    if job.future.done():
        return
    try:
        if exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled meanwhile
        pass


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(frames.encode(message), socket.MSG_NOSIGNAL)


def _stop(proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
    """End the worker: end of file on its stdin makes it kill its children and exit; SIGKILL if it does not."""
    try:
        sock.shutdown(socket.SHUT_WR)
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
