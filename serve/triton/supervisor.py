"""Keep tritonserver up: when the process dies (a request that crashes it, the OOM killer), start it
again on the same ports, with bounded retries and exponential backoff, logging each event.

One known way to crash Triton 2.51 from a client: an HTTP generate body whose JSON nests ~50,000
levels deep (about 100 KB) overflows the stack of its JSON parser (SIGSEGV). Triton 2.51 has no flag
to bound the HTTP body, so the supervisor is the mitigation: the server is back after one start-up.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from serve.logging_setup import get_logger
from serve.triton.install import TritonLaunchError
from serve.triton.server import TritonServer

log = get_logger("triton_launcher")


@dataclass(frozen=True)
class RestartPolicy:
    """``max_restarts`` restarts in a row at most (a server that stayed up ``stable_s`` resets the count);
    waits ``backoff_s``, doubling up to ``max_backoff_s``, before each."""

    max_restarts: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0
    ready_timeout_s: float = 300.0
    health_every_s: float = 5.0    # how often the engine's health gauge is read (0: never)


def engine_healthy(srv: TritonServer, timeout: float = 5.0) -> bool | None:
    """The model's ``morphserve_engine_healthy`` gauge: False after repeated failed engine iterations,
    None when it cannot be read (server busy or restarting: not a reason to restart)."""
    try:
        with urllib.request.urlopen(srv.metrics_url, timeout=timeout) as r:  # noqa: S310 - loopback
            text = r.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError):
        return None
    values = [ln.rsplit(" ", 1)[-1] for ln in text.splitlines() if ln.startswith("morphserve_engine_healthy{")]
    return None if not values else all(float(v) != 0.0 for v in values)


def supervise(srv: TritonServer, policy: RestartPolicy, stop: threading.Event,
              on_ready: Callable[[TritonServer, int], None] | None = None, poll_s: float = 0.5,
              healthy: Callable[[TritonServer], bool | None] = engine_healthy) -> int:
    """Watch a started, ready server until ``stop`` is set (returns 0) or restarts run out (returns the
    last exit code, or 1). A dead server, or one whose engine reports unhealthy, is restarted.
    ``on_ready(srv, restarts)`` runs after each successful restart."""
    restarts = 0
    up_since = next_health = time.monotonic()
    while not stop.is_set():
        rc = srv.proc.poll() if srv.proc is not None else 1
        if rc is None and policy.health_every_s > 0 and time.monotonic() >= next_health:
            next_health = time.monotonic() + policy.health_every_s
            if healthy(srv) is False:
                log.error("engine_unhealthy", action="restarting tritonserver")
                srv.stop()
                rc = -1
        if rc is None:
            if restarts and time.monotonic() - up_since > policy.stable_s:
                restarts = 0
            stop.wait(poll_s)
            continue
        if restarts >= policy.max_restarts:
            log.error("tritonserver_gave_up", returncode=rc, restarts=restarts, log_tail=srv.log_tail(20))
            return rc or 1
        delay = min(policy.backoff_s * 2**restarts, policy.max_backoff_s)
        restarts += 1
        log.error("tritonserver_died", returncode=rc, restart=restarts, max_restarts=policy.max_restarts,
                  backoff_s=delay, log_tail=srv.log_tail(10))
        srv.stop()  # reap, remove its shared memory, free the ports
        if stop.wait(delay):
            break
        try:
            srv.start()
            srv.wait_ready(timeout=policy.ready_timeout_s)
        except TritonLaunchError as e:
            log.error("tritonserver_restart_failed", restart=restarts, error=str(e).splitlines()[0])
            continue
        up_since = time.monotonic()
        log.warning("tritonserver_restarted", restart=restarts, ready_after_s=round(srv.ready_after_s or 0, 3))
        if on_ready is not None:
            on_ready(srv, restarts)
    return 0
