"""Guides compiled to grammars off the admission path, bounded in time and number, and a matcher per request, with
one of two maintained grammar engines: xgrammar (the default: TensorRT-LLM's and vLLM's; precomputes token masks
when it compiles, so masks are cheap per token) or llguidance (compiles in about a millisecond, computes masks
lazily, slower per token). bench/guided_cost.py measures both; docs/structured-output.md has the figures and the
reason for the default.

One compiler per engine (per tokenizer). :meth:`GuideCompiler.submit` never waits: it answers from a cache of
compiled grammars (by guide text, ``cache_bytes`` at most), or hands the guide to the compile worker process
(serve/guided/compile_pool.py, compile_worker.py), at most ``workers`` at once and ``max_queued`` compiling or
queued, each stopped (its process killed) past ``timeout_s`` or when no request waits for it any more. The engine
keeps a guided request waiting in its own state until its grammar is ready (serve/engine/grammar_wait.py)."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from serve.guided.compile_pool import CompileJob, CompilePool, CompilerUnavailable, GuideError, GuidesBusy
from serve.guided.spec import GuidedDecoding
from serve.guided.state import GuideState, LlguidanceState, XgrammarState
from serve.model.tokenizer import Tokenizer

__all__ = ["BACKENDS", "CompilerUnavailable", "GuideCompiler", "GuideError", "GuidesBusy", "PendingGuide"]

BACKENDS = ("xgrammar", "llguidance")
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_BYTES = 64 * 2**20
COMPILE_WORKERS = 2
"""Guides compiling at once (each in its own process, at the lowest CPU priority): the global bound."""
MAX_QUEUED = 32
"""Guides compiling or waiting to, at most; past it a guided request is refused as overloaded (retry later)."""


class PendingGuide:
    """A guide on its way to a grammar: ``done()``, then ``state()`` (a new matcher, or the GuideError / other
    error the compile ended with); ``cancel()`` when the request no longer waits for it."""

    def __init__(self, compiler: GuideCompiler, spec: GuidedDecoding, compiled: Any = None,
                 job: CompileJob | None = None) -> None:
        self.compiler, self.spec, self._compiled, self._job = compiler, spec, compiled, job

    def done(self) -> bool:
        return self._job is None or self._job.future.done()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        if self._job is None:
            fn()
        else:
            self._job.future.add_done_callback(lambda _f: fn())

    def state(self) -> GuideState:
        if self._job is not None:
            self._compiled = self._job.future.result(timeout=0)
            self._job = None
            self.compiler.remember(self.spec, self._compiled)
        return self.compiler.state(self.spec, self._compiled)

    def wait(self, timeout: float | None = None) -> GuideState:
        if self._job is not None:
            self._job.future.result(timeout=timeout)
        return self.state()

    def cancel(self) -> None:
        if self._job is not None and not self._job.future.done():
            self.compiler.pool.cancel(self._job)
        self._job = None


class GuideCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, backend: str = "xgrammar", workers: int = COMPILE_WORKERS,
                 max_queued: int = MAX_QUEUED) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"guided decoding backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self.backend = backend
        self._lock = threading.Lock()
        self._engine_tokenizer: Any = None   # xgrammar's TokenizerInfo or llguidance's LLTokenizer
        self._cache: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._cached_bytes = 0
        self.pool = CompilePool(self._init_message, self._convert, self._worker_ready, workers, max_queued, timeout_s)

    # ---- the worker's start-up ------------------------------------------------------------------------------
    def _init_message(self) -> dict[str, Any]:
        return {"backend": self.backend, "tokenizer_json": self.tokenizer.backend.to_str(),
                "vocab_size": self.vocab_size, "eos": list(self.tokenizer.eos_token_ids)}

    def _worker_ready(self, message: dict[str, Any]) -> None:
        """xgrammar: the worker's view of the tokenizer, so this process need not build it (~0.2-3 s of Python)."""
        with self._lock:
            if self._engine_tokenizer is None and self.backend == "xgrammar":
                import xgrammar as xgr

                self._engine_tokenizer = xgr.TokenizerInfo.deserialize_json(message["tokenizer_info"])

    def _prepared(self) -> Any:
        with self._lock:
            if self._engine_tokenizer is None:
                if self.backend == "xgrammar":
                    raise CompilerUnavailable("the grammar compiler has not started")
                import llguidance.hf
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
                eos = list(self.tokenizer.eos_token_ids)
                self._engine_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos[0])
            return self._engine_tokenizer

    def _convert(self, payload: str) -> Any:
        """A worker's answer -> what a matcher is built from (off the engine loop: the pool's reader thread)."""
        if self.backend == "xgrammar":
            import xgrammar as xgr

            return xgr.CompiledGrammar.deserialize_json(payload, self._prepared())
        self._prepared()  # llguidance's tokenizer, built once
        return payload    # the validated grammar

    # ---- compiling --------------------------------------------------------------------------------------------
    def submit(self, spec: GuidedDecoding) -> PendingGuide:
        """The guide's grammar on its way, never waiting: from the cache at once, else compiled by the worker.
        GuidesBusy when ``max_queued`` guides are compiling or waiting to."""
        key = (spec.kind, _source(spec))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return PendingGuide(self, spec, compiled=hit[0])
        return PendingGuide(self, spec, job=self.pool.submit(*key))

    def remember(self, spec: GuidedDecoding, compiled: Any) -> None:
        """Keep a compiled grammar for equal guides, the least recently used dropped past ``cache_bytes``."""
        size = compiled.memory_size_bytes if self.backend == "xgrammar" else len(compiled)
        key = (spec.kind, _source(spec))
        with self._lock:
            if key in self._cache or size > self.cache_bytes:
                return
            self._cache[key] = (compiled, size)
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, (_, dropped) = self._cache.popitem(last=False)
                self._cached_bytes -= dropped

    def compile(self, spec: GuidedDecoding) -> Any:
        """The compiled grammar, waiting for it (tools, tests); GuideError for a bad or slow guide."""
        pending = self.submit(spec)
        pending.wait()
        return pending._compiled

    def state(self, spec: GuidedDecoding, compiled: Any) -> GuideState:
        if self.backend == "xgrammar":
            return XgrammarState(spec, compiled)
        import llguidance

        return LlguidanceState(spec, llguidance.LLMatcher(self._prepared(), compiled))

    def new_state(self, spec: GuidedDecoding) -> GuideState:
        """A matcher for ``spec``, waiting for its grammar (tools, tests)."""
        return self.submit(spec).wait()

    def close(self) -> None:
        self.pool.close()


def _source(spec: GuidedDecoding) -> str:
    """What the worker compiles: the guide, or for ``choice`` the regex of its alternatives."""
    return "(" + "|".join(re.escape(c) for c in spec.choices) + ")" if spec.kind == "choice" else spec.guide
