"""Two MorphServe workers behind Dynamo's frontend (least-loaded routing, --migration-limit 3), real
processes on loopback: both serve; killing the worker that runs a stream leaves the stream finishing
(migrated, still the engine's greedy output) and the service answering; a worker started later joins
and takes requests."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.dynamo_cluster_support import (
    READY_TIMEOUT_S,
    ReferenceEngine,
    openai_client,
    running_cluster,
    wait_for,
    worker_metric,
)

pytestmark = [pytest.mark.dynamo, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(replicas=2, router_mode="least-loaded", migration_limit=3) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster)


def _burst(client, n: int, max_tokens: int = 8) -> list[str]:
    def one(i: int) -> str:
        return client.completions.create(model="morphserve", prompt=f"Count to {i}:", max_tokens=max_tokens,
                                         temperature=0).choices[0].text
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _served(proc) -> float:
    return worker_metric(proc, "dynamo_component_requests_total")


def test_both_workers_serve_a_concurrent_burst(cluster, client) -> None:
    before = [_served(w) for w in cluster.workers]
    assert all(_burst(client, 6))
    after = [_served(w) for w in cluster.workers]
    assert all(a > b for a, b in zip(after, before)), f"requests per worker before {before}, after {after}"


def test_killing_the_busy_worker_migrates_its_stream(cluster, client) -> None:
    reference = ReferenceEngine()
    prompt = "Write a long essay about mountains."
    want = reference.greedy(prompt, 48, ignore_eos=True)
    stream = client.completions.create(model="morphserve", prompt=prompt, max_tokens=48, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    parts = []
    victim = None
    for ev in stream:
        parts.extend(c.text for c in ev.choices)
        if victim is None and len(parts) >= 4:
            busy = [w for w in cluster.workers if worker_metric(w, "morphserve_num_requests_running") > 0]
            assert len(busy) == 1, "exactly one worker runs the stream"
            victim = busy[0]
            cluster.kill_worker(victim, signal.SIGKILL)
    assert victim is not None and not victim.alive()
    assert "".join(parts) == want["text"]  # finished elsewhere, token for token the engine's greedy output
    survivor = next(w for w in cluster.workers if w.alive())
    assert worker_metric(survivor, "morphserve_generation_tokens_total") > 0
    assert all(_burst(client, 3))  # the service keeps answering with one worker


def test_a_worker_started_later_joins(cluster, client) -> None:
    late = cluster.add_worker()
    cluster.wait_ready(READY_TIMEOUT_S, workers=[late])
    wait_for(lambda: _served(late) >= 0, 30, what="the late worker's metrics")

    def late_worker_served() -> bool:
        _burst(client, 4)
        return _served(late) > 0
    wait_for(late_worker_served, 180, interval_s=0.5, what="the frontend to route to the late worker")
    assert worker_metric(late, "morphserve_generation_tokens_total") > 0
