"""KV-aware routing with real processes: two MorphServe workers publish their prefix caches as KV events and
Dynamo's frontend in ``--router-mode kv`` sends a request whose prefix one worker holds to that worker."""

from __future__ import annotations

import re
import time

import pytest

from tests.dynamo_cluster_support import openai_client, running_cluster, worker_metric

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(900)]

# 189 tokens: 11 full blocks of 16 (the workers' block size) shared, inside max_model_len 256 with a question
SHARED = ("You are the support assistant of a lighthouse museum. Answer briefly and politely. The museum opens at "
          "nine and closes at five, every day except Monday. Tickets cost eight euros, children under twelve enter "
          "free, and groups of ten or more get a guide. The tower has two hundred and seventeen steps; the lamp "
          "room is closed when the wind is above force seven. Dogs on a lead are welcome in the garden but not in "
          "the tower. There is a cafe by the gate that serves soup, bread and apple cake. The gift shop sells maps, "
          "postcards, model ships and a small book about the keepers who lived here from 1820 to 1968. Parking is "
          "free behind the chapel; the bus from the station stops at the gate every forty minutes. Visitors who "
          "need help on the stairs may ask for the lift to the first gallery. Photographs are allowed everywhere "
          "except in the archive. Question: ")


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(replicas=2, router_mode="kv") as c:
        yield c


def _hits(proc) -> float:
    return worker_metric(proc, "morphserve_prefix_cache_hits_total")


def _routed_overlaps(cluster) -> list[int]:
    """overlap_blocks of every request the frontend's KV router placed (its INFO log, one line each)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", cluster.frontend.log_path.read_text(errors="replace"))  # colours
    return [int(m) for m in re.findall(r"overlap_blocks=(\d+)", text)]


def test_a_shared_prefix_goes_to_the_worker_that_holds_it(cluster) -> None:
    client = openai_client(cluster)
    queried = [worker_metric(w, "morphserve_prefix_cache_queries_total") for w in cluster.workers]
    first = client.completions.create(model="morphserve", prompt=SHARED + "When do you open?", max_tokens=1,
                                      temperature=0)
    assert first.choices[0].text is not None
    served = [w for w, q in zip(cluster.workers, queried, strict=True)
              if worker_metric(w, "morphserve_prefix_cache_queries_total") > q]
    assert len(served) == 1, "exactly one worker served the first request"
    holder = served[0]
    other = next(w for w in cluster.workers if w is not holder)
    before = [_hits(holder), _hits(other)]
    time.sleep(1.0)  # the router applies events asynchronously (~0.5 s on loopback)
    for q in ["How much is a ticket?", "Can I bring my dog?", "Is the lamp room open?", "What does the cafe serve?",
              "Do groups get a guide?"]:
        client.completions.create(model="morphserve", prompt=SHARED + q, max_tokens=1, temperature=0)
    after = [_hits(holder), _hits(other)]
    assert after[1] == before[1], f"the other worker served a shared-prefix request: hits {before} -> {after}"
    # 11 shared full blocks of 16 tokens per request
    assert after[0] - before[0] >= 5 * 11 * 16, f"the holder reused the prefix 5 times: hits {before} -> {after}"
    overlaps = _routed_overlaps(cluster)
    assert len(overlaps) >= 6 and min(overlaps[-5:]) >= 11, overlaps  # the router saw the holder's blocks
