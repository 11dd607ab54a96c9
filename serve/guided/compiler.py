"""Guides compiled to grammars with xgrammar (TensorRT-LLM's and vLLM's default grammar engine), bounded in time,
and a matcher per request.

One compiler per engine (per tokenizer). Compilation runs in the caller's thread's stead on a small worker pool,
never on the engine loop: ``add_request`` waits at most ``timeout_s`` for it and refuses the request past that
(the compile goes on in its worker and lands in xgrammar's cache, bounded by ``cache_bytes``)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from typing import Any

from serve.guided.spec import GuidedDecoding
from serve.guided.state import GuideState
from serve.logging_setup import get_logger
from serve.model.tokenizer import Tokenizer

_log = get_logger("serve.guided")

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_BYTES = 64 * 2**20
COMPILE_WORKERS = 2
ANY_JSON_SCHEMA = '{"type": ["object", "array"]}'


class GuideError(ValueError):
    """A guide the grammar engine refuses (invalid schema, regex or grammar), or one too slow to compile: the
    client's error, raised before the request is admitted."""


class GuideCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="morphserve-grammar")

    def _xgr_compiler(self) -> Any:
        """Built on the first guided request (the tokenizer's vocabulary analysis takes ~0.2 s)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.tokenizer.eos_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                                     cache_limit_bytes=self.cache_bytes)
            return self._compiler

    def _compile_now(self, spec: GuidedDecoding) -> Any:
        compiler = self._xgr_compiler()
        if spec.kind == "json":  # the built-in JSON grammar's language (an object or array), compact
            return compiler.compile_json_schema(ANY_JSON_SCHEMA, any_whitespace=False)
        if spec.kind == "json_schema":
            # compact separators: a small model given free whitespace can emit it until max_tokens
            return compiler.compile_json_schema(spec.guide, any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.guide)
        if spec.kind == "ebnf_grammar":
            return compiler.compile_grammar(spec.guide)
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(spec.guide)
        alternatives = "|".join(re.escape(c) for c in spec.choices)
        return compiler.compile_regex(f"({alternatives})")

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
        return GuideState(spec, self.compile(spec))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
