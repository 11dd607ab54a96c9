"""Dynamo beyond one machine: etcd, the frontend and two MorphServe workers, each on its own host (a
network namespace with its own address on a bridge; serve/dynamo/hosts.py), started with the etcd recipe
of docs/dynamo.md. The client is the root namespace; requests, KV events and model cards cross the links.

- 32 streamed chat requests and two plain ones: each text equals the engine's own greedy output.
- KV-aware routing across hosts: five requests sharing a prefix go to the worker that computed it.
- A worker host's processes killed mid-stream: the stream finishes on the other host (exact text); the
  host's supervisor restarts it and it serves again.
- A worker host's link cut for 15 s mid-stream: the stream moves after the frontend's stream timeout and
  finishes elsewhere (exact text); after the link is back the worker serves again.
- After the cluster closes, and after a start that fails, no namespace, link or process is left.

Root is required (network namespaces); under CI=true a non-root run fails instead of skipping.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from serve.dynamo.frontend_log import read_attempts, response_id
from serve.dynamo.hosts import DEFAULT_WORKER_ARGS, HostCluster, HostsConfig
from tests.dynamo.test_dynamo_kv_routing import SHARED
from tests.dynamo_cluster_support import ReferenceEngine, dynamo_python, require_root

pytestmark = [pytest.mark.dynamo, pytest.mark.slow, pytest.mark.timeout(1500)]

TOKENS = 8
LONG = 48       # tokens of the streams a fault interrupts
CUT_S = 15.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_root()
    c = HostCluster(HostsConfig(workers=2, python=dynamo_python(), log_dir=tmp_path_factory.mktemp("hosts-logs")))
    with c:
        yield c
    # test_nothing_is_left_behind closes it first and checks; closing twice is a no-op


@pytest.fixture(scope="module")
def client(cluster):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", timeout=120.0, max_retries=0)


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine()


def stream_chat(client, messages, max_tokens: int, on_chunk=None, **extra) -> tuple[str, str, str | None]:
    """(text, OpenAI response id, last finish_reason) of one streamed greedy chat completion."""
    stream = client.chat.completions.create(model="morphserve", messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True, extra_body=extra or None)
    parts, rid, reason = [], "", None
    for n, ev in enumerate(stream):
        rid = rid or ev.id
        for choice in ev.choices:
            parts.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
        if on_chunk is not None:
            on_chunk(n)
    return "".join(parts), rid, reason


def served(cluster, host) -> float:
    return cluster.metric(host, "dynamo_component_requests_total", dynamo_endpoint="generate")


def test_each_host_has_its_own_address_and_the_card_crossed_through_etcd(cluster) -> None:
    addresses = {h.address for h in cluster.hosts.values()}
    assert len(addresses) == 4 and cluster.net.client_address not in addresses
    assert {h.role for h in cluster.hosts.values()} == {"etcd", "frontend", "worker"}
    # the workers wrote their tokenizer card on their own private tmpfs: the frontend host (and this one)
    # never saw those files, so the frontend served its model from the card it read out of etcd
    assert not (cluster.private / "card").exists()
    assert cluster.registered_workers() == 2


def test_32_streamed_chat_requests_equal_the_engines_greedy_output(cluster, client, reference) -> None:
    from serve.engine import SamplingParams

    chats = [[{"role": "user", "content": f"Give me fact number {i} about {topic}."}]
             for i, topic in enumerate(["the sea", "mountains", "owls", "bread"] * 8)]
    prompts = [reference.chat_prompt(m) for m in chats]
    want = reference.engine.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0))
    before = [served(cluster, w) for w in cluster.workers]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda m: stream_chat(client, m, TOKENS), chats))
    assert [text for text, _, _ in got] == [w["text"] for w in want]
    assert [reason for _, _, reason in got] == [w["finish_reason"] for w in want]
    after = [served(cluster, w) for w in cluster.workers]
    assert sum(after) - sum(before) == 32
    assert all(a > b for a, b in zip(after, before)), f"both worker hosts served: {before} -> {after}"


def test_plain_chat_requests_equal_the_engines_greedy_output(cluster, client, reference) -> None:
    for messages in ([{"role": "user", "content": "Name a colour."}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a harbour?"}]):
        want = reference.greedy(reference.chat_prompt(messages), TOKENS)
        got = client.chat.completions.create(model="morphserve", messages=messages, max_tokens=TOKENS, temperature=0)
        assert got.choices[0].message.content == want["text"]
        assert got.usage.completion_tokens == len(want["token_ids"])


def test_a_shared_prefix_goes_to_its_holder_across_hosts(cluster, client) -> None:
    hits = lambda h: cluster.metric(h, "morphserve_prefix_cache_hits_total")  # noqa: E731
    first = client.completions.create(model="morphserve", prompt=SHARED + "When do you open?", max_tokens=1,
                                      temperature=0)
    route = read_attempts(cluster.frontend_log)[response_id(first.id)][-1]
    holder = next(w for w in cluster.workers if cluster.instance_id(w) == route.worker_id)
    other = next(w for w in cluster.workers if w is not holder)
    before = [hits(holder), hits(other)]
    time.sleep(1.0)  # the holder's KV events cross to the frontend's router asynchronously
    ids = []
    for q in ["How much is a ticket?", "Can I bring my dog?", "Is the lamp room open?", "What does the cafe serve?",
              "Do groups get a guide?"]:
        ids.append(client.completions.create(model="morphserve", prompt=SHARED + q, max_tokens=1, temperature=0).id)
    after = [hits(holder), hits(other)]
    assert after[1] == before[1], f"the other host served a shared-prefix request: hits {before} -> {after}"
    assert after[0] - before[0] >= 5 * 11 * 16, f"the holder reused the prefix 5 times: hits {before} -> {after}"
    routes = read_attempts(cluster.frontend_log)
    chosen = [routes[response_id(i)][-1] for i in ids]
    assert {r.worker_id for r in chosen} == {route.worker_id}
    assert min(r.overlap_blocks or 0 for r in chosen) >= 11, chosen  # the router saw the holder's blocks


def _busy_worker(cluster):
    busy = [w for w in cluster.workers if cluster.metric(w, "morphserve_num_requests_running") > 0]
    assert len(busy) == 1, "exactly one worker host runs the stream"
    return busy[0]


def _serves_again(cluster, host, timeout_s: float = 240.0) -> None:
    """Until a request pinned to ``host``'s worker answers through the frontend."""
    deadline = time.monotonic() + timeout_s
    while not cluster.serves(host):
        assert time.monotonic() < deadline, f"{host.name} did not serve again within {timeout_s:.0f} s"
        time.sleep(1.0)


def test_killing_a_worker_hosts_processes_mid_stream_migrates_the_stream(cluster, client, reference) -> None:
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    want = reference.greedy(reference.chat_prompt(messages), LONG, ignore_eos=True)
    victim = []

    def kill_after_four(n: int) -> None:
        if n == 4 and not victim:
            victim.append(_busy_worker(cluster))
            cluster.kill(victim[0].name)
    text, rid, reason = stream_chat(client, messages, LONG, on_chunk=kill_after_four, ignore_eos=True)
    assert victim, "the stream ended before the kill"
    assert text == want["text"] and reason == "length"  # finished on the other host, token for token
    tries = read_attempts(cluster.frontend_log)[response_id(rid)]
    assert len({t.worker_id for t in tries}) == 2 and tries[-1].outcome == "completed", tries
    cluster.wait_ready(hosts=[victim[0]])   # its supervisor restarted the host's launcher
    assert victim[0].restarts
    _serves_again(cluster, victim[0])


def test_a_cut_link_moves_the_stream_and_the_worker_serves_again(cluster, client, reference) -> None:
    messages = [{"role": "user", "content": "Describe the stars over the sea, at length."}]
    want = reference.greedy(reference.chat_prompt(messages), LONG, ignore_eos=True)
    cut: list = []   # (host, timer that restores its link CUT_S after the cut, whatever the stream does)

    def cut_after_four(n: int) -> None:
        if n == 4 and not cut:
            host = _busy_worker(cluster)
            cluster.cut(host.name)
            cut.append((host, threading.Timer(CUT_S, cluster.restore, [host.name])))
            cut[0][1].start()
    try:
        text, rid, reason = stream_chat(client, messages, LONG, on_chunk=cut_after_four, ignore_eos=True)
    finally:
        if cut:
            cut[0][1].join()
    assert cut, "the stream ended before the cut"
    assert text == want["text"] and reason == "length"
    tries = read_attempts(cluster.frontend_log)[response_id(rid)]
    cut_id = cluster.instance_id(cut[0][0])
    # the attempt on the cut host timed out (an earlier one may have gone to the killed host's registration,
    # which stays in etcd until its lease runs out: cannot_connect, and the request moved on)
    on_cut = [t for t in tries if t.worker_id == cut_id]
    assert [(t.outcome, t.error) for t in on_cut] == [("failed", "response_timeout")], tries
    assert tries[-1].outcome == "completed" and tries[-1].worker_id != cut_id, tries
    _serves_again(cluster, cut[0][0])


def test_kv_routing_still_follows_the_holder_after_the_faults(cluster, client) -> None:
    prefix = SHARED.replace("lighthouse museum", "harbour aquarium")
    first = client.completions.create(model="morphserve", prompt=prefix + "Opening hours?", max_tokens=1, temperature=0)
    holder = read_attempts(cluster.frontend_log)[response_id(first.id)][-1].worker_id
    time.sleep(1.0)
    ids = [client.completions.create(model="morphserve", prompt=prefix + q, max_tokens=1, temperature=0).id
           for q in ["Ticket price?", "Dogs allowed?", "Is there a cafe?"]]
    routes = read_attempts(cluster.frontend_log)
    chosen = [routes[response_id(i)][-1] for i in ids]
    assert {r.worker_id for r in chosen} == {holder} and min(r.overlap_blocks or 0 for r in chosen) >= 11, chosen


def test_nothing_is_left_behind(cluster) -> None:
    cluster.close()
    assert cluster.leftovers() == {"namespaces": [], "links": [], "processes": []}
    assert not cluster.root.exists()


def test_a_failed_start_leaves_nothing_behind(tmp_path: Path) -> None:
    require_root()
    c = HostCluster(HostsConfig(workers=1, python=dynamo_python(), ready_timeout_s=120,
                                worker_args=[*DEFAULT_WORKER_ARGS, "--max-model-len", "-5"], log_dir=tmp_path))
    with pytest.raises(RuntimeError, match="worker-1 exited"):
        with c:
            pass
    assert c.leftovers() == {"namespaces": [], "links": [], "processes": []}
    assert re.search(r"max.model.len", (tmp_path / "worker-1" / "launcher.out").read_text()
                     + "".join(p.read_text() for p in (tmp_path / "worker-1").glob("worker-*.log")))
