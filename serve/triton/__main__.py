"""``python -m serve.triton``: start tritonserver on 127.0.0.1 with the MorphServe model (``--help``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from serve.config import EMBEDDED_MODEL, parse_policy_overrides
from serve.config_flags import add_engine_flags, engine_kwargs
from serve.logging_setup import configure_logging, get_logger
from serve.triton.client_apis import OPENABLE
from serve.triton.grpc_front import DEFAULT_MAX_MESSAGE_BYTES
from serve.triton.http_body import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_JSON_DEPTH,
)
from serve.triton.http_front import FrontOptions
from serve.triton.install import TritonLaunchError
from serve.triton.llmapi_config import BlsSettings
from serve.triton.model_params import validate_params
from serve.triton.repository import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_REPOSITORY,
    LLMAPI_MODEL_NAME,
    fill_config_parameters,
    llmapi_config_of,
    read_config_parameters,
    write_repository,
)
from serve.triton.server import TritonServer
from serve.triton.supervisor import EXIT_GAVE_UP, RestartPolicy, supervise

log = get_logger("triton_launcher")

ENGINE_FIELDS = ("level", "morph_mode", "device", "dtype", "device_memory", "max_num_seqs", "max_num_batched_tokens",
                 "slo_ttft_s", "scheduler", "queue_timeout_s", "shed_on_arrival", "request_timeout_s",
                 "kv_cache_dtype", "speculation", "quality_meter")
"""EngineConfig fields with a flag of their own (serve/config_flags.py); they land in config.pbtxt parameters.
Any other field: --param KEY=VALUE."""
_DEVICE_MEMORY_HELP = (
    "memory budget for weights + KV cache + reserve: a size (600MiB), on CUDA a fraction (0.9), or auto, "
    "config.pbtxt's default: on CPU the full-precision weights + 16MiB reserve + a KV pool for ONE request of "
    "max_model_len tokens (the dynamic morph modes act once long requests overlap; SmolLM2-135M fp32: ~940MiB), on "
    "CUDA 0.9 of the device; with auto, a num_kv_blocks or kv_cache_memory parameter fixes the KV pool instead")
_QUEUE_TIMEOUT_HELP = ("a request without its first token this many seconds after arrival at the HTTP front end (or at "
                       "the model, over gRPC) is shed: 503 + Retry-After \"overloaded ... retry later\" (default: 30, "
                       "config.pbtxt's; 0: no queue deadline)")
_PARAM_FLAGS: dict[str, tuple[str, type, str]] = {
    "max_tokens_limit": ("--max-tokens-limit", int, "largest max_tokens a request may ask for"),
}
"""The Triton model's own parameters (ServerParams) with a flag."""


def _env_port(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a port number") from None


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m serve.triton",
        description=(
            "Serve the MorphServe model with the tritonserver bundled in nvidia-pytriton, on 127.0.0.1 "
            "only. Prints one line when the model is ready (with a curl example) and shuts the server "
            "down cleanly on Ctrl-C or SIGTERM. Triton's log and the model's JSON log lines go to "
            "--server-log."
        ),
        epilog=(
            "Endpoints: HTTP POST /v2/models/tensorrt_llm/generate and /generate_stream (TensorRT-LLM's LLM-API "
            "model: text_input, sampling_param_max_tokens, ..., streaming; its model.yaml is written from the flags "
            "below), the same engine as /v2/models/morphserve/... (JSON keys: text_input, max_tokens, temperature, "
            "top_p, top_k, seed, stop, stream, and TensorRT-LLM's inputs) and as TensorRT-LLM's legacy models "
            "ensemble and tensorrt_llm_bls ([1, 1] tensors); gRPC streaming "
            "(python -m serve.triton.client); Prometheus text on the metrics port (/metrics, morphserve_* "
            "and nv_* families). Ports default to $HTTP_PORT, $GRPC_PORT, $METRICS_PORT, then "
            "8000/8001/8002, and the operator port ($OPERATOR_PORT, 8003; loopback only) serves the engine's "
            "controls (memory yield / reclaim, drain); 0 picks a free port."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY, help="Triton model repository")
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help="model to load from the repository")
    p.add_argument(
        "--engine-dir",
        default=None,
        help=f"engine directory, GGUF file, HF directory, or {EMBEDDED_MODEL!r} (embedded default); "
        "overrides the engine_dir parameter of config.pbtxt",
    )
    p.add_argument("--http-port", type=int, default=_env_port("HTTP_PORT", 8000), help="HTTP port")
    p.add_argument("--grpc-port", type=int, default=_env_port("GRPC_PORT", 8001), help="gRPC port")
    p.add_argument("--metrics-port", type=int, default=_env_port("METRICS_PORT", 8002), help="metrics port")
    p.add_argument("--operator-port", type=int, default=_env_port("OPERATOR_PORT", 8003),
                   help="operator port, 127.0.0.1 only: POST /engine/control/{memory_yield,memory_reclaim,drain,"
                        "resume,state}, what the inference ports refuse (docs/memory-yield.md, docs/hardening.md)")
    add_engine_flags(p, ENGINE_FIELDS, help_suffix=" (parameter {field})",
                     help_overrides={"device_memory": _DEVICE_MEMORY_HELP, "queue_timeout_s": _QUEUE_TIMEOUT_HELP})
    for key, (flag, typ, help_) in _PARAM_FLAGS.items():
        p.add_argument(flag, dest=key, type=typ, default=None, help=f"{help_} (parameter {key})")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any other config.pbtxt parameter (repeatable), e.g. --param max_model_len=2048",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a morph controller threshold of the mode's preset (a PolicyConfig field, policy/modes.py), "
        "e.g. --policy kv_high=0.7 --policy cost_aware=false (repeatable; values are read as JSON where they "
        "parse, ladder also as int8,int4); merged over the JSON object in config.pbtxt's policy parameter. A "
        "bad key or value is refused before the server starts",
    )
    p.add_argument("--llmapi-decoupled", choices=["true", "false"], default=None,
                   help="the tensorrt_llm model's transaction policy (model.yaml triton_config.decoupled and "
                        "config.pbtxt): true streams (and serves gRPC streams only), false answers unary calls "
                        "(ModelInfer) and refuses streaming, as upstream's model with decoupled: false (default: as "
                        "the repository's model.yaml says; the shipped one: true)")
    p.add_argument("--stop-by-request-id", choices=["true", "false"], default=None,
                   help="the tensorrt_llm model's stop input: a request with stop=true ends the in-flight request of "
                        "the same client-chosen request id (model.yaml morphserve.stop_by_request_id; "
                        "docs/hardening.md has the trust model; default: as the repository's model.yaml says, the "
                        "shipped one: true)")
    p.add_argument(
        "--write-repository",
        type=Path,
        default=None,
        metavar="DIR",
        help="do not start a server: write a self-contained model repository (morphserve, tensorrt_llm with its "
        "model.yaml, the legacy ensemble and tensorrt_llm_bls; config.pbtxt filled from the flags above, model.py "
        "importing the installed morphserve package) to DIR for a Triton container, then exit",
    )
    p.add_argument("--server-log", type=Path, default=None, help="file for the server's output (default: a temp file)")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.add_argument("--log-level", default="warning",
                   help="level of the launcher's own JSON log on stderr (info adds start/stop events)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the model to load")
    p.add_argument(
        "--allow-repository-api",
        action="store_true",
        help="open Triton's model repository API (load/unload) to clients: DANGEROUS, any local process "
        "can then load a Python model that runs as this user (see README, Hardening)",
    )
    p.add_argument("--client-api", action="append", default=[], choices=OPENABLE, metavar="API",
                   help="open one more of Triton's APIs to clients on the HTTP and gRPC ports (repeatable: "
                        f"{', '.join(OPENABLE)}); closed by default: only inference, health, metadata and statistics "
                        "are open (docs/hardening.md)")
    p.add_argument("--grpc-max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="the gRPC front end refuses larger messages at the transport (RESOURCE_EXHAUSTED) before "
                        "reading "
                        "them")
    p.add_argument("--drain-timeout", type=int, default=30,
                   help="seconds tritonserver lets in-flight requests finish after SIGTERM (--exit-timeout-secs)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restart a dead tritonserver (also one killed during its first load) at most this many times "
                   "within --restart-window seconds (0: never); past it the launcher says why and exits with status 3")
    p.add_argument("--restart-window", type=float, default=600.0,
                   help="seconds over which --max-restarts is counted (a rate: restarts older than this are forgotten)")
    p.add_argument("--restart-backoff", type=float, default=1.0,
                   help="seconds before the first restart; doubles with each restart in the window up to 30")
    p.add_argument("--http-max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="the HTTP front end refuses larger request bodies with 413 before reading them")
    p.add_argument("--http-max-json-depth", type=int, default=DEFAULT_MAX_JSON_DEPTH,
                   help="the HTTP front end refuses JSON bodies nested deeper with 400 before tritonserver sees them")
    p.add_argument("--http-max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="connections the HTTP front end keeps open at once; one more is answered 503 + Retry-After and "
                        "closed")
    p.add_argument("--http-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a connection has to send a complete request head (after opening, or after its last "
                        "response); a slower one is closed")
    p.add_argument("--http-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds a request has to send its whole body after its head; a slower one gets 408 and is "
                        "closed")
    p.add_argument(
        "--gpu",
        choices=["auto", "yes", "no"],
        default="auto",
        help="'no' hides GPUs (CUDA_VISIBLE_DEVICES=) and disables GPU metrics and CUDA pools",
    )
    p.add_argument(
        "extra",
        nargs=argparse.REMAINDER,
        help="after `--`: extra tritonserver flags passed through verbatim",
    )
    return p


def params_from_args(args: argparse.Namespace) -> dict[str, object]:
    """config.pbtxt overrides gathered from the CLI flags."""
    params: dict[str, object] = {}
    if args.engine_dir is not None:
        params["engine_dir"] = args.engine_dir
    params.update(engine_kwargs(args, (*ENGINE_FIELDS, *_PARAM_FLAGS)))
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--param expects KEY=VALUE, got {item!r}")
        params[key.strip()] = value
    if args.policy:
        try:
            overrides = parse_policy_overrides(args.policy)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        base = params.get("policy")
        if base is None:
            cfg = Path(args.model_repository) / args.model_name / "config.pbtxt"
            base = read_config_parameters(cfg.read_text()).get("policy", "") if cfg.is_file() else ""
        try:
            merged = json.loads(str(base)) if str(base).strip() else {}
        except json.JSONDecodeError:
            raise SystemExit(f"the policy parameter {base!r} is not a JSON object; --policy cannot merge into "
                             "it") from None
        if not isinstance(merged, dict):
            raise SystemExit(f"the policy parameter {base!r} is not a JSON object; --policy cannot merge into it")
        params["policy"] = json.dumps({**merged, **overrides})
    return params


def check_params(params: dict[str, object], repository: Path, model_name: str) -> None:
    """Refuse a bad parameter (ValueError or TritonLaunchError naming it) before tritonserver starts: the
    model's config.pbtxt values with ``params`` filled in, checked as the model's initialize() checks them."""
    cfg = Path(repository) / model_name / "config.pbtxt"
    if not cfg.is_file():
        return  # the server (or write_repository) reports the missing model
    merged = read_config_parameters(fill_config_parameters(cfg.read_text(), params))
    if "engine_dir" in merged:  # a MorphServe engine model (not a BLS bls)
        validate_params(merged)


def curl_example(srv: TritonServer) -> str:
    """A one-line curl command that exercises the generate endpoint (upstream's LLM-API model when it is served)."""
    if LLMAPI_MODEL_NAME in srv.also_load:
        body = json.dumps({"text_input": "What is ML?", "sampling_param_max_tokens": 50})
        return f"curl -s -X POST http://{srv.http_url}/v2/models/{LLMAPI_MODEL_NAME}/generate -d '{body}'"
    body = json.dumps({"text_input": "The capital of France is", "max_tokens": 16})
    return f"curl -s -X POST http://{srv.http_url}/v2/models/{srv.model_name}/generate -d '{body}'"


def llmapi_settings(args: argparse.Namespace) -> BlsSettings | None:
    """The tensorrt_llm model's settings the flags make over its model.yaml's; None when no flag is given."""
    if args.llmapi_decoupled is None and args.stop_by_request_id is None:
        return None
    base = llmapi_config_of(Path(args.model_repository) / LLMAPI_MODEL_NAME).bls
    return dataclasses.replace(base, **{k: v == "true" for k, v in (("decoupled", args.llmapi_decoupled),
                                                                  ("stop_by_request_id", args.stop_by_request_id))
                                        if v is not None})


class _Terminate(Exception):
    """Raised from the SIGTERM handler to unwind the CLI's wait loop."""


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    extra = [a for a in args.extra if a != "--"]
    params = params_from_args(args)
    try:
        check_params(params, args.model_repository, args.model_name)
        front_options = FrontOptions(args.http_max_body_bytes, args.http_max_json_depth, args.http_max_connections,
                                     args.http_header_timeout, args.http_body_timeout)
        if args.grpc_max_message_bytes <= 0:
            raise ValueError(f"--grpc-max-message-bytes must be positive, got {args.grpc_max_message_bytes}")
    except (ValueError, TritonLaunchError) as e:
        sys.stderr.write(f"morphserve: invalid configuration: {e}\n")
        return 2
    if args.write_repository is not None:
        try:
            files = write_repository(args.write_repository, params, src=args.model_repository,
                                     llmapi=llmapi_settings(args))
        except TritonLaunchError as e:
            sys.stderr.write(f"morphserve: {e}\n")
            return 1
        sys.stdout.write(f"wrote {len(files)} files to {args.write_repository}; serve it with: tritonserver "
                         f"--model-repository={args.write_repository.resolve()} (the Python backend's "
                         "python3 must have morphserve installed)\n")
        return 0
    srv = TritonServer(
        args.model_repository,
        args.model_name,
        params=params,
        http_port=args.http_port or None,
        grpc_port=args.grpc_port or None,
        metrics_port=args.metrics_port or None,
        operator_port=args.operator_port or None,
        log_path=args.server_log,
        log_verbose=args.log_verbose,
        use_gpu={"auto": None, "yes": True, "no": False}[args.gpu],
        extra_args=extra,
        keep_log=True,
        repository_api=args.allow_repository_api,
        exit_timeout_s=args.drain_timeout,
        front_options=front_options,
        client_apis=args.client_api,
        grpc_max_message_bytes=args.grpc_max_message_bytes,
        llmapi=llmapi_settings(args),
    )
    if args.allow_repository_api:
        log.warning("repository_api_open", warning="clients can load/unload models, including Python code")

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise _Terminate

    def on_second_signal(signum: int, frame: FrameType | None) -> None:
        # A second Ctrl-C / SIGTERM while shutting down: do not wait for Triton's exit timeout.
        if srv.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(srv.proc.pid, signal.SIGKILL)
        os._exit(130)

    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        signal.signal(signal.SIGTERM, on_sigterm)
    announced: list[bool] = []

    def on_ready(s: TritonServer, restarts: int) -> None:
        if not announced:  # the first time the model is ready (also after a death during the first load)
            announced.append(True)
            sys.stdout.write(
                f"morphserve ready in {s.ready_after_s or 0:.1f}s: http={s.http_url} grpc={s.grpc_url} "
                f"metrics={s.metrics_url} operator=127.0.0.1:{s.operator_port} log={s.log_path} | try: "
                f"{curl_example(s)}\n"
            )
            sys.stdout.flush()

    def on_give_up(reason: str) -> None:
        sys.stderr.write(f"morphserve: giving up (exit status {EXIT_GAVE_UP}): {reason}\n")

    try:
        srv.start()
        policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window,
                               backoff_s=args.restart_backoff, ready_timeout_s=args.ready_timeout)
        return supervise(srv, policy, threading.Event(), on_ready=on_ready, ready=False, on_give_up=on_give_up)
    except TritonLaunchError as e:
        log.error("tritonserver_failed", error=str(e).splitlines()[0], log_path=str(srv.log_path))
        sys.stderr.write(f"morphserve failed to start: {e}\n")
        return 1
    except (KeyboardInterrupt, _Terminate):
        log.info("shutdown_requested")
        srv.drain()  # new HTTP requests and readiness: 503; tritonserver lets in-flight ones finish
        return 0
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, on_second_signal)
            signal.signal(signal.SIGINT, on_second_signal)
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
