"""config.pbtxt parameters -> EngineConfig keyword arguments (typed, validated, paths resolved)."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

from serve.config import without_none


@dataclasses.dataclass(frozen=True)
class ServerParams:
    """The knobs the Triton model itself owns (everything else in config.pbtxt is an EngineConfig field)."""

    max_tokens_limit: int = 4096   # requests asking for more tokens are rejected
    default_max_tokens: int = 16   # when a request gives none (the model passes SamplingParams' default)
    poll_interval_s: float = 0.02  # cancellation checks and gauge refreshes
    log_level: str = "info"
    max_prompt_bytes: int = 256 * 1024  # InputLimits (serve/triton/request_inputs.py)
    max_list_items: int = 64
    # The operator's controls (memory yield / reclaim, drain) on this loopback port, served by the model
    # (serve/triton/operator_port.py); 0: none. The request lifecycle's knobs (queue_timeout_s, shed_on_arrival,
    # request_timeout_s, max_num_waiting) are EngineConfig fields: the engine decides them.
    operator_port: int = 0
    # Where the operator port listens: 127.0.0.1, or another address only with the operator key set
    # (TRTLLM_RUNTIME_CONTROL_API_KEY in the server's environment; serve/operator_auth.py).
    operator_host: str = "127.0.0.1"

    @classmethod
    def from_params(cls, params: dict[str, str], default_max_tokens: int) -> ServerParams:
        """Typed values from config.pbtxt strings ("" = the default here); ValueError names a bad one."""
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {"default_max_tokens": default_max_tokens}
        for f in dataclasses.fields(cls):
            raw = params.get(f.name, "")
            if raw != "":
                kwargs[f.name] = _coerce(raw, hints[f.name], f.name)
        out = cls(**kwargs)
        if min(out.max_tokens_limit, out.default_max_tokens, out.poll_interval_s, out.max_prompt_bytes,
               out.max_list_items) <= 0:
            raise ValueError(f"max_tokens_limit, default_max_tokens, poll_interval_s, max_prompt_bytes and "
                             f"max_list_items must be positive, got {out}")
        if not 0 <= out.operator_port < 65536:
            raise ValueError(f"model parameter operator_port={out.operator_port!r} must be a port number (0: none)")
        return out


# Parameters the Triton model consumes itself rather than passing to EngineConfig.
MODEL_ONLY_PARAMS = {"engine_dir", "max_tokens_limit", "default_max_tokens", "poll_interval_s", "log_level",
                     "max_prompt_bytes", "max_list_items", "operator_port", "operator_host", "llmapi_config"}
# config.pbtxt parameter -> EngineConfig field, where the names differ.
# enable_kv_cache_reuse is tensorrtllm_backend's name for prefix caching; policy is a JSON object of
# PolicyConfig fields (e.g. {"kv_high": 0.7}), the same overrides as --policy KEY=VALUE.
PARAM_ALIASES = {"engine_dir": "model", "enable_kv_cache_reuse": "enable_prefix_caching",
                 "policy": "policy_overrides"}


def _coerce(raw: str, hint: Any, name: str) -> Any:
    """Convert a config.pbtxt string to the type of an EngineConfig field (``int | None`` etc.)."""
    hint = without_none(hint)
    if hint is dict or typing.get_origin(hint) is dict:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model parameter {name}={raw!r} is not valid JSON ({exc.msg}); "
                             'expected an object such as {"kv_high": 0.7}') from None
        if not isinstance(value, dict):
            raise ValueError(f'model parameter {name}={raw!r} must be a JSON object such as {{"kv_high": 0.7}}')
        return value
    try:
        if hint is bool:
            low = raw.strip().lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return low in ("true", "1", "yes")
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
    except ValueError:
        raise ValueError(f"model parameter {name}={raw!r} is not a valid {getattr(hint, '__name__', hint)}") from None
    return raw


def engine_config_kwargs(params: dict[str, str], config_cls: type, repo_root: Path) -> tuple[dict[str, Any], list[str]]:
    """Map config.pbtxt parameters onto ``config_cls`` fields; empty strings mean "engine default".

    Returns (kwargs, ignored parameter names). Relative paths in engine_dir are resolved against the
    repository root so the server does not depend on its working directory.
    """
    hints = typing.get_type_hints(config_cls)
    fields = {f.name for f in dataclasses.fields(config_cls)}
    kwargs: dict[str, Any] = {}
    ignored: list[str] = []
    for key, raw in params.items():
        field = PARAM_ALIASES.get(key, key)
        if raw == "" or (key in MODEL_ONLY_PARAMS and key not in PARAM_ALIASES):
            continue
        if field not in fields:
            ignored.append(key)
            continue
        value = _coerce(raw, hints.get(field, str), key)
        if field == "model" and isinstance(value, str):
            p = Path(value).expanduser()
            if not p.is_absolute() and (repo_root / p).exists():
                value = str(repo_root / p)
        kwargs[field] = value
    return kwargs, ignored


def validate_params(params: dict[str, str]) -> None:
    """Raise ValueError naming the first bad value among a morphserve model's parameters (server knobs,
    EngineConfig fields, the policy JSON), as the model's initialize() would, without loading anything."""
    from serve.config import EngineConfig  # noqa: PLC0415 - pure (dataclass + policy presets)

    ServerParams.from_params(params, default_max_tokens=1)  # 1: a placeholder, only given values are checked
    kwargs, _ = engine_config_kwargs(params, EngineConfig, Path.cwd())
    EngineConfig(**kwargs)
