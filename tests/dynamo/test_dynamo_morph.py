"""A morph transition on a Dynamo worker changes its published capacity: under load the worker swaps
layers to int4, its KV pool grows, and the live snapshot (``dynamo_component_total_blocks``, the router's
input) follows, above the value registered in the model card; when the load is gone the layers are
restored and the published capacity returns to the base. Real processes on loopback."""

from __future__ import annotations

import threading
import time

import pytest

from serve.dynamo.http import post_json
from tests.dynamo_cluster_support import openai_client, running_cluster, wait_for, worker_metric

pytestmark = [pytest.mark.dynamo, pytest.mark.slow, pytest.mark.timeout(900)]

# morph mode "default" under a 600 MiB budget; thresholds lowered so two requests are "pressure" and an
# idle half second is "calm" (the policy's real signals, only the numbers are test-sized).
MORPH_ARGS = ["--morph-mode", "default", "--device-memory", "600MiB", "--max-model-len", "512", "--max-num-seqs", "4",
              "--num-threads", "1", "--policy", "kv_high=0.2", "--policy", "kv_low=0.1", "--policy", "persist_iters=1",
              "--policy", "restore_persist_s=0.5", "--policy", "cost_aware=false"]


def test_morph_transitions_change_the_published_total_blocks() -> None:
    with running_cluster(replicas=1, base_args=MORPH_ARGS) as cluster:
        worker = cluster.workers[0]
        control = f"http://127.0.0.1:{worker.port}/engine/control/morph_state"
        registered = post_json(control, {})["registered_total_kv_blocks"]
        assert worker_metric(worker, "dynamo_component_total_blocks") == registered > 0

        # the request tracker's histograms, named as on Triton: one TTFT per request, one gap per later token
        ttft, itl = "morphserve_time_to_first_token_seconds_count", "morphserve_inter_token_latency_seconds_count"
        ttft_before, itl_before = worker_metric(worker, ttft), worker_metric(worker, itl)
        client = openai_client(cluster)
        prompt = " ".join(["The river flows to the sea."] * 50)  # ~350 tokens
        errors: list[BaseException] = []

        def one() -> None:
            try:
                client.completions.create(model="morphserve", prompt=prompt, max_tokens=40, temperature=0,
                                          extra_body={"ignore_eos": True})
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        seen = {registered}
        deadline = time.monotonic() + 300
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            seen.add(worker_metric(worker, "dynamo_component_total_blocks"))
            time.sleep(0.1)
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert worker_metric(worker, ttft) == ttft_before + 2
        assert worker_metric(worker, itl) == itl_before + 2 * 39  # 40 tokens each (ignore_eos)
        grown = max(seen)
        assert grown > registered, f"published total_blocks never grew above {registered}: {sorted(seen)}"
        state = post_json(control, {})
        assert state["stats"]["swaps_total"] > 0 and state["stats"]["layers_quantized"].get("int4", 0) > 0
        assert worker_metric(worker, "morphserve_swaps_total") == state["stats"]["swaps_total"]

        # Load gone: restores (LIFO, one ladder step at a time) shrink the pool back; the published value follows.
        wait_for(lambda: worker_metric(worker, "dynamo_component_total_blocks") == registered, 240, interval_s=0.5,
                 what=f"published total_blocks to return to {registered}")
        state = post_json(control, {})
        assert state["stats"]["restores_total"] > 0 and state["stats"]["kv_blocks_total"] == registered
        assert state["published"]["kv_total_blocks"] == registered

        # The operator's memory control on the system port (docs/memory-yield.md): yield, then reclaim.
        base = f"http://127.0.0.1:{worker.port}/engine/control"
        bad = post_json(f"{base}/memory_yield", {"size": 5})
        assert bad["status"] == "error" and "512MiB" in bad["message"]
        asked = post_json(f"{base}/memory_yield", {"size": "20MiB"})
        assert asked["status"] == "ok" and asked["memory_yield"]["yield_request_bytes"] == 20 * 2**20
        wait_for(lambda: (worker_metric(worker, "morphserve_memory_yielded_bytes") or 0) >= 20 * 2**20, 60,
                 interval_s=0.2, what="20 MiB to be yielded")
        held = worker_metric(worker, "morphserve_memory_held_bytes")
        assert post_json(f"{base}/memory_reclaim", {})["status"] == "ok"
        wait_for(lambda: worker_metric(worker, "morphserve_memory_yielded_bytes") == 0, 60, interval_s=0.2,
                 what="the yielded bytes to be reclaimed")
        assert worker_metric(worker, "morphserve_memory_held_bytes") > held
        assert worker_metric(worker, "morphserve_memory_reclaims_total") >= 1
