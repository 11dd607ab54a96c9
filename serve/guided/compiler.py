"""Guides compiled to grammars, bounded in time, and a matcher per request, with one of two maintained grammar
engines: xgrammar (the default: TensorRT-LLM's and vLLM's; precomputes token masks when it compiles, so masks
are cheap per token) or llguidance (compiles in about a millisecond, computes masks lazily, slower per token).
bench/guided_cost.py measures both; docs/structured-output.md has the figures and the reason for the default.

One compiler per engine (per tokenizer). Compilation runs on a small worker pool, never on the engine loop:
``add_request`` waits at most ``timeout_s`` for it and refuses the request past that (the compile goes on in
its worker and lands in xgrammar's cache, bounded by ``cache_bytes``)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from typing import Any

from serve.guided.spec import GuidedDecoding
from serve.guided.state import GuideState, LlguidanceState, XgrammarState
from serve.logging_setup import get_logger
from serve.model.tokenizer import Tokenizer

_log = get_logger("serve.guided")

BACKENDS = ("xgrammar", "llguidance")
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_BYTES = 64 * 2**20
COMPILE_WORKERS = 2
ANY_JSON_SCHEMA = '{"type": ["object", "array"]}'
# compact JSON, the same in both engines: a small model given free whitespace can emit it until max_tokens
_LLG_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuideError(ValueError):
    """A guide the grammar engine refuses (invalid schema, regex or grammar), or one too slow to compile: the
    client's error, raised before the request is admitted."""


class GuideCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, backend: str = "xgrammar") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"guided decoding backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self.backend = backend
        self._lock = threading.Lock()
        self._engine_tokenizer: Any = None   # xgrammar's GrammarCompiler or llguidance's LLTokenizer
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="morphserve-grammar")

    def _prepared(self) -> Any:
        """The grammar engine's view of the tokenizer, built on the first guided request (~0.2 s)."""
        with self._lock:
            if self._engine_tokenizer is None:
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
                eos = list(self.tokenizer.eos_token_ids)
                if self.backend == "xgrammar":
                    import xgrammar as xgr

                    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=eos)
                    self._engine_tokenizer = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=self.cache_bytes > 0,
                                                                 cache_limit_bytes=self.cache_bytes or -1)
                else:
                    import llguidance.hf

                    self._engine_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos[0])
            return self._engine_tokenizer

    def _xgrammar(self, spec: GuidedDecoding) -> Any:
        compiler = self._prepared()
        if spec.kind in ("json", "json_schema"):
            return compiler.compile_json_schema(ANY_JSON_SCHEMA if spec.kind == "json" else spec.guide,
                                                any_whitespace=False)
        if spec.kind == "ebnf_grammar":
            return compiler.compile_grammar(spec.guide)
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(spec.guide)
        return compiler.compile_regex(_regex(spec))

    def _llguidance(self, spec: GuidedDecoding) -> Any:
        import llguidance

        tokenizer = self._prepared()
        if spec.kind in ("json", "json_schema"):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                ANY_JSON_SCHEMA if spec.kind == "json" else spec.guide, defaults=_LLG_JSON_DEFAULTS)
        elif spec.kind == "ebnf_grammar":
            grammar = llguidance.LLMatcher.grammar_from_lark(llguidance.gbnf_to_lark(spec.guide))
        elif spec.kind == "structural_tag":
            raise ValueError("structural_tag needs the xgrammar backend")
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(_regex(spec))
        problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)  # '' when the grammar is fine
        if problem:
            raise ValueError(" ".join(problem.split()))
        return grammar

    def _compile_now(self, spec: GuidedDecoding) -> Any:
        return self._xgrammar(spec) if self.backend == "xgrammar" else self._llguidance(spec)

    def compile(self, spec: GuidedDecoding) -> Any:
        """The compiled grammar (xgrammar's cache answers repeats at once); GuideError for a bad or slow guide."""
        future = self._pool.submit(self._compile_now, spec)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            _log.warning("guide_compile_timeout", kind=spec.kind, guide_bytes=len(spec.guide), timeout_s=self.timeout_s)
            raise GuideError(f"the {spec.kind} guide did not compile within {self.timeout_s:g} s; simplify it") from None
        except (RuntimeError, ValueError, TypeError, json.JSONDecodeError) as exc:
            raise GuideError(f"invalid {spec.kind} guide: {_first_line(exc)}") from None

    def new_state(self, spec: GuidedDecoding) -> GuideState:
        compiled = self.compile(spec)
        if self.backend == "xgrammar":
            return XgrammarState(spec, compiled)
        import llguidance

        return LlguidanceState(spec, llguidance.LLMatcher(self._prepared(), compiled))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _regex(spec: GuidedDecoding) -> str:
    return "(" + "|".join(re.escape(c) for c in spec.choices) + ")" if spec.kind == "choice" else spec.guide


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
