"""Keep tritonserver up: when the process dies (the OOM killer, a crash), also during its first model
load, start it again on the same ports, at most ``max_restarts`` times per ``window_s`` with exponential
backoff, logging each event; when the budget is spent, say why and exit non-zero (EXIT_GAVE_UP) so that
a container orchestrator restarts the whole launcher.

Clients no longer reach Triton 2.51's HTTP parser (a deeply nested JSON body used to crash it): the
HTTP front (serve/triton/http_front.py) bounds every body first and keeps its port during restarts.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from serve.logging_setup import get_logger
from serve.triton.install import TritonLaunchError
from serve.triton.server import TritonServer

log = get_logger("triton_launcher")


EXIT_GAVE_UP = 3  # the launcher's exit status when restarts run out (a container orchestrator restarts it)


@dataclass(frozen=True)
class RestartPolicy:
    """At most ``max_restarts`` restarts within any ``window_s`` seconds (a rate, not a count in a row);
    waits ``backoff_s``, doubling with each restart in the window up to ``max_backoff_s``, before each."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
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
              healthy: Callable[[TritonServer], bool | None] = engine_healthy, *, ready: bool = True,
              on_give_up: Callable[[str], None] | None = None) -> int:
    """Watch a started server until ``stop`` is set (returns 0) or restarts run out (returns EXIT_GAVE_UP
    after ``on_give_up(reason)``). A dead server, or one whose engine reports unhealthy, is restarted.

    ``ready=False``: the server was just started and is still loading; a server killed by a signal during
    that first load (the OOM killer, a crash) is restarted too, while one that exits with a status (a bad
    model configuration, a busy port) raises TritonLaunchError at once, as restarting cannot help.
    ``on_ready(srv, restarts)`` runs each time the server becomes ready (restarts: those in the window)."""
    restarts: deque[float] = deque()  # monotonic times of the restarts within the window
    loading, first_load = not ready, not ready
    next_health = time.monotonic()
    while not stop.is_set():
        if loading:
            try:
                srv.wait_ready(timeout=policy.ready_timeout_s)
            except TritonLaunchError as e:
                rc = srv.proc.poll() if srv.proc is not None else 1
                if first_load and (rc is None or rc >= 0):
                    raise
                log.error("tritonserver_load_failed", returncode=rc, first_load=first_load,
                          error=str(e).splitlines()[0])
                if rc is None:  # hung load: stop it and count it as a death
                    srv.stop(keep_front=True)
                    rc = 1
            else:
                loading = False
                if restarts:
                    log.warning("tritonserver_restarted", restart=len(restarts),
                                ready_after_s=round(srv.ready_after_s or 0, 3))
                if on_ready is not None:
                    on_ready(srv, len(restarts))
                first_load = False
                continue
        else:
            rc = srv.proc.poll() if srv.proc is not None else 1
            if rc is None and policy.health_every_s > 0 and time.monotonic() >= next_health:
                next_health = time.monotonic() + policy.health_every_s
                if healthy(srv) is False:
                    log.error("engine_unhealthy", action="restarting tritonserver")
                    srv.stop(keep_front=True)
                    rc = -1
            if rc is None:
                stop.wait(poll_s)
                continue
        now = time.monotonic()
        while restarts and now - restarts[0] > policy.window_s:
            restarts.popleft()
        if len(restarts) >= policy.max_restarts:
            reason = (f"tritonserver died {len(restarts) + 1} times within {policy.window_s:g} s (last exit code "
                      f"{rc}); the restart budget is {policy.max_restarts} per {policy.window_s:g} s "
                      f"(--max-restarts, --restart-window); see {srv.log_path}")
            log.error("tritonserver_gave_up", returncode=rc, restarts=len(restarts), reason=reason,
                      log_tail=srv.log_tail(20))
            srv.stop(keep_front=True)
            if on_give_up is not None:
                on_give_up(reason)
            return EXIT_GAVE_UP
        delay = min(policy.backoff_s * 2 ** len(restarts), policy.max_backoff_s)
        restarts.append(now)
        log.error("tritonserver_died", returncode=rc, restart=len(restarts), max_restarts=policy.max_restarts,
                  window_s=policy.window_s, backoff_s=delay, during_load=loading or first_load,
                  log_tail=srv.log_tail(10))
        srv.stop(keep_front=True)  # reap, remove its shared memory, free its ports; the HTTP front answers 503
        if stop.wait(delay):
            break
        try:
            srv.start()
        except TritonLaunchError as e:
            log.error("tritonserver_restart_failed", restart=len(restarts), error=str(e).splitlines()[0])
        loading = True
    return 0
