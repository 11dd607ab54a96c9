"""The faults, each with what it should do to requests (``expectation``) and how it is injected, removed and
recovered from. A fault runs while the load runs; it returns its window on the bench's clock:

- ``start``: the fault begins; ``end``: it is removed (the link is back, the process is restarted);
- ``recovered``: the cluster is whole again (the hit host's worker answers a request pinned to it through
  the frontend; for the frontend, the first answer through the new one), or None if not within the bound.

The link, etcd and netem faults last ``duration_s``; the two kills end when the supervisor has the host's
launcher running again (it restarts a host whose launcher exited after ``restart_backoff_s``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serve.dynamo.hosts import Host, HostCluster

RECOVERY_BOUND_S = 240.0


@dataclass
class Window:
    start: float
    end: float
    recovered: float | None = None
    notes: dict = field(default_factory=dict)
    clean: float | None = None   # etcd holds exactly the live workers again (a dead one's lease ran out)
    after_load: Callable[[], None] | None = None   # run once the load has stopped


@dataclass(frozen=True)
class Fault:
    name: str
    expectation: str
    inject: Callable[[HostCluster, float], Window]


def _until(predicate: Callable[[], bool], bound_s: float = RECOVERY_BOUND_S, every_s: float = 0.5) -> float | None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(every_s)
    return None


def settle(cluster: HostCluster, bound_s: float = 150.0) -> float | None:
    """Until etcd lists exactly the live workers: a SIGKILLed worker's registration stays until its lease
    (--etcd-lease-ttl) runs out, and until then the router still tries it (each try: cannot_connect, a
    migration)."""
    return _until(lambda: cluster.registered_workers() == len(cluster.workers), bound_s, 1.0)


def _busiest(cluster: HostCluster) -> Host:
    """The worker with the most requests running now (the one whose loss hurts)."""
    return max(cluster.workers, key=lambda w: cluster.metric(w, "morphserve_num_requests_running") or 0.0)


def kill_worker(cluster: HostCluster, duration_s: float) -> Window:
    victim = _busiest(cluster)
    start = time.monotonic()
    killed = cluster.kill(victim.name)
    restarted = _until(lambda: len(victim.restarts) > 0 and victim.alive(), 60, 0.1)
    recovered = _until(lambda: cluster.serves(victim))
    return Window(start, restarted or start, recovered, {"host": victim.name, "processes_killed": len(killed)})


def cut_link(cluster: HostCluster, duration_s: float) -> Window:
    victim = _busiest(cluster)
    start = time.monotonic()
    cluster.cut(victim.name)
    time.sleep(duration_s)
    cluster.restore(victim.name)
    end = time.monotonic()
    recovered = _until(lambda: cluster.serves(victim))
    return Window(start, end, recovered, {"host": victim.name,
                                          "restarts_during": sum(start <= t <= end for t in victim.restarts)})


def netem(cluster: HostCluster, duration_s: float, delay_ms: float = 50.0, loss: float = 0.01) -> Window:
    workers = cluster.workers
    dropped_before = cluster.emulator.stats() if cluster.emulator else {}
    start = time.monotonic()
    for w in workers:
        cluster.impair(w.name, delay_ms, loss)
    time.sleep(duration_s)
    for w in workers:
        cluster.impair(w.name, 0.0, 0.0)
    end = time.monotonic()
    recovered = _until(lambda: all(cluster.serves(w) for w in workers))
    after = cluster.emulator.stats() if cluster.emulator else {}
    host_of = {cluster.hosts[w.name].link.outer: w.name for w in workers}
    frames = {host_of.get(dev, dev): {"forwarded": fwd - dropped_before.get(dev, (0, 0))[0],
                                      "dropped": drop - dropped_before.get(dev, (0, 0))[1]}
              for dev, (fwd, drop) in after.items() if dev in host_of}
    return Window(start, end, recovered, {"delay_ms": delay_ms, "loss": loss, "frames": frames})


def etcd_outage(cluster: HostCluster, duration_s: float) -> Window:
    """etcd's host loses its link; a spare worker host is started 5 s in (it must wait and join after)."""
    start = time.monotonic()
    cluster.cut("etcd")
    spare = next((h for h in cluster.hosts.values() if h.role == "worker" and not h.in_service), None)
    time.sleep(min(5.0, duration_s))
    if spare is not None:
        cluster.start_host(spare.name)
    time.sleep(max(0.0, duration_s - 5.0))
    cluster.restore("etcd")
    end = time.monotonic()
    hosts = [*cluster.workers]
    recovered = _until(lambda: all(cluster.serves(w) for w in hosts))
    until = recovered or time.monotonic()  # a process that lost its lease exits when etcd is back: count those too
    notes = {"new_worker": spare.name if spare else None,
             "worker_restarts_until_recovered": {w.name: sum(start <= t <= until for t in w.restarts) for w in hosts},
             "frontend_restarts_until_recovered": sum(start <= t <= until for t in cluster.hosts["frontend"].restarts)}
    if spare is not None:
        notes["new_worker_launches"] = 1 + len(spare.restarts)
    window = Window(start, end, recovered, notes)
    if spare is not None:  # back to the next fault's shape, once the load has stopped (a SIGTERMed worker
        window.after_load = lambda: cluster.stop_host(spare.name)  # ends its in-flight streams "cancelled")
    return window


def restart_frontend(cluster: HostCluster, duration_s: float) -> Window:
    frontend = cluster.hosts["frontend"]
    start = time.monotonic()
    cluster.kill("frontend")
    restarted = _until(lambda: len(frontend.restarts) > 0 and frontend.alive(), 60, 0.1)
    recovered = _until(lambda: cluster.frontend_ready() and all(cluster.serves(w) for w in cluster.workers))
    return Window(start, restarted or start, recovered, {})


FAULTS: dict[str, Fault] = {f.name: f for f in [
    Fault("kill-worker", "the busiest worker host's processes are SIGKILLed mid-stream: its streams migrate to the "
          "other worker (--migration-limit) and finish with the same greedy text; nothing is lost; the supervisor "
          "restarts the host and it serves again", kill_worker),
    Fault("cut-link", "the busiest worker host's link goes down for the fault's duration: its streams stall until the "
          "frontend's stream timeout, then migrate and finish with the same text (or end with an explicit error); "
          "the host keeps its etcd lease and serves again once the link is back", cut_link),
    Fault("netem", "50 ms delay and 1 % loss each way on every worker's link: requests slow down (TTFT, throughput) "
          "but all finish; nothing hangs", netem),
    Fault("etcd-outage", "etcd's host is unreachable for the fault's duration: serving continues on the known "
          "workers (their leases outlive the outage); a worker host started during it waits and joins after",
          etcd_outage),
    Fault("restart-frontend", "the frontend host's processes are SIGKILLed and restarted: clients get refused "
          "connections (explicit errors) and retry; in-flight streams end with an error and are retried; the "
          "workers keep their state (their prefix caches and registrations)", restart_frontend),
]}
