"""Is the router's KV view true? With the load stopped, requests one after the other, per prompt family: the
frontend log says which worker the KV router chose and how many blocks of the prompt it believed that worker
holds (``overlap_blocks``); the worker's prefix-cache hit counter says how many it really reused. A route
whose claimed overlap the worker did not have (more than one block short: the engine recomputes the last
block of a fully cached prompt) is a route to a stale prefix."""

from __future__ import annotations

import time
from typing import Any

from bench.dynamo_faults.load import SYSTEMS
from serve.dynamo.frontend_log import read_attempts, response_id
from serve.dynamo.hosts import HostCluster
from serve.dynamo.http import post_json

HITS = "morphserve_prefix_cache_hits_total"
BLOCK_SIZE = 16


def kv_probe(cluster: HostCluster,
             questions: tuple[str, ...] = ("Is there parking?", "Is it open today?")) -> dict[str, Any]:
    stale, overlaps, routes = 0, [], []
    by_id = {cluster.instance_id(w): w for w in cluster.workers}
    for system in SYSTEMS:
        for q in questions:
            before = {w.name: cluster.metric(w, HITS) for w in cluster.workers}
            body = {"model": "morphserve", "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
            try:
                rid = response_id(post_json(f"{cluster.base_url}/v1/chat/completions", body, timeout=60)["id"])
            except (OSError, ValueError, KeyError) as exc:
                routes.append({"error": f"{type(exc).__name__}: {exc}"})
                continue
            attempt = None
            for _ in range(20):  # the frontend writes the route line as the request completes
                tries = read_attempts(cluster.frontend_log).get(rid)
                if tries:
                    attempt = tries[-1]
                    break
                time.sleep(0.1)
            worker = by_id.get(attempt.worker_id) if attempt else None
            if attempt is None or worker is None:
                routes.append({"request": rid, "error": "no route line / unknown worker"})
                continue
            reused = cluster.metric(worker, HITS) - before[worker.name]
            claimed = attempt.overlap_blocks or 0
            bad = claimed > 0 and reused < (claimed - 1) * BLOCK_SIZE
            stale += bad
            overlaps.append(claimed)
            routes.append({"worker": worker.name, "overlap_blocks": claimed, "reused_tokens": reused, "stale": bad})
    return {"stale_routes": stale, "overlap_blocks": overlaps, "routes": routes}
