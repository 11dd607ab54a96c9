"""A Triton request's input tensors -> typed request fields, with errors meant for the client.

Only shapes, types, text encoding and this server's own limits are checked here; the sampling values
themselves are validated once, by ``SamplingParams`` (the engine's), when the model builds it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from serve.request_values import BadValue, text
from serve.triton.input_error import InputError
from serve.triton.trtllm import InputGetter, check_unsupported, with_parameters  # name -> array or None


def answered_outputs(declared: Iterable[str], requested: Iterable[str]) -> frozenset[str]:
    """The outputs a response carries: those the request named among the model's declared ones, or every declared
    one when it named none. A response is built with these only: Python 3.12's backend stub dies (SIGSEGV in
    libpython, the model's process gone) when it prunes an output the request did not name."""
    declared, requested = frozenset(declared), frozenset(requested)
    return declared & requested if requested else declared


@dataclasses.dataclass(frozen=True)
class InputLimits:
    """Bounds on what one request may carry, checked before anything is decoded or tokenized (a 10 MB
    prompt used to block admission for 9 s; Triton 2.51 has no HTTP body-size flag)."""

    max_prompt_bytes: int = 256 * 1024   # UTF-8 bytes of text_input
    max_list_items: int = 64             # elements of any list input (stop)
    max_item_bytes: int = 4096           # bytes of one string in a list input
    max_timeout_s: float = 3600.0        # largest timeout_s a request may ask for
    max_guide_bytes: int = 64 * 1024     # guided_decoding_guide (serve/guided/spec.py MAX_GUIDE_BYTES)


@dataclasses.dataclass
class ParsedRequest:
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    ignore_eos: bool = False
    # TensorRT-LLM's inputs (serve/triton/trtllm.py has the rest of that contract).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    return_log_probs: bool = False
    exclude_input_in_output: bool = True  # morphserve's default; TRT-LLM's models send False unless asked
    end_id: int | None = None
    include_stop_str: bool = False        # stop_words (TensorRT-LLM) end the answer with the stop string
    guided: dict[str, str] | None = None  # {"type", "guide"}: structured output (serve/guided), validated there
    speculate: bool = True                # False: decode without speculation (speculate / num_draft_tokens 0)
    perf_metrics: bool = False            # return_perf_metrics: every response carries the request's perf metrics
    stop_reason: bool = False             # return_stop_reason: the final response carries stop_reason

    timeout_s: float | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the engine's SamplingParams (which validates the values).

        end_id replaces the model's end-of-sequence token, as in TensorRT-LLM."""
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos or self.end_id is not None,
                    stop_token_ids=() if self.end_id is None else (self.end_id,),
                    repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens, bad_words=self.bad_words,
                    logprobs=self.return_log_probs, include_stop_str_in_output=self.include_stop_str,
                    guided_decoding=self.guided, speculate=self.speculate, perf_metrics=self.perf_metrics)


def scalar(get_input: InputGetter, name: str, kind: str) -> Any:
    """The single element of an optional input, or None when absent. ``kind`` names the expected type
    for error messages; Triton has already checked the data type against config.pbtxt."""
    arr = get_input(name)
    if arr is None:
        return None
    if arr.size != 1:
        raise InputError(f"{name} must hold exactly one {kind}, got a tensor of shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _bytes_len(value: Any) -> int:
    return len(value) if isinstance(value, (bytes, bytearray, np.bytes_, str)) else 0


def _string_list(get_input: InputGetter, name: str, limits: InputLimits) -> tuple[str, ...]:
    """A flat list of UTF-8 strings, bounded in count and per-item size before decoding."""
    arr = get_input(name)
    if arr is None:
        return ()
    if arr.size > limits.max_list_items:
        raise InputError(f"{name} may hold at most {limits.max_list_items} items, got {arr.size}")
    items = arr.reshape(-1)
    for v in items:
        if _bytes_len(v) > limits.max_item_bytes:
            raise InputError(f"each {name} item may have at most {limits.max_item_bytes} bytes, got {_bytes_len(v)}")
    return tuple(_utf8(v, name) for v in items)


def _utf8(value: Any, name: str) -> str:
    """Text from a tensor element: UTF-8 bytes that decode, or a str without lone surrogates
    (serve/request_values.py)."""
    try:
        return text(value, name)
    except BadValue as exc:
        raise InputError(str(exc)) from None


def parse_request(get_input: InputGetter, max_tokens_limit: int, default_max_tokens: int,
                  parameters: str | Mapping[str, Any] | None = None, *,
                  limits: InputLimits | None = None) -> ParsedRequest:
    """Validate a Triton request's inputs; raise InputError with a message meant for the client.

    ``parameters`` (a request's JSON parameters: over HTTP generate, the JSON keys that are not inputs)
    may carry any known option by its input name or alias; unknown ones are rejected. ``limits`` bound what
    one request may carry, checked before anything is decoded."""
    limits = limits or InputLimits()
    get_input = with_parameters(get_input, parameters)
    check_unsupported(get_input)
    arr = get_input("text_input")
    if arr is None:
        raise InputError("missing required input 'text_input' (TYPE_STRING, shape [1]): the prompt text")
    if arr.size != 1:
        raise InputError(f"text_input must hold exactly one string, got a tensor of shape {list(arr.shape)}")
    if _bytes_len(arr.reshape(-1)[0]) > limits.max_prompt_bytes:
        raise InputError(f"text_input has {_bytes_len(arr.reshape(-1)[0])} bytes; this server accepts at most "
                         f"{limits.max_prompt_bytes} (max_prompt_bytes)")
    prompt = _utf8(arr.reshape(-1)[0], "text_input")
    if not prompt:
        raise InputError("text_input is empty")

    mt = scalar(get_input, "max_tokens", "INT32")
    max_tokens = default_max_tokens if mt is None else int(mt)
    if max_tokens > max_tokens_limit:
        raise InputError(f"max_tokens={max_tokens} exceeds this server's limit (max_tokens_limit={max_tokens_limit})")

    temp = scalar(get_input, "temperature", "FP32")
    temperature = 0.0 if temp is None else float(temp)

    tp = scalar(get_input, "top_p", "FP32")
    top_p = 1.0 if tp is None else float(tp)

    tk = scalar(get_input, "top_k", "INT32")
    top_k = 0 if tk is None else int(tk)

    sd = scalar(get_input, "seed", "UINT64")
    if sd is None:
        sd = scalar(get_input, "random_seed", "UINT64")
    seed = None if sd is None else int(sd)

    # empty strings dropped (TensorRT-LLM clients send [""] for none); counts and sizes bounded first
    stop = tuple(s for s in _string_list(get_input, "stop", limits) if s)
    stop_words = tuple(w for w in _string_list(get_input, "stop_words", limits) if w)
    if stop and stop_words:
        raise InputError("send either stop (the answer ends before the stop string) or stop_words "
                         "(TensorRT-LLM: the answer ends with it), not both")
    timeout_s = _timeout(get_input, limits)

    sm = scalar(get_input, "stream", "BOOL")
    stream = bool(sm) if sm is not None else False
    ie = scalar(get_input, "ignore_eos", "BOOL")
    ignore_eos = bool(ie) if ie is not None else False
    out = ParsedRequest(prompt, max_tokens, temperature, top_p, top_k, seed, stop or stop_words, stream, ignore_eos)
    out.timeout_s = timeout_s
    out.include_stop_str = bool(stop_words)
    _parse_trtllm_options(get_input, out, limits)
    return out


def _optional(get_input: InputGetter, name: str, kind: str, default: Any, cast: Callable[[Any], Any]) -> Any:
    v = scalar(get_input, name, kind)
    return default if v is None else cast(v)


def _parse_trtllm_options(get_input: InputGetter, out: ParsedRequest, limits: InputLimits) -> None:
    """TensorRT-LLM's sampling inputs; single-sequence limits (beam_width, num_return_sequences) checked."""
    beam = _optional(get_input, "beam_width", "INT32", 1, int)
    if beam != 1:
        raise InputError(f"beam_width={beam} is not supported: this engine samples one sequence per request "
                         "(beam search is not implemented); send beam_width=1")
    n = _optional(get_input, "num_return_sequences", "INT32", 1, int)
    if n != 1:
        raise InputError(f"num_return_sequences={n} is not supported: send one request per sequence "
                         "(num_return_sequences=1)")
    out.repetition_penalty = _optional(get_input, "repetition_penalty", "FP32", 1.0, float)
    out.presence_penalty = _optional(get_input, "presence_penalty", "FP32", 0.0, float)
    out.frequency_penalty = _optional(get_input, "frequency_penalty", "FP32", 0.0, float)
    out.min_tokens = _optional(get_input, "min_length", "INT32", 0, int)
    out.bad_words = tuple(w for w in _string_list(get_input, "bad_words", limits) if w)
    out.return_log_probs = _optional(get_input, "return_log_probs", "BOOL", False, bool)
    out.exclude_input_in_output = _optional(get_input, "exclude_input_in_output", "BOOL", True, bool)
    out.end_id = _optional(get_input, "end_id", "INT32", None, int)
    if out.end_id is not None and out.end_id < 0:
        raise InputError(f"end_id must be a token id >= 0, got {out.end_id}")
    pad = _optional(get_input, "pad_id", "INT32", None, int)
    if pad is not None and pad < 0:
        raise InputError(f"pad_id must be a token id >= 0, got {pad}")
    # length_penalty only steers beam search in TensorRT-LLM; with beam_width 1 it has no effect there either.
    out.guided = _guided(get_input, limits)
    out.speculate = _speculate(get_input)
    out.perf_metrics = _optional(get_input, "return_perf_metrics", "BOOL", False, bool)
    out.stop_reason = _optional(get_input, "return_stop_reason", "BOOL", False, bool)


def _speculate(get_input: InputGetter) -> bool:
    """Whether the request may decode speculatively (docs/speculation.md): False when it sends the morphserve
    input ``speculate`` = false or TensorRT-LLM's ``num_draft_tokens`` = 0 (TensorRT-LLM's BLS model drafts only
    when it is > 0); absent, the server's ``speculation`` setting decides. A positive num_draft_tokens was already
    refused (check_unsupported)."""
    asked = _optional(get_input, "speculate", "BOOL", None, bool)
    drafts = _optional(get_input, "num_draft_tokens", "INT32", None, int)
    if drafts is not None and drafts < 0:
        raise InputError(f"num_draft_tokens must be 0 (decode without speculation), got {drafts}")
    if asked and drafts == 0:
        raise InputError("speculate=true and num_draft_tokens=0 contradict each other: send one of them")
    return asked is not False and drafts != 0


def _guided(get_input: InputGetter, limits: InputLimits) -> dict[str, str] | None:
    """TensorRT-LLM's guided_decoding_guide_type / guided_decoding_guide (an empty type: no guide). The type
    and the guide's content are checked by the engine's SamplingParams (serve/guided/spec.py)."""
    kind = scalar(get_input, "guided_decoding_guide_type", "STRING")
    guide = scalar(get_input, "guided_decoding_guide", "STRING")
    if guide is not None and _bytes_len(guide) > limits.max_guide_bytes:
        raise InputError(f"guided_decoding_guide may have at most {limits.max_guide_bytes} bytes, "
                         f"got {_bytes_len(guide)}")
    kind_text = _utf8(kind, "guided_decoding_guide_type").strip() if kind is not None else ""
    guide_text = _utf8(guide, "guided_decoding_guide") if guide is not None else ""
    if not kind_text:
        if guide_text.strip():
            raise InputError("guided_decoding_guide needs guided_decoding_guide_type (json, json_schema, regex, "
                             "ebnf_grammar, structural_tag)")
        return None
    return {"type": kind_text, "guide": guide_text}


def _timeout(get_input: InputGetter, limits: InputLimits) -> float | None:
    """Optional per-request deadline in seconds from arrival (None: no deadline)."""
    v = scalar(get_input, "timeout_s", "FP32")
    if v is None:
        return None
    t = float(v)
    if not (0.0 < t <= limits.max_timeout_s) or math.isnan(t):
        raise InputError(f"timeout_s must be in (0, {limits.max_timeout_s:g}] seconds, got {t!r}")
    return t


@dataclasses.dataclass(frozen=True)
class SloInputs:
    """Per-request service targets; None = the server's default. Values are validated by the engine
    (``RequestSLO``), like the sampling values; only shapes and types are checked here."""

    ttft_s: float | None = None
    tbt_s: float | None = None
    priority: int | None = None


def parse_slo_inputs(get_input: InputGetter) -> SloInputs:
    """The optional inputs ttft_slo_s, tbt_slo_s (FP32 seconds) and priority (INT32 tier, 0 = strict)."""
    ttft = scalar(get_input, "ttft_slo_s", "FP32")
    tbt = scalar(get_input, "tbt_slo_s", "FP32")
    prio = scalar(get_input, "priority", "INT32")
    return SloInputs(None if ttft is None else float(ttft), None if tbt is None else float(tbt),
                     None if prio is None else int(prio))
