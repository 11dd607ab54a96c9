"""Command line of ``python -m serve.dynamo`` (one worker): engine options -> EngineConfig, Dynamo options.

No Dynamo import here, so ``--help`` and the tests of this parsing run anywhere.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from serve.config import EngineConfig, parse_policy_overrides
from serve.config_flags import add_engine_flags, engine_kwargs
from serve.model.embedded import EMBEDDED_MODEL

DEFAULT_MODEL_NAME = "morphserve"
DEFAULT_QUEUE_TIMEOUT_S = 30.0  # as the Triton model's config.pbtxt: load is shed at the defaults (docs/hardening.md)
DEFAULT_MAX_NUM_WAITING = 256
ENGINE_FIELDS = ("model", "morph_mode", "device", "dtype", "device_memory", "num_kv_blocks", "kv_cache_memory",
                 "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_threads", "slo_ttft_s",
                 "scheduler", "enable_prefix_caching", "prefix_cache_across_morph", "memory_floor",
                 "memory_reclaim_mark", "memory_pressure_source", "queue_timeout_s", "shed_on_arrival",
                 "request_timeout_s", "max_num_waiting", "kv_cache_dtype",
                 "speculation", "quality_meter")
"""The EngineConfig fields a worker's command line sets (serve/config_flags.py turns them into flags)."""


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
                                description="One MorphServe engine as an NVIDIA Dynamo worker (token ids in, token ids "
                                            "out).")
    e = p.add_argument_group("engine")
    add_engine_flags(e, ENGINE_FIELDS, defaults={"model": EMBEDDED_MODEL, "morph_mode": "default",
                                                 "queue_timeout_s": DEFAULT_QUEUE_TIMEOUT_S,
                                                 "max_num_waiting": DEFAULT_MAX_NUM_WAITING})
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



def parse_worker_args(argv: list[str] | None = None) -> WorkerOptions:
    """Parse and validate (EngineConfig raises ValueError on a bad value, before any model is loaded)."""
    args = build_parser().parse_args(argv)
    kwargs = engine_kwargs(args, ENGINE_FIELDS)
    kwargs["policy_overrides"] = parse_policy_overrides(args.policy)
    if args.default_max_tokens <= 0:
        raise ValueError(f"--default-max-tokens must be positive, got {args.default_max_tokens}")
    return WorkerOptions(
        engine=EngineConfig(**kwargs), served_model_name=args.served_model_name, namespace=args.namespace,
        component=args.component, endpoint=args.endpoint, discovery_backend=args.discovery_backend,
        request_plane=args.request_plane, event_plane=args.event_plane, model_card_dir=args.model_card_dir,
        default_max_tokens=args.default_max_tokens, log_level=args.log_level,
    )
