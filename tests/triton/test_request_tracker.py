"""The request tracker (serve/request_tracker.py) and the Triton model's request metrics, without Triton.

The tracker's numbers come from given timestamps (no clock is read). The Triton side runs the real model file
(triton_models/morphserve/1/model.py) against a fake ``triton_python_backend_utils`` that records what the
custom-metrics API would export, so the histograms' bucket counts are checked exactly from a scripted
sequence of the engine's outputs, and a cancellation or a timeout is counted once however often it is seen; the
engine decides timeouts and cancellations (serve/engine/lifecycle.py), the tracker counts them by the final
output's error kind and the model answers them by kind (serve/triton/errors.py).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from serve.engine.outputs import FinishReason, RequestOutput
from serve.error_kinds import ErrorKind
from serve.metrics_catalogue import (
    E2E_REQUEST_LATENCY,
    INTER_TOKEN_LATENCY,
    REQUEST_QUEUE_TIME,
    TIER_INTER_TOKEN_LATENCY,
    TIME_TO_FIRST_TOKEN,
    RequestHistogram,
)
from serve.request_tracker import CANCELLED, OVERLOADED, TIMEOUT, RequestTracker

MODEL_FILE = Path(__file__).resolve().parents[2] / "triton_models" / "morphserve" / "1" / "model.py"


class RecordingSink:
    """What the tracker reports, as lists."""

    def __init__(self) -> None:
        self.observed: dict[str, list[float]] = {}
        self.finished: list[tuple[str, int]] = []

    def observe(self, metric: RequestHistogram, value: float, label: str | None = None) -> None:
        self.observed.setdefault(metric.name if label is None else f"{metric.name}/{label}", []).append(value)

    def count_finished(self, reason: str, prompt_tokens: int) -> None:
        self.finished.append((reason, prompt_tokens))


def out(rid: str, tokens: int, reason: FinishReason | None = None, *, prompt: int = 7, error: str | None = None,
        queued: tuple[float, float] | None = None, kind: ErrorKind | None = None, retry: int | None = None,
        tier: int | None = None) -> RequestOutput:
    """An engine output with ``tokens`` new tokens; ``reason`` makes it the final one; ``queued`` = (the engine's
    arrival, first scheduling) in the engine's clock; ``kind``: the error kind the engine ended it with."""
    arrival, first = queued or (0.0, None)
    return RequestOutput(rid, list(range(tokens)), "t" * tokens, reason is not None, reason, num_prompt_tokens=prompt,
                         num_output_tokens=tokens, error=error, arrival_time=arrival, first_scheduled_time=first,
                         error_kind=kind, retry_after_s=retry, priority=tier)


# ---- the tracker -----------------------------------------------------------------------------------------
def test_ttft_itl_e2e_and_queue_time_from_given_timestamps() -> None:
    sink = RecordingSink()
    tracker = RequestTracker(sink)
    tracker.start("r", arrival=100.0)
    tracker.on_output(out("r", 0), t=100.1)  # nothing new (a prefill chunk): no latency yet
    first = tracker.on_output(out("r", 1), t=100.25)
    tracker.on_output(out("r", 1), t=100.5)
    done = tracker.on_output(out("r", 4, FinishReason.STOP, queued=(5.0, 5.125)), t=101.5)  # 4 tokens in 1 s
    assert first is done and done.ttft_s == 0.25 and done.e2e_s == 1.5 and done.finish_reason == "stop"
    assert sink.observed == {TIME_TO_FIRST_TOKEN.name: [0.25], INTER_TOKEN_LATENCY.name: [0.25] * 5,
                             REQUEST_QUEUE_TIME.name: [0.125], E2E_REQUEST_LATENCY.name: [1.5]}
    assert sink.finished == [("stop", 7)] and len(tracker) == 0
    assert tracker.on_output(out("r", 1), t=102.0) is None  # finished: later outputs count nothing
    assert sink.finished == [("stop", 7)] and len(sink.observed[INTER_TOKEN_LATENCY.name]) == 5


def test_itl_per_tier_from_the_engines_resolved_tier() -> None:
    """Each gap counts in the all-requests ITL and in its request's tier's series (the tier the engine resolved)."""
    sink = RecordingSink()
    tracker = RequestTracker(sink)
    tracker.start("tight", arrival=0.0)
    tracker.start("loose", arrival=0.0)
    tracker.on_output(out("tight", 1, tier=0), t=0.5)
    tracker.on_output(out("loose", 1, tier=3), t=0.5)
    tracker.on_output(out("tight", 2, tier=0), t=1.0)          # two gaps of 0.25 s
    tracker.on_output(out("loose", 1, FinishReason.STOP, tier=3), t=2.5)  # one gap of 2 s
    name = TIER_INTER_TOKEN_LATENCY.name
    assert sink.observed[f"{name}/0"] == [0.25, 0.25] and sink.observed[f"{name}/3"] == [2.0]
    assert sorted(sink.observed[INTER_TOKEN_LATENCY.name]) == [0.25, 0.25, 2.0]


def test_cancellation_and_timeout_are_counted_once() -> None:
    sink = RecordingSink()
    tracker = RequestTracker(sink)
    tracker.start("c", arrival=0.0)
    tracker.on_output(out("c", 1, prompt=3), t=0.5)
    assert tracker.finish("c", CANCELLED, t=1.0).finish_reason == CANCELLED
    assert tracker.finish("c", CANCELLED, t=1.1) is None  # the client's cancel seen twice
    assert tracker.on_output(out("c", 0, FinishReason.ABORT, prompt=3), t=1.2) is None  # the engine's abort output

    tracker.start("t", arrival=10.0)
    timed_out = out("t", 0, FinishReason.ERROR, prompt=2, error="request timed out", kind=ErrorKind.DEADLINE_EXCEEDED,
                    queued=(1.0, 1.5))
    assert tracker.on_output(timed_out, t=13.0).finish_reason == TIMEOUT
    assert tracker.on_output(timed_out, t=13.5) is None  # counted once
    tracker.start("s", arrival=20.0)
    tracker.on_output(out("s", 0, FinishReason.ERROR, prompt=4, kind=ErrorKind.OVERLOADED, retry=1), t=50.0)
    tracker.start("x", arrival=20.0)
    tracker.on_output(out("x", 0, FinishReason.ABORT, prompt=5, kind=ErrorKind.CANCELLED), t=21.0)
    assert sink.finished == [(CANCELLED, 3), (TIMEOUT, 2), (OVERLOADED, 4), (CANCELLED, 5)]
    assert E2E_REQUEST_LATENCY.name not in sink.observed  # only an answered request has an end-to-end latency
    assert REQUEST_QUEUE_TIME.name not in sink.observed


def test_engine_reasons_refusals_and_forgotten_requests() -> None:
    sink = RecordingSink()
    tracker = RequestTracker(sink)
    for rid, final in (("a", out("a", 0, FinishReason.ABORT)), ("e", out("e", 0, FinishReason.ERROR, error="boom")),
                       ("l", out("l", 2, FinishReason.LENGTH))):
        tracker.start(rid, arrival=0.0)
        tracker.on_output(final, t=1.0)
    tracker.refused(OVERLOADED)
    tracker.start("gone", arrival=0.0)
    tracker.forget("gone")  # the engine refused it: an error answer, not a finished request
    assert tracker.finish("gone", CANCELLED) is None
    assert sink.finished == [(CANCELLED, 7), ("error", 7), ("length", 7), (OVERLOADED, 0)]
    assert sink.observed[TIME_TO_FIRST_TOKEN.name] == [1.0]  # only "l" produced tokens


# ---- the Triton side, with a fake pb_utils ---------------------------------------------------------------
class FakeMetric:
    def __init__(self, labels: dict[str, str], buckets: list[float] | None) -> None:
        self.labels, self.buckets = labels, buckets
        self.value = 0.0
        self.observed: list[float] = []

    def set(self, value: float) -> None:
        self.value = value

    def increment(self, value: float) -> None:
        self.value += value

    def observe(self, value: float) -> None:
        self.observed.append(value)

    def bucket_counts(self) -> dict[float, int]:
        """Cumulative counts per upper bound, as Triton exports ``<name>_bucket{le=...}``."""
        return {b: sum(v <= b for v in self.observed) for b in [*self.buckets, float("inf")]}


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    families: dict[str, FakeMetricFamily] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[FakeMetric] = []
        FakeMetricFamily.families[name] = self

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> FakeMetric:  # noqa: N802 - pb_utils' name
        assert (buckets is not None) == (self.kind == self.HISTOGRAM)
        self.metrics.append(FakeMetric(labels, buckets))
        return self.metrics[-1]


class FakeTritonError:
    INVALID_ARG, INTERNAL, UNAVAILABLE, CANCELLED = "invalid_arg", "internal", "unavailable", "cancelled"

    def __init__(self, message: str, code: str) -> None:
        self.message, self.code = message, code


def fake_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.MetricFamily = FakeMetricFamily
    pb.TritonError = FakeTritonError
    pb.Tensor = FakeTensor
    pb.InferenceResponse = lambda output_tensors=None, error=None: types.SimpleNamespace(
        tensors=output_tensors, error=error)
    return pb


class FakeTensor(tuple):
    """pb_utils.Tensor's name() on a (name, array) pair."""

    def __new__(cls, name: str, array: Any) -> FakeTensor:
        return super().__new__(cls, (name, array))

    def name(self) -> str:
        return self[0]


class FakeRequest:
    def __init__(self) -> None:
        self.cancelled = False
        self.sent: list[tuple[Any, int]] = []

    def is_cancelled(self) -> bool:
        return self.cancelled

    def send(self, response: Any = None, flags: int = 0) -> None:
        self.sent.append((response, flags))


@pytest.fixture()
def triton_model(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The real model file's request handling around a fake engine (records aborts) and fake pb_utils."""
    FakeMetricFamily.families = {}
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    spec = importlib.util.spec_from_file_location("morphserve_triton_model_under_test", MODEL_FILE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    from serve.triton.metrics import Metrics

    model = module.TritonPythonModel.__new__(module.TritonPythonModel)
    model.metrics = Metrics(sys.modules["triton_python_backend_utils"], "morphserve", "1")
    model.tracker = RequestTracker(model.metrics)
    model._inflight, model._lock, model._stats_dirty = {}, threading.Lock(), threading.Event()
    model.aborted = []
    model.engine = types.SimpleNamespace(abort_request=lambda rid: model.aborted.append(rid) or True)

    def admit(rid: str, arrival: float, client_id: str | None = None) -> FakeRequest:
        request = FakeRequest()
        model._inflight[rid] = module._InFlight(rid, client_id or f"client-{rid}", request, request, True,
                                                model.tracker.start(rid, arrival))
        return request
    model.admit = admit
    return model


def histogram(name: str) -> FakeMetric:
    (metric,) = FakeMetricFamily.families[name].metrics
    return metric


def finished_counts() -> dict[str, float]:
    return {m.labels["finish_reason"]: m.value for m
            in FakeMetricFamily.families["morphserve_requests_finished_total"].metrics}


def test_triton_histograms_from_a_scripted_output_sequence(triton_model) -> None:
    a = triton_model.admit("a", arrival=100.0)
    triton_model._handle(out("a", 1), 100.03125)   # TTFT 2**-5 s: above 0.02, within 0.04
    triton_model._handle(out("a", 1), 100.28125)   # one gap of 0.25 s
    triton_model._handle(out("a", 2, FinishReason.LENGTH, queued=(5.0, 5.0625)), 100.78125)  # two gaps of 0.25 s
    b = triton_model.admit("b", arrival=200.0)
    triton_model._handle(out("b", 3), 200.5)       # TTFT 0.5 s (a bound holds what equals it)
    triton_model._handle(out("b", 1, FinishReason.STOP, prompt=4), 201.25)  # one gap of 0.75 s; e2e 1.25 s

    ttft = histogram(TIME_TO_FIRST_TOKEN.name).bucket_counts()
    assert (ttft[0.02], ttft[0.04], ttft[0.25], ttft[0.5], ttft[float("inf")]) == (0, 1, 1, 2, 2)
    itl = histogram(INTER_TOKEN_LATENCY.name).bucket_counts()
    assert (itl[0.2], itl[0.3], itl[0.5], itl[0.75], itl[float("inf")]) == (0, 3, 3, 4, 4)
    e2e = histogram(E2E_REQUEST_LATENCY.name).bucket_counts()
    assert (e2e[0.5], e2e[1.0], e2e[2.5], e2e[float("inf")]) == (0, 1, 2, 2)
    queue = histogram(REQUEST_QUEUE_TIME.name)
    assert queue.observed == [0.0625] and queue.bucket_counts()[0.05] == 0 and queue.bucket_counts()[0.1] == 1
    assert finished_counts() == {"length": 1, "stop": 1}
    assert FakeMetricFamily.families["morphserve_prompt_tokens_total"].metrics[0].value == 7 + 4
    assert [flags for _, flags in a.sent] == [0, 0, 1] and [flags for _, flags in b.sent] == [0, 1]
    assert triton_model._inflight == {} and len(triton_model.tracker) == 0


def test_triton_itl_per_tier_series(triton_model) -> None:
    """The per-tier ITL histogram: one series per tier seen, labelled with it beside the model's labels."""
    triton_model.admit("a", arrival=0.0)
    triton_model.admit("b", arrival=0.0)
    triton_model._handle(out("a", 1, tier=0), 0.25)
    triton_model._handle(out("b", 1, tier=2), 0.25)
    triton_model._handle(out("a", 1, FinishReason.LENGTH, tier=0), 0.375)  # a gap of 0.125 s
    triton_model._handle(out("b", 1, FinishReason.LENGTH, tier=2), 1.25)   # a gap of 1 s
    series = {m.labels["tier"]: m for m in FakeMetricFamily.families[TIER_INTER_TOKEN_LATENCY.name].metrics}
    assert set(series) == {"0", "2"} and all(m.labels["model"] for m in series.values())
    assert series["0"].observed == [0.125] and series["2"].observed == [1.0]
    assert series["2"].bucket_counts()[0.75] == 0 and series["2"].bucket_counts()[1.0] == 1


def test_triton_cancellation_and_timeout_are_counted_once(triton_model) -> None:
    from serve.triton.controls import new_inner_request_id

    now = time.perf_counter()
    inner = new_inner_request_id()
    cancelled = triton_model.admit("c", arrival=now, client_id=inner)
    triton_model._handle(out("c", 1), now)
    timed = triton_model.admit("t", arrival=now - 100.0)
    cancelled.cancelled = True
    triton_model._check_cancellations()
    triton_model._check_cancellations()  # a second poll asks the engine nothing more
    triton_model._cancel_inner_request(inner)  # a BLS model passing the same cancellation on
    assert triton_model.aborted == ["c"]
    triton_model._handle(out("c", 0, FinishReason.ABORT, kind=ErrorKind.CANCELLED), now)  # the engine's abort output
    triton_model._handle(out("c", 0, FinishReason.ABORT, kind=ErrorKind.CANCELLED), now)  # seen twice: nothing more
    triton_model._handle(out("t", 0, FinishReason.ERROR, kind=ErrorKind.DEADLINE_EXCEEDED,
                             error="request timed out after timeout_s=1 s (0 tokens generated)"), now)
    assert finished_counts() == {CANCELLED: 1, TIMEOUT: 1}
    assert [(r.error.code, r.error.message, flags) for r, flags in cancelled.sent[1:]] == [
        ("cancelled", "[cancelled] request cancelled by the client", 1)]
    assert [(r.error.code, r.error.message, flags) for r, flags in timed.sent] == [
        ("cancelled", "[deadline_exceeded] request timed out after timeout_s=1 s (0 tokens generated)", 1)]
    with pytest.raises(ValueError, match="no request in flight"):  # finished: an unknown id is refused
        triton_model._cancel_inner_request(inner)
    assert histogram(E2E_REQUEST_LATENCY.name).observed == []
    assert histogram(TIME_TO_FIRST_TOKEN.name).observed == [0.0]


def test_triton_errors_are_answered_by_kind_not_by_words(triton_model) -> None:
    """The engine's message is passed on as it is; the code and the tag come from its kind alone."""
    now = time.perf_counter()
    for rid, kind, retry, words, code in [
            ("o", ErrorKind.OVERLOADED, 10, "queue full, come back soon", "unavailable"),
            ("d", ErrorKind.DRAINING, None, "request timed out (not really)", "unavailable"),
            ("i", ErrorKind.INTERNAL, None, "overloaded? no: a failed forward", "internal")]:
        sent = triton_model.admit(rid, arrival=now)
        triton_model._handle(out(rid, 0, FinishReason.ERROR, kind=kind, retry=retry, error=words), now)
        (response, flags), = sent.sent
        tag = f"[{kind.value} retry_after={retry or 1}] " if kind is not ErrorKind.INTERNAL else "[internal] "
        prefix = "generation failed: " if kind is ErrorKind.INTERNAL else ""
        assert (response.error.code, response.error.message, flags) == (code, tag + prefix + words, 1)


def test_triton_gauges_read_engine_stats(triton_model, tiny) -> None:
    from serve.config import EngineConfig
    from serve.engine import LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(num_kv_blocks=32, max_num_seqs=4), loaded=tiny)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    stats = engine.stats()
    triton_model.metrics.update_from_stats(stats)
    value = lambda name: FakeMetricFamily.families[name].metrics[0].value  # noqa: E731
    assert value("morphserve_kv_blocks_total") == stats.kv_blocks_total == 32
    assert value("morphserve_generation_tokens_total") == stats.num_generated_tokens == 3
    assert value("morphserve_engine_healthy") == 1.0 and stats.as_dict()["num_running"] == 0
    kv = {m.labels["kv_cache_block_type"]: m.value for m
          in FakeMetricFamily.families["nv_trt_llm_kv_cache_block_metrics"].metrics}
    assert kv["max"] == 32 and kv["tokens_per"] == stats.block_size


def test_triton_quality_outputs_ride_with_the_perf_metrics_as_named(triton_model) -> None:
    """return_perf_metrics: the response carries the request's quality counts too, but only the outputs the request
    named (answered_outputs), the agreement only once the meter sampled it; without the flag, none of them."""
    from serve.engine.outputs import RequestMetrics

    named = frozenset({"text_output", "quantized_layer_tokens", "quality_samples", "quality_agreement"})
    for rid, perf, metrics, want in [
            ("s", True, RequestMetrics(0.0, quantized_layer_tokens=2, kv_8bit_tokens=2, quality_samples=2,
                                       quality_agreed=1),
             {"text_output": [b"tt"], "quantized_layer_tokens": [2], "quality_samples": [2],
              "quality_agreement": [0.5]}),
            ("u", True, RequestMetrics(0.0, quantized_layer_tokens=2),
             {"text_output": [b"tt"], "quantized_layer_tokens": [2], "quality_samples": [0]}),
            ("n", False, RequestMetrics(0.0, quantized_layer_tokens=2, quality_samples=2, quality_agreed=1),
             {"text_output": [b"tt"]})]:
        sent = triton_model.admit(rid, arrival=0.0)
        flight = triton_model._inflight[rid]
        flight.perf_metrics, flight.outputs = perf, named
        final = out(rid, 2, FinishReason.LENGTH)
        final.metrics = metrics
        triton_model._handle(final, 1.0)
        (response, flags), = sent.sent
        assert {t.name(): t[1].tolist() for t in response.tensors} == want, rid
