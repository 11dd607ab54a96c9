"""The benchmark's requests: workload items -> prompt texts (and probes), one request over a gRPC stream, its timing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from workload.items import WorkItem
from workload.latency import RequestTiming


@dataclass
class PreparedRequest:
    index: int
    kind: str                # "request" | "probe"
    scheduled_s: float       # send time relative to the run's start
    text: str
    max_tokens: int
    target_prompt_tokens: int
    sent_prompt_tokens: int  # the client tokenizer's count of `text` (the server tokenizes the same way)
    tbt_slo_s: float | None = None  # sent as the tbt_slo_s / priority inputs when set
    priority: int | None = None


def prompt_text(tokenizer, ids: Sequence[int]) -> tuple[str, int]:
    """Text whose tokenization has (nearly) len(ids) tokens: decode, re-encode, trim to the target once.

    The server receives text, and decoding then re-encoding a window cut from the middle of a text can
    merge or split tokens at its edges. Returns (text, token count of the text).
    """
    target = len(ids)
    text = tokenizer.decode(ids)
    enc = tokenizer.encode(text)
    if len(enc) > target:
        text = tokenizer.decode(enc[:target])
        enc = tokenizer.encode(text)
    return text, len(enc)


def prepare_requests(items: Sequence[WorkItem], tokenizer) -> tuple[list[PreparedRequest], dict]:
    reqs = []
    for i, w in enumerate(sorted(items, key=lambda w: w.arrival_s)):
        text, n = prompt_text(tokenizer, w.prompt_ids)
        reqs.append(PreparedRequest(i, "request", w.arrival_s, text, w.output_tokens, len(w.prompt_ids), n,
                                    w.tbt_slo_s, w.priority))
    return reqs, retokenization_stats([(r.target_prompt_tokens, r.sent_prompt_tokens) for r in reqs])


def retokenization_stats(pairs: Sequence[tuple[int, int]]) -> dict:
    """How far the prompts sent as text are from the requested token counts (target, sent) pairs."""
    diffs = [s - t for t, s in pairs]
    return {"requested_tokens": sum(t for t, _ in pairs), "sent_tokens": sum(s for _, s in pairs),
            "exact": sum(1 for d in diffs if d == 0), "requests": len(diffs),
            "mean_abs_diff": float(np.mean(np.abs(diffs))) if diffs else 0.0,
            "max_abs_diff": int(max((abs(d) for d in diffs), default=0))}


def probe_schedule(num_probes: int, span_s: float) -> list[float]:
    """Fixed send times: evenly spread over the workload's arrival span, (i + 0.5) * span / n."""
    if num_probes <= 0:
        return []
    return [span_s * (i + 0.5) / num_probes for i in range(num_probes)]


def make_probes(num_probes: int, span_s: float, output_len: int, tokenizer, start_index: int) -> list[PreparedRequest]:
    from workload.quality import PROBE_PROMPTS  # noqa: PLC0415

    prompts = PROBE_PROMPTS[:num_probes]
    return [PreparedRequest(start_index + i, "probe", t, text, output_len, len(tokenizer.encode(text)),
                            len(tokenizer.encode(text)))
            for i, (t, text) in enumerate(zip(probe_schedule(len(prompts), span_s), prompts))]


@dataclass
class RequestRecord:
    """What the client saw of one request (times absolute, time.perf_counter)."""

    req: PreparedRequest
    send_s: float = 0.0          # scheduled send time (TTFT counts from here)
    actual_send_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_input_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    ok: bool = False
    error: str | None = None
    end_s: float | None = None

    def timing(self) -> RequestTiming:
        return timing_from_chunks(self.send_s, self.chunk_times_s, self.num_output_tokens, self.ok, self.error)


def timing_from_chunks(send_s: float, chunk_times: Sequence[float], num_output_tokens: int, ok: bool,
                       error: str | None = None) -> RequestTiming:
    """A RequestTiming from streamed chunk receive times (one time per chunk; TPOT uses the token count).

    Chunk times earlier than ``send_s`` (impossible unless clocks disagree) are clamped to it.
    """
    times = [max(send_s, t) for t in chunk_times]
    return RequestTiming(send_s=send_s, token_times_s=times, num_output_tokens=max(num_output_tokens, 0) if times
                         else 0,
                         ok=ok and bool(times), error=error)


def run_request(url: str, model: str, rec: RequestRecord, timeout_s: float,
                clock: Callable[[], float] = time.perf_counter) -> None:
    """Send ``rec.req`` on its own gRPC stream and fill ``rec``; never raises, never outlives its deadline."""
    from serve.triton.client import GrpcStream, request_inputs  # noqa: PLC0415

    deadline = rec.send_s + timeout_s
    stream = None
    try:
        stream = GrpcStream(url, model)
        stream.__enter__()
        rec.actual_send_s = clock()
        stream.send(request_inputs(rec.req.text, max_tokens=rec.req.max_tokens, stream=True, temperature=0.0,
                                   ignore_eos=True, tbt_slo_s=rec.req.tbt_slo_s, priority=rec.req.priority),
                    request_id=f"{rec.req.kind}-{rec.req.index}")
        parts = []
        while True:
            remaining = deadline - clock()
            if remaining <= 0:
                raise TimeoutError(f"no final response within {timeout_s:.0f} s")
            item = next(stream.responses(timeout=remaining))
            now = clock()
            n = item.get("num_output_tokens")
            if n is not None and n > rec.num_output_tokens:
                rec.chunk_times_s.append(now)
                rec.num_output_tokens = int(n)
            if item.get("text_output"):
                parts.append(item["text_output"])
            if item.get("num_input_tokens") is not None:
                rec.num_input_tokens = int(item["num_input_tokens"])
            if item.get("finish_reason"):
                rec.finish_reason = item["finish_reason"]
            if item.get("final"):
                break
        rec.text = "".join(parts)
        rec.ok = rec.num_output_tokens > 0
        if not rec.ok:
            rec.error = "finished without tokens"
    except Exception as exc:  # noqa: BLE001 - tritonclient raises its own types; any error = failed request
        rec.ok = False
        rec.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.cancel()
    finally:
        rec.end_s = clock()
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()
