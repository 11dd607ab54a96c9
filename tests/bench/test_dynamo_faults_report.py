"""The fault bench's accounting, without a cluster: the frontend log lines of a migrated request (copied from a
bench run of ai-dynamo 1.6.1) give its two attempts exactly; a fault's summary puts each request in the right
phase and outcome; the median of repeats sums what was lost."""

from __future__ import annotations

from bench.dynamo_faults.faults import Window
from bench.dynamo_faults.load import Record
from bench.dynamo_faults.report import in_phase, longest_gap, median_of, p95, summarize
from serve.dynamo.frontend_log import Attempt, attempts, response_id

FAILED = ('2026-12-04T18:26:12.497557Z  WARN http-request:kv_router.route_request: request_span: route request failed '
          'request.outcome="worker_disconnected" error.type="disconnected" method=POST uri=/v1/chat/completions '
          'version=HTTP/1.1 request_id=42e78ebf-5a66-44d6-a273-772e890b3a68 model="morphserve" otel.kind="client" '
          'request_id=84287d3d-3210-438d-9e96-a268d3cdf8a9 dp_rank=0 overlap_blocks=5 phase=Aggregated '
          'worker_id=320215454178266133 request.attempt=0 migration.is_retry=false migration.tokens_completed=0 '
          'request.outcome="worker_disconnected" error.type="disconnected" otel.status_code="error"')
COMPLETED = ('\x1b[2m2026-12-04T18:26:13.750164Z\x1b[0m \x1b[32m INFO\x1b[0m http-request:kv_router.route_request: '
             'request_span: route request completed request.outcome="success" method=POST uri=/v1/chat/completions '
             'version=HTTP/1.1 request_id=42e78ebf-5a66-44d6-a273-772e890b3a68 model="morphserve" otel.kind="client" '
             'request_id=84287d3d-3210-438d-9e96-a268d3cdf8a9 dp_rank=0 overlap_blocks=0 phase=Aggregated '
             'worker_id=320215454178266131 request.attempt=1 migration.is_retry=true migration.tokens_completed=12 '
             'migration.reason="disconnected" migration.from_worker_id=320215454178266133 request.outcome="success"')
OTHER = ('2026-12-04T18:26:12.400000Z  INFO dynamo_kv_router::scheduling::selector: Selected worker router_mode="kv" '
         'request_id="84287d3d-3210-438d-9e96-a268d3cdf8a9" worker_id=320215454178266133 logit=2.0')


def test_a_migrated_requests_attempts_come_out_of_the_frontend_log() -> None:
    got = attempts("\n".join([OTHER, FAILED, COMPLETED]))
    rid = response_id("chatcmpl-84287d3d-3210-438d-9e96-a268d3cdf8a9")
    assert rid == "84287d3d-3210-438d-9e96-a268d3cdf8a9"
    assert got[rid] == [
        Attempt("failed", 320215454178266133, 5, 0, None, "disconnected"),
        Attempt("completed", 320215454178266131, 0, 1, "disconnected", None),
    ]
    assert got["42e78ebf-5a66-44d6-a273-772e890b3a68"] == got[rid]  # the HTTP span's id names it too


def rec(prompt: int, start: float, end: float, outcome: str = "answered", ttft: float | None = 0.1, tries: int = 1,
        ids: tuple[str, ...] = (), detail: str = "") -> Record:
    r = Record(prompt=prompt, start=start, end=end, outcome=outcome, detail=detail, tries=tries, tokens=16,
               response_ids=list(ids))
    r.first_token = None if ttft is None else start + ttft
    return r


def test_a_faults_summary_counts_outcomes_and_phases() -> None:
    window = Window(start=10.0, end=12.0, recovered=20.0)
    rid = "chatcmpl-84287d3d-3210-438d-9e96-a268d3cdf8a9"
    records = [
        rec(0, 1.0, 2.0, ttft=0.2),                                  # before
        rec(1, 9.0, 11.0, ttft=0.3, ids=(rid,)),                     # during (in flight at 10), migrated
        rec(2, 12.0, 15.0, ttft=2.5, tries=2),                       # during, retried by the client
        rec(3, 13.0, 16.0, outcome="failed", ttft=None, detail="APIConnectionError: refused"),
        rec(4, 14.0, 44.0, outcome="lost", ttft=None, detail="hung"),
        rec(5, 21.0, 22.0, ttft=0.1),                                # after
        rec(6, 50.0, 51.0),                                          # outside [t0, t_end]: not this fault's
    ]
    log = attempts("\n".join([FAILED, COMPLETED]))
    probe = {"stale_routes": 0, "overlap_blocks": [5, 5]}
    out = summarize(records, window, t0=0.0, t_end=45.0, attempts=log, probe=probe, expected={4: "the text"})
    counts = (out["requests"], out["answered"], out["migrated"], out["retried"], out["failed"], out["lost"])
    assert counts == (6, 4, 1, 1, 1, 1)
    assert out["lost_detail"] == {"hung": 1, "truncated": 0, "wrong": 0}
    assert out["lost_examples"][0]["expected"] == "the text" and out["lost_examples"][0]["at_s"] == 4.0
    assert out["failed_errors"] == ["APIConnectionError: refused"]
    assert out["requests_by_phase"] == {"before": 1, "during": 4, "after": 1}
    # during: TTFTs 0.3 and 2.5; numpy's linear p95 (workload.latency.percentiles) = 0.3 + 0.95 * 2.2 = 2.39
    assert out["ttft_p95_s"] == {"before": 0.2, "during": 2.39, "after": 0.1}
    assert (out["fault_s"], out["outage_s"], out["recover_after_removal_s"]) == (2.0, 10.0, 8.0)
    assert out["longest_gap_s"] == 5.0  # answers ended at 11 and 15 inside [10, 20]: 15 -> 20 is the longest
    assert in_phase(records[1], "during", 10.0, 20.0) and not in_phase(records[1], "before", 10.0, 20.0)


def test_p95_gap_and_the_median_of_repeats() -> None:
    # linear: 1 + 0.95 * 99
    assert p95([]) is None and p95([3.0]) == 3.0 and p95([float(i) for i in range(1, 101)]) == 95.05
    assert longest_gap([], 0.0, 7.0) == 7.0
    base = {"requests": 10, "answered": 10, "migrated": 1, "retried": 0, "failed": 0, "lost": 0, "fault_s": 20.0,
            "outage_s": 30.0, "recover_after_removal_s": 10.0, "longest_gap_s": 5.0,
            "registrations_clean_after_s": 40.0,
            "ttft_p95_s": {"before": 0.1, "during": 1.0, "after": 0.1},
            "e2e_p95_s": {"before": 1, "during": 9, "after": 1},
            "throughput_tok_s": {"before": 30.0, "during": 10.0, "after": 30.0}, "stale_routes": 0}
    repeats = [dict(base), dict(base, lost=2, outage_s=50.0), dict(base, outage_s=None)]
    med = median_of(repeats)
    assert med["lost"] == 0 and med["lost_total"] == 2       # the median hides one bad repeat; the total does not
    assert med["outage_s"] is None                             # not every repeat recovered: no median
    assert med["ttft_p95_s"]["during"] == 1.0 and med["requests"] == 10
