"""The model repository: config.pbtxt parameters read and filled, and a private rendered copy per server.

Overrides are applied by rendering a copy of the model's config.pbtxt into a private repository whose
version folders are symlinks to the originals, so the source tree is never modified.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path

from serve.triton.install import TritonLaunchError
from serve.triton.llmapi_config import BlsSettings, LlmApiConfig, ModelYamlError, overlay_model_yaml, parse_model_yaml

DEFAULT_MODEL_NAME = "morphserve"
# TensorRT-LLM's LLM-API model (its one Triton model today), a thin BLS model over the engine model.
LLMAPI_MODEL_NAME = "tensorrt_llm"
# TensorRT-LLM's legacy inflight_batcher_llm names (removed upstream in 2026; kept for older clients).
TRTLLM_MODEL_NAMES = ("ensemble", "tensorrt_llm_bls")
FRONT_MODEL_NAMES = (LLMAPI_MODEL_NAME, *TRTLLM_MODEL_NAMES)
LLMAPI_CONFIG_PARAM = "llmapi_config"
LLMAPI_YAML = f"../{LLMAPI_MODEL_NAME}/1/model.yaml"
"""Where the engine model finds the LLM-API model's model.yaml, from its own directory."""


REPO_ROOT = Path(__file__).resolve().parents[2]


DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "triton_models"


_PARAM_RE = re.compile(
    r'(key\s*:\s*"(?P<key>[^"]+)"\s*value\s*:\s*\{\s*string_value\s*:\s*")(?P<value>(?:[^"\\]|\\.)*)(")',
    re.MULTILINE,
)


def read_config_parameters(config_text: str) -> dict[str, str]:
    """The ``parameters { key: "..." value: { string_value: "..." } }`` entries of a config.pbtxt."""
    return {m.group("key"): _unescape(m.group("value")) for m in _PARAM_RE.finditer(config_text)}


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"')


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", r"\1", v)


def fill_config_parameters(config_text: str, overrides: Mapping[str, object]) -> str:
    """Return ``config_text`` with the string values of the named parameters replaced.

    Only parameters already declared in the config can be overridden, so that a typo (``max_num_seq``)
    fails loudly instead of being silently ignored by the model.
    """
    known = read_config_parameters(config_text)
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise TritonLaunchError(f"unknown model parameter(s) {unknown}; the model declares {sorted(known)}")
    values = {k: _param_str(v) for k, v in overrides.items()}

    def sub(m: re.Match[str]) -> str:
        key = m.group("key")
        if key not in values:
            return m.group(0)
        return m.group(1) + _escape(values[key]) + m.group(4)

    return _PARAM_RE.sub(sub, config_text)


def _param_str(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    return str(v)


def _with_llmapi(overrides: Mapping[str, object], models: tuple[str, ...]) -> dict[str, object]:
    """``overrides`` with the engine model pointed at the LLM-API model's model.yaml when that model is served."""
    out = dict(overrides)
    if LLMAPI_MODEL_NAME in models:
        out.setdefault(LLMAPI_CONFIG_PARAM, LLMAPI_YAML)
    return out


def _transaction_policy(config_text: str, decoupled: bool) -> str:
    """config.pbtxt with its model_transaction_policy set (as upstream's CI writes it from model.yaml)."""
    policy = f"model_transaction_policy {{\n  decoupled: {str(decoupled).lower()}\n}}"
    block = re.compile(r"model_transaction_policy\s*\{[^}]*\}")
    return block.sub(policy, config_text, count=1) if block.search(config_text) else config_text + "\n" + policy + "\n"


def engine_settings(overrides: Mapping[str, object]) -> dict[str, object]:
    """A launcher's parameter overrides -> the EngineConfig settings they make (field -> typed value; None where a
    parameter is set to "" = the engine's default). Server knobs (max_tokens_limit, ...) are not engine settings."""
    from serve.config import EngineConfig  # noqa: PLC0415 - a dataclass (the parameters' types)
    from serve.triton.model_params import MODEL_ONLY_PARAMS, PARAM_ALIASES, engine_config_kwargs  # noqa: PLC0415

    strings = {k: _param_str(v) for k, v in overrides.items()}
    typed, _ = engine_config_kwargs(strings, EngineConfig, REPO_ROOT)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    cleared = {PARAM_ALIASES.get(k, k): None for k, v in strings.items() if v == ""
               and (k not in MODEL_ONLY_PARAMS or k in PARAM_ALIASES) and PARAM_ALIASES.get(k, k) in fields}
    return {**cleared, **typed}


def llmapi_config_of(model_dir: Path) -> LlmApiConfig:
    """The LLM-API model's model.yaml in ``model_dir`` (``<repository>/tensorrt_llm``), parsed; TritonLaunchError
    naming the bad key."""
    from serve.config import EngineConfig  # noqa: PLC0415

    path = model_dir / "1" / "model.yaml"
    try:
        return parse_model_yaml(path.read_text(), tuple(f.name for f in dataclasses.fields(EngineConfig)))
    except (OSError, ModelYamlError) as exc:
        raise TritonLaunchError(f"{path}: {exc}") from None


def write_llmapi_model(src: Path, dest: Path, engine: Mapping[str, object], bls: BlsSettings | None,
                       copy_code: bool) -> list[Path]:
    """``dest/tensorrt_llm`` from ``src/tensorrt_llm``: 1/model.yaml with ``engine`` (the settings a launcher
    made, :func:`engine_settings`) and ``bls`` (when given) written over the source's, config.pbtxt with the
    transaction policy model.yaml ends up with (as upstream's CI writes it), and 1/model.py (a link to the source,
    or a copy without the checkout fallback). Returns the files written; TritonLaunchError names a bad key."""
    src_model, out = src / LLMAPI_MODEL_NAME, dest / LLMAPI_MODEL_NAME
    (out / "1").mkdir(parents=True, exist_ok=True)
    llmapi_config_of(src_model)  # the source must be valid before anything is written over it
    written = [out / "config.pbtxt", out / "1" / "model.yaml", out / "1" / "model.py"]
    written[1].write_text(overlay_model_yaml((src_model / "1" / "model.yaml").read_text(), engine, bls))
    written[0].write_text(_transaction_policy((src_model / "config.pbtxt").read_text(),
                                              llmapi_config_of(out).bls.decoupled))
    code = src_model / "1" / "model.py"
    if copy_code:
        written[2].write_text("".join(ln for ln in code.read_text().splitlines(keepends=True)
                                      if CHECKOUT_FALLBACK_MARK not in ln))
    elif not written[2].exists():
        written[2].symlink_to(code.resolve())
    return written


def render_model_repository(src: Path, dest: Path, model_name: str, overrides: Mapping[str, object],
                            also: tuple[str, ...] = (), llmapi: BlsSettings | None = None) -> Path:
    """Make ``dest/<model_name>`` a copy of ``src/<model_name>`` with parameter overrides applied, and
    ``dest/<name>`` a link to ``src/<name>`` for each model in ``also``; the LLM-API model (``tensorrt_llm``) is
    written from its own model.yaml with the engine settings of ``overrides`` and ``llmapi`` (when given) over it
    (:func:`write_llmapi_model`).

    Only config.pbtxt (and the LLM-API model's model.yaml) is written; everything else (version folders,
    model.py) is symlinked so the server runs the source tree's code.
    """
    for name in also:
        link = dest / name
        if name != LLMAPI_MODEL_NAME and not link.exists():
            dest.mkdir(parents=True, exist_ok=True)
            link.symlink_to((src / name).resolve())
    if model_name == DEFAULT_MODEL_NAME:
        overrides = _with_llmapi(overrides, also)
    src_model = src / model_name
    cfg = src_model / "config.pbtxt"
    if not cfg.is_file():
        raise TritonLaunchError(f"{cfg} does not exist (model repository {src}, model {model_name!r})")
    out = dest / model_name
    out.mkdir(parents=True, exist_ok=True)
    for entry in src_model.iterdir():
        if entry.name == "config.pbtxt" or entry.name.startswith(".") or entry.name == "__pycache__":
            continue
        link = out / entry.name
        if not link.exists():
            link.symlink_to(entry.resolve())
    (out / "config.pbtxt").write_text(fill_config_parameters(cfg.read_text(), overrides))
    if LLMAPI_MODEL_NAME in also and model_name == DEFAULT_MODEL_NAME:
        write_llmapi_model(src, dest, engine_settings(overrides), llmapi, copy_code=False)
    return dest


# Lines of a model.py that let a plain checkout import the project; a written repository drops them.
CHECKOUT_FALLBACK_MARK = "checkout-fallback"
SERVED_MODELS = (DEFAULT_MODEL_NAME, *FRONT_MODEL_NAMES)


def _absolute_paths(overrides: Mapping[str, object]) -> dict[str, object]:
    """engine_dir given as a relative path (to the working directory or the checkout) -> absolute, so
    the written repository does not depend on where it is started from."""
    out = dict(overrides)
    raw = out.get("engine_dir")
    if isinstance(raw, (str, os.PathLike)) and str(raw):
        for base in (Path.cwd(), REPO_ROOT):
            p = (base / Path(raw).expanduser())
            if p.exists():
                out["engine_dir"] = str(p.resolve())
                break
    return out


def write_repository(dest: Path, overrides: Mapping[str, object], src: Path = DEFAULT_MODEL_REPOSITORY,
                     models: tuple[str, ...] = SERVED_MODELS, llmapi: BlsSettings | None = None) -> list[Path]:
    """Write a self-contained model repository to ``dest`` (which must not exist or be empty): each
    model's config.pbtxt with ``overrides`` filled (engine_dir made absolute) and plain copies of its
    version folders, model.py without the checkout fallback, so its imports resolve to the installed
    ``morphserve`` package. Returns the files written."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise TritonLaunchError(f"{dest} exists and is not empty; choose a new directory")
    filled = _with_llmapi(_absolute_paths(overrides), models)
    written: list[Path] = []
    for name in models:
        if name == LLMAPI_MODEL_NAME:
            continue  # written from the engine model's parameters, below
        model_src = src / name
        cfg = model_src / "config.pbtxt"
        if not cfg.is_file():
            raise TritonLaunchError(f"{cfg} does not exist (model repository {src}, model {name!r})")
        known = read_config_parameters(cfg.read_text())
        mine = {k: v for k, v in filled.items() if k in known}
        (dest / name).mkdir(parents=True, exist_ok=True)
        written.append(dest / name / "config.pbtxt")
        written[-1].write_text(fill_config_parameters(cfg.read_text(), mine))
        for path in sorted(model_src.rglob("*")):
            rel = path.relative_to(model_src)
            if path.is_dir() or rel.name == "config.pbtxt" or "__pycache__" in rel.parts or rel.name.startswith("."):
                continue
            out = dest / name / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            text = path.read_text()  # resolves the ensemble's link to the BLS model.py
            if path.suffix == ".py":
                text = "".join(ln for ln in text.splitlines(keepends=True) if CHECKOUT_FALLBACK_MARK not in ln)
            out.write_text(text)
            written.append(out)
    unused = sorted(set(filled)
                    - {k for n in models for k in read_config_parameters((src / n / "config.pbtxt").read_text())})
    if unused:
        raise TritonLaunchError(f"unknown model parameter(s) {unused}")
    if LLMAPI_MODEL_NAME in models:
        if DEFAULT_MODEL_NAME not in models:
            raise TritonLaunchError(f"the {LLMAPI_MODEL_NAME} model serves through the {DEFAULT_MODEL_NAME} model's "
                                    f"engine: write both")
        written += write_llmapi_model(src, dest, engine_settings(_absolute_paths(overrides)), llmapi, copy_code=True)
    return written
