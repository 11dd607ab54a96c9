"""The model repository: config.pbtxt parameters read and filled, and a private rendered copy per server.

Overrides are applied by rendering a copy of the model's config.pbtxt into a private repository whose
version folders are symlinks to the originals, so the source tree is never modified.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from serve.triton.install import TritonLaunchError

DEFAULT_MODEL_NAME = "morphserve"
# TensorRT-LLM's user-facing names, served by thin BLS models over the engine model.
TRTLLM_MODEL_NAMES = ("ensemble", "tensorrt_llm_bls")


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


def render_model_repository(src: Path, dest: Path, model_name: str, overrides: Mapping[str, object],
                            also: tuple[str, ...] = ()) -> Path:
    """Make ``dest/<model_name>`` a copy of ``src/<model_name>`` with parameter overrides applied, and
    ``dest/<name>`` a link to ``src/<name>`` for each model in ``also``.

    Only config.pbtxt is written; everything else (version folders, model.py) is symlinked so the
    server runs the source tree's code.
    """
    for name in also:
        link = dest / name
        if not link.exists():
            dest.mkdir(parents=True, exist_ok=True)
            link.symlink_to((src / name).resolve())
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
    return dest


# Lines of a model.py that let a plain checkout import the project; a written repository drops them.
CHECKOUT_FALLBACK_MARK = "checkout-fallback"
SERVED_MODELS = (DEFAULT_MODEL_NAME, *TRTLLM_MODEL_NAMES)


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
                     models: tuple[str, ...] = SERVED_MODELS) -> list[Path]:
    """Write a self-contained model repository to ``dest`` (which must not exist or be empty): each
    model's config.pbtxt with ``overrides`` filled (engine_dir made absolute) and plain copies of its
    version folders, model.py without the checkout fallback, so its imports resolve to the installed
    ``morphserve`` package. Returns the files written."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise TritonLaunchError(f"{dest} exists and is not empty; choose a new directory")
    filled = _absolute_paths(overrides)
    written: list[Path] = []
    for name in models:
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
    unused = sorted(set(filled) - {k for n in models for k in read_config_parameters((src / n / "config.pbtxt").read_text())})
    if unused:
        raise TritonLaunchError(f"unknown model parameter(s) {unused}")
    return written
