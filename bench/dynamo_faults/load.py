"""A steady load of streamed greedy chat requests, and what became of each one.

``concurrency`` client threads each send one request after the other (the official ``openai`` client,
streaming, temperature 0, ``ignore_eos`` so every answer has exactly ``max_tokens`` tokens). Prompts come
from two families that share a long system prefix each, so the KV router has prefixes to follow.

A request (a logical one: the client retries it) ends as exactly one of:
- ``answered``: a complete stream whose text equals the greedy text of its prompt (learnt from the clean
  warm-up, greedy output is deterministic); among these, ``migrated`` ones moved between workers inside
  Dynamo (the frontend log shows more than one routing attempt) and ``retried`` ones needed the client to
  send them again after an explicit error (a refused connection while the frontend restarts);
- ``failed``: every try ended with an explicit error (HTTP error status, an error event, a refused or
  reset connection) until the deadline, or the stream ended with a finish reason other than ``stop`` /
  ``length`` (``cancelled``: its worker was stopped mid-stream);
- ``lost``: no answer and no error (a read waited ``read_timeout_s`` in vain: ``hung``), a stream that ended
  without a finish reason (``truncated``), or a text that is not the greedy text (``wrong``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

SYSTEMS = (
    "You are the help desk of a small railway museum. The museum opens at ten and closes at four, except on "
    "Mondays. Tickets cost six euros; children under ten are free. The steam engine runs on the first Sunday "
    "of every month, weather permitting, and the signal box can be visited with a guide. Answer in one line.",
    "You are the assistant of a community garden. Plots are rented by the season for twenty euros; water is "
    "free from April to October; tools are kept in the green shed and must be cleaned after use. Bees live "
    "behind the greenhouse, so please keep the gate closed. Compost goes in the left bin. Answer in one line.",
)
QUESTIONS = ("When are you open?", "How much does it cost?", "Can children come?", "What is special here?")


def prompts() -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": s}, {"role": "user", "content": q}] for s in SYSTEMS for q in QUESTIONS]


@dataclass
class Record:
    prompt: int
    start: float                      # time.monotonic() of the first try
    end: float = 0.0
    first_token: float | None = None  # of the try that answered
    outcome: str = ""                 # answered | failed | lost
    detail: str = ""                  # lost: hung | truncated | wrong; failed: the last error
    tries: int = 0
    tokens: int = 0
    response_ids: list[str] = field(default_factory=list)
    text: str = ""                    # of the last try (kept to show what a lost request got)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start


class Load:
    """Start with ``start()``, stop with ``stop()``; ``records`` holds every finished request."""

    def __init__(self, base_url: str, concurrency: int = 2, max_tokens: int = 16, read_timeout_s: float = 30.0,
                 deadline_s: float = 90.0) -> None:
        import openai  # noqa: PLC0415 - the dev extra; the bench's --help works without it

        self.openai = openai
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=read_timeout_s, max_retries=0)
        self.concurrency, self.max_tokens, self.deadline_s = concurrency, max_tokens, deadline_s
        self.prompts = prompts()
        self.expected: dict[int, str] = {}
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._next = 0

    def learn_expected(self) -> None:
        """One clean answer per prompt: the greedy text every later answer must equal."""
        for i in range(len(self.prompts)):
            rec = self.one(i)
            if rec.outcome != "answered":
                raise RuntimeError(f"the warm-up request for prompt {i} did not answer: {rec.outcome} {rec.detail}")

    def start(self) -> None:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._loop, daemon=True, name=f"load-{k}")
                         for k in range(self.concurrency)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.deadline_s + 30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                i, self._next = self._next % len(self.prompts), self._next + 1
            rec = self.one(i)
            with self._lock:
                self.records.append(rec)

    def one(self, i: int) -> Record:
        """One logical request: tried again after an explicit error until it answers or the deadline passes."""
        rec = Record(prompt=i, start=time.monotonic())
        last_error = ""
        while True:
            rec.tries += 1
            try:
                text, finish = self._stream(i, rec)
            except self.openai.APITimeoutError:
                return self._end(rec, "lost", "hung")
            except (self.openai.APIConnectionError, self.openai.APIStatusError, self.openai.APIError) as exc:
                last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
                if time.monotonic() - rec.start > self.deadline_s:
                    return self._end(rec, "failed", last_error)
                time.sleep(min(2.0, 0.25 * rec.tries))
                continue
            if finish is None:
                return self._end(rec, "lost", "truncated")
            if finish not in ("stop", "length"):  # e.g. "cancelled": the worker stopped mid-stream and said so
                return self._end(rec, "failed", f"finish_reason={finish} after {len(text)} characters")
            want = self.expected.setdefault(i, text)
            return self._end(rec, "answered" if text == want else "lost", "" if text == want else "wrong")

    def _stream(self, i: int, rec: Record) -> tuple[str, str | None]:
        stream = self.client.chat.completions.create(
            model="morphserve", messages=self.prompts[i], max_tokens=self.max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        parts, finish, first = [], None, None
        rec.tokens = 0
        for ev in stream:
            if ev.id and ev.id not in rec.response_ids:
                rec.response_ids.append(ev.id)
            for choice in ev.choices:
                if choice.delta.content:
                    first = first or time.monotonic()
                    parts.append(choice.delta.content)
                    rec.tokens += 1
                finish = choice.finish_reason or finish
        rec.first_token = first
        rec.text = "".join(parts)
        return rec.text, finish

    @staticmethod
    def _end(rec: Record, outcome: str, detail: str) -> Record:
        rec.end, rec.outcome, rec.detail = time.monotonic(), outcome, detail
        return rec
