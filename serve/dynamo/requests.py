"""Dynamo's preprocessed request (token ids + option groups) -> the engine's prompt ids and SamplingParams,
and the engine's outputs -> Dynamo response chunks. Pure functions: no Dynamo import, no torch.

The frontend has already tokenized the prompt and applied the chat template; it also detokenizes the
streamed ids and cuts stop strings, so stop strings reach the engine only to stop it early (saving work).
Options this engine cannot honour are rejected with a clear error instead of being silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from serve.engine import SamplingParams
from serve.request_values import INT32, UINT32, UINT64, check_text, integer, real, text


class RequestError(ValueError):
    """The request asks for something this worker does not do; the message says what."""


# sampling_options keys -> the value that means "off" (None is always accepted as "not set").
_NEUTRAL_SAMPLING = {
    "n": 1, "best_of": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "min_p": 0.0, "use_beam_search": False, "length_penalty": 1.0,
}
_NEUTRAL_OUTPUT = {"logprobs": None, "prompt_logprobs": None}
# OpenAI's defaults when the client leaves a field out (vLLM's server does the same).
DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True)
class EngineRequest:
    prompt_token_ids: list[int]
    params: SamplingParams


def _unsupported(group: Mapping[str, Any], neutral: Mapping[str, Any], where: str) -> list[str]:
    bad = []
    for key, ok in neutral.items():
        value = group.get(key)
        if value is None or value == ok or (isinstance(ok, float) and isinstance(value, (int, float)) and float(value)
                                            == ok):
            continue
        bad.append(f"{where}.{key}={value!r}")
    return bad


def _stop_token_ids(stop: Mapping[str, Any], eos_ids: Iterable[int], ignore_eos: bool) -> tuple[int, ...]:
    """Every stop id the frontend sent; EOS ids only if EOS is honoured (the engine stops on EOS by itself)."""
    ids: set[int] = set()
    for key in ("stop_token_ids", "stop_token_ids_visible", "stop_token_ids_hidden"):
        ids.update(int(t) for t in (stop.get(key) or []))
    eos = set(eos_ids)
    return tuple(sorted(t for t in ids if t not in eos or not ignore_eos))


def to_engine_request(request: Mapping[str, Any], eos_token_ids: Iterable[int] = (),
                      default_max_tokens: int = 256) -> EngineRequest:
    """Map one Dynamo request; raises RequestError (unsupported option) or ValueError (bad value)."""
    ids = request.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise RequestError("request has no prompt token ids")
    sampling = request.get("sampling_options") or {}
    stop = request.get("stop_conditions") or {}
    output = request.get("output_options") or {}
    bad = (_unsupported(sampling, _NEUTRAL_SAMPLING, "sampling_options")
           + _unsupported(output, _NEUTRAL_OUTPUT, "output_options"))
    if bad:
        raise RequestError("not supported by the morphserve worker: " + ", ".join(bad)
                           + " (supported: temperature, top_p, top_k, seed, max_tokens, min_tokens, ignore_eos, "
                             "stop, stop token ids, guided decoding)")
    # one normaliser for every front end (serve/request_values.py): ranges checked before any narrowing, text checked
    ignore_eos = bool(stop.get("ignore_eos") or False)
    min_tokens = integer(stop.get("min_tokens") or 0, "min_tokens", UINT32)
    temperature = sampling.get("temperature")
    params = SamplingParams(
        max_tokens=integer(stop["max_tokens"], "max_tokens", UINT32) if stop.get("max_tokens") is not None
        else default_max_tokens,
        min_tokens=min_tokens,
        temperature=real(DEFAULT_TEMPERATURE if temperature is None else temperature, "temperature"),
        top_p=real(sampling.get("top_p") if sampling.get("top_p") is not None else 1.0, "top_p"),
        top_k=_top_k(sampling.get("top_k")),
        seed=integer(sampling["seed"], "seed", UINT64) if sampling.get("seed") is not None else None,
        # stop strings: the frontend applies them after min_tokens itself
        stop=tuple(text(t, "stop") for t in stop.get("stop") or ()) if min_tokens == 0 else (),
        stop_token_ids=_stop_token_ids(stop, eos_token_ids, ignore_eos),
        ignore_eos=ignore_eos,
        guided_decoding=guided_decoding(sampling.get("guided_decoding")),
        speculate=speculate(request),
    )
    return EngineRequest([int(t) for t in ids], params)


SPECULATE_ANNOTATION = "speculate:"  # nvext.annotations ["speculate:false"]: this request decodes without speculation


def speculate(request: Mapping[str, Any]) -> bool:
    """Whether the request may decode speculatively (docs/speculation.md); absent, the worker's --speculation decides.

    Dynamo 1.6.1's frontend refuses unknown fields in an OpenAI body and in its ``nvext``, and forwards
    ``nvext.annotations`` to the worker as the request's ``annotations``: ``"speculate:false"`` there opts out.
    A client of the worker's endpoint, or a frontend that forwards a body's ``extra_args`` as they are, may send
    ``extra_args: {"speculate": false}`` instead. Other annotations are the frontend's and are left alone."""
    said: set[bool] = set()
    for note in request.get("annotations") or ():
        if isinstance(note, str) and note.startswith(SPECULATE_ANNOTATION):
            value = note[len(SPECULATE_ANNOTATION):]
            if value not in ("true", "false"):
                raise RequestError(f"annotation {note[:64]!r}: send speculate:false (or speculate:true)")
            said.add(value == "true")
    extra = request.get("extra_args")
    if isinstance(extra, Mapping) and extra.get("speculate") is not None:
        if not isinstance(extra["speculate"], bool):
            raise RequestError(f"extra_args.speculate must be true or false, got {extra['speculate']!r}"[:160])
        said.add(extra["speculate"])
    if len(said) > 1:
        raise RequestError("speculate is given both true and false; send one")
    return said != {False}


# Dynamo's GuidedDecodingOptions field -> the engine's guide type (serve/guided/spec.py)
_GUIDE_FIELDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf_grammar",
                 "structural_tag": "structural_tag"}


def guided_decoding(options: Mapping[str, Any] | None) -> dict[str, str] | None:
    """Dynamo's ``sampling_options.guided_decoding`` -> the engine's ``{"type", "guide"}``.

    What the 1.6.1 frontend sends (seen on the wire): ``{"json": <schema>}`` for ``response_format``
    ``json_schema`` and for top-level ``guided_json`` (an object, or a string passed through unparsed),
    ``{"json": {"type": "object"}}`` for ``json_object``, ``{"regex": ...}``, ``{"choice": [...]}``,
    ``{"grammar": ...}`` (EBNF), and ``backend`` / ``whitespace_pattern`` beside one of them; the frontend
    allows one constraint per request. ``None`` or no constraint: no guide."""
    if not options:
        return None
    backend = options.get("backend")
    if backend not in (None, "", "auto", "xgrammar"):
        raise RequestError(f"guided_decoding_backend {backend!r} cannot be chosen per request: the worker's "
                           "configuration picks the grammar engine (xgrammar by default)")
    if options.get("whitespace_pattern"):
        raise RequestError("guided_whitespace_pattern is not supported by the morphserve worker (JSON is compact)")
    given = [k for k in _GUIDE_FIELDS if options.get(k) is not None]
    if len(given) > 1:
        raise RequestError(f"only one guided decoding constraint per request, got {', '.join(given)}")
    if not given:
        return None
    value = options[given[0]]
    guide = check_text(value, "guided_decoding") if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return {"type": _GUIDE_FIELDS[given[0]], "guide": guide}


def _top_k(value: Any) -> int:
    """vLLM spells "no top-k" as -1 or 0; the engine as 0."""
    if value is None:
        return 0
    k = integer(value, "top_k", INT32)
    if k < -1:
        raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {k}")
    return max(k, 0)


_FINISH = {"stop": "stop", "length": "length", "abort": "cancelled", "error": "error"}


def finish_reason(engine_reason: str | None) -> str:
    """The engine's finish reason in Dynamo's vocabulary."""
    return _FINISH.get(engine_reason or "", "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:  # OpenAI's usage.prompt_tokens_details.cached_tokens (the frontend copies it)
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def chunk(token_ids: list[int], reason: str | None = None, prompt_tokens: int = 0,
          completion_tokens: int = 0, out: Any = None, block_size: int = 0) -> dict[str, Any]:
    """One streamed response chunk; the final one (``reason`` given) carries the usage and, from the engine's final
    output ``out`` (a RequestOutput, by duck type), what Dynamo's frontend shows under ``nvext`` when a client asks
    (``nvext.extra_fields``): ``stop_reason`` and ``engine_data`` (the request's perf metrics under TensorRT-LLM's
    names, RequestMetrics.perf_fields, and its quality numbers, RequestMetrics.quality_fields), and the prompt tokens
    served from the prefix cache as ``cached_tokens``."""
    answer: dict[str, Any] = {"token_ids": list(token_ids), "index": 0}
    if reason is not None:
        answer["finish_reason"] = finish_reason(reason)
        metrics = getattr(out, "metrics", None)
        cached = None if metrics is None else min(prompt_tokens, metrics.kv_reused_blocks * block_size)
        answer["completion_usage"] = usage(prompt_tokens, completion_tokens, cached)
        if metrics is not None:
            answer["engine_data"] = {**metrics.perf_fields(final=True), **metrics.quality_fields()}
        if getattr(out, "stop_reason", None) is not None:
            answer["stop_reason"] = out.stop_reason
    return answer
