"""Command line of ``python -m serve.dynamo`` (one worker): engine options -> EngineConfig, Dynamo options.

No Dynamo import here, so ``--help`` and the tests of this parsing run anywhere.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from serve.config import EngineConfig, parse_policy_overrides, parse_size

DEFAULT_MODEL_NAME = "morphserve"


@dataclass(frozen=True)
class WorkerOptions:
    engine: EngineConfig
    served_model_name: str
    namespace: str
    component: str
    endpoint: str
    discovery_backend: str
    request_plane: str
    event_plane: str | None
    model_card_dir: str | None
    default_max_tokens: int
    log_level: str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serve.dynamo",
                                description="One MorphServe engine as an NVIDIA Dynamo worker (token ids in, token ids out).")
    e = p.add_argument_group("engine")
    e.add_argument("--model", default="smollm2-135m", help="engine directory, embedded model name, .gguf or HF directory")
    e.add_argument("--morph-mode", default="default",
                   help="off, static-int8, static-int4, accuracy, default, performance (default: %(default)s, "
                        "as in the Triton deployment)")
    e.add_argument("--device-memory", default=None, help="memory budget (e.g. 600MiB); sizes the KV pool with morphing")
    e.add_argument("--num-kv-blocks", type=int, default=None, help="fixed KV pool size (overrides --kv-cache-memory)")
    e.add_argument("--kv-cache-memory", default=None, help="KV pool size when no budget is given (default: engine's)")
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--block-size", type=int, default=None)
    e.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's choice)")
    e.add_argument("--slo-ttft-s", type=float, default=None)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of prompt prefixes seen before (default: on, as in vLLM)")
    e.add_argument("--prefix-cache-across-morph", default=None, choices=["exact", "preserve"],
                   help="after a layer changes precision, serve cached prefixes only under the configuration that "
                        "computed them (exact, the default) or under any (preserve); see docs/morphing.md")
    e.add_argument("--memory-floor", default=None, metavar="SIZE",
                   help="yield: below this much free memory outside the engine (NVML on CUDA, the host on CPU) quantize "
                        "layers and give the bytes back; 0 arms only the system port's /engine/control/memory_yield control "
                        "(default: off; see docs/memory-yield.md)")
    e.add_argument("--memory-reclaim-mark", default=None, metavar="SIZE",
                   help="take yielded bytes back only while this much stays free after (default: the floor)")
    e.add_argument("--memory-pressure-source", default=None, choices=["auto", "nvml", "host", "none"],
                   help="where outside free memory is read (default auto: NVML on CUDA, the host on CPU)")
    e.add_argument("--policy", action="append", default=[], metavar="KEY=VALUE",
                   help="override a morph policy field, e.g. --policy kv_high=0.8 (repeatable)")
    e.add_argument("--default-max-tokens", type=int, default=256, help="when a request sets no max_tokens")
    d = p.add_argument_group("dynamo")
    d.add_argument("--served-model-name", default=DEFAULT_MODEL_NAME, help="the model name clients use")
    d.add_argument("--namespace", default=os.environ.get("DYN_NAMESPACE", "dynamo"))
    d.add_argument("--component", default="morphserve")
    d.add_argument("--endpoint", default="generate")
    d.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "file"),
                   choices=["file", "etcd", "kubernetes", "mem"])
    d.add_argument("--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "tcp"), choices=["tcp", "nats"])
    d.add_argument("--event-plane", default=os.environ.get("DYN_EVENT_PLANE", "zmq"), choices=["zmq", "nats"])
    d.add_argument("--model-card-dir", default=None,
                   help="where to write the tokenizer directory the frontend reads; every worker of a model must use "
                        "the same path (default: <tmp>/morphserve-dynamo-card-<served model name>)")
    d.add_argument("--log-level", default="info")
    return p



_ENGINE_FIELDS = ("model", "morph_mode", "device_memory", "num_kv_blocks", "kv_cache_memory", "max_num_seqs",
                  "max_num_batched_tokens", "max_model_len", "block_size", "num_threads", "slo_ttft_s",
                  "enable_prefix_caching", "prefix_cache_across_morph", "memory_floor", "memory_reclaim_mark",
                  "memory_pressure_source")


def parse_worker_args(argv: list[str] | None = None) -> WorkerOptions:
    """Parse and validate (EngineConfig raises ValueError on a bad value, before any model is loaded)."""
    args = build_parser().parse_args(argv)
    kwargs = {f: getattr(args, f) for f in _ENGINE_FIELDS if getattr(args, f) is not None}
    kwargs["policy_overrides"] = parse_policy_overrides(args.policy)
    if args.default_max_tokens <= 0:
        raise ValueError(f"--default-max-tokens must be positive, got {args.default_max_tokens}")
    return WorkerOptions(
        engine=EngineConfig(**kwargs), served_model_name=args.served_model_name, namespace=args.namespace,
        component=args.component, endpoint=args.endpoint, discovery_backend=args.discovery_backend,
        request_plane=args.request_plane, event_plane=args.event_plane, model_card_dir=args.model_card_dir,
        default_max_tokens=args.default_max_tokens, log_level=args.log_level,
    )


def yield_request_bytes(body: dict[str, Any]) -> int:
    """``{"size": "512MiB"}`` or ``{"bytes": 536870912}`` -> bytes; ValueError naming what is wrong."""
    if not isinstance(body, dict) or ("size" in body) == ("bytes" in body):
        raise ValueError('memory_yield takes exactly one of {"size": "512MiB"} or {"bytes": N}')
    if "size" in body:
        if not isinstance(body["size"], str):
            raise ValueError(f'memory_yield "size" must be a string such as "512MiB", got {body["size"]!r}')
        return parse_size(body["size"])
    value = body["bytes"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f'memory_yield "bytes" must be an integer >= 0, got {value!r}')
    return value
