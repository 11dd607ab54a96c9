"""The engine directory: the contract between ``python -m builder`` (writes) and ``serve`` (reads).

Layout of ``engines/<model>/``::

    manifest.json                 written last; its presence means every file it lists is complete
    config.json                   transformers LlamaConfig dict (ModelConfig.to_hf_dict())
    tokenizer.json, tokenizer_config.json
    full/model.safetensors        full-precision fp32 weights, Hugging Face names
    layers/layer_{i:03d}.{precision}.safetensors
                                  runtime tensors of layer i's q/k/v/o/gate/up/down at one precision:
                                  key "<proj>.<tensor>" from QuantizedLinear.tensors(); safetensors
                                  metadata "projs" = JSON {proj: QuantizedLinear.metadata()}
    profile.json                  layer importance (LTS/LRS/MDS/LIS per layer per round) and orders
    hf/full/                      the full model as a modelopt unified Hugging Face checkpoint (manifest "hf"."full")
    hf/levels/<level>/            one unified checkpoint per morph level (builder/hf_export.py: model.safetensors,
                                  config.json with quantization_config, hf_quant_config.json, tokenizer files), e.g.
                                  int4-25 = the first 25 % of the swap order at int4. Manifest "levels": "entries"
                                  maps a level name (builder/levels.py, e.g. "int4@25") to its segments and
                                  {layer: precision}, the modes that reach it, the checkpoint dir, quant_algo and
                                  files, its stored bytes, the bytes it frees against hf/full and the KV blocks they
                                  buy under "budget" (block size, KV dtype, bytes per block)
    trtllm/                       only with --legacy-trtllm: legacy TensorRT-LLM checkpoints (per precision, full
                                  precision, per level; manifest "trtllm") and their build_commands.sh

Builds are atomic: everything is written into a hidden staging sibling, the manifest last, and the
staging directory is renamed into place (an older engine directory is moved aside first and deleted
only after the new one is in place). So a directory holding a manifest never points at missing or
partial files, whatever point a build is interrupted at.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from serve.model.layers import PROJECTIONS
from serve.model.loader import LoadedModel, load_model
from serve.model.model_config import ModelConfig
from serve.model.quantized_linear import QuantizedLinear, load_quantized_linear
from serve.model.tokenizer import Tokenizer

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PROFILE = "profile.json"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
FULL_WEIGHTS = "full/model.safetensors"
HF_DIR = "hf"
_STAGING_TAG = ".staging-"
_OLD_TAG = ".old-"


class EngineDirError(ValueError):
    """The engine directory is missing, incomplete, corrupt or of an unsupported format version."""


# ----------------------------------------------------------------------------------------- files


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(root: Path, rel: str) -> dict[str, Any]:
    """``{"file", "bytes", "sha256"}`` of ``root/rel`` (``rel`` is stored relative, POSIX style)."""
    path = root / rel
    return {"file": rel, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def layer_file(layer: int, precision: str) -> str:
    return f"layers/layer_{layer:03d}.{precision}.safetensors"


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_model_files(root: Path, model: LoadedModel) -> dict[str, dict[str, Any]]:
    """config.json, tokenizer files (as save_hf_directory writes them) and full/model.safetensors."""
    from safetensors.torch import save_file

    (root / "full").mkdir(parents=True, exist_ok=True)
    write_json(root / CONFIG, model.config.to_hf_dict())
    model.tokenizer.backend.save(str(root / TOKENIZER))
    tok = model.tokenizer
    tok_cfg: dict[str, Any] = {"chat_template": tok.chat_template, "add_bos_token": tok.add_bos,
                               "tokenizer_class": "PreTrainedTokenizerFast"}
    if tok.eos_token_ids:
        tok_cfg["eos_token"] = tok.token_to_str(tok.eos_token_ids[0])
    write_json(root / TOKENIZER_CONFIG, tok_cfg)
    save_file({k: v.detach().float().contiguous() for k, v in model.weights.items()}, str(root / FULL_WEIGHTS),
              metadata={"format": "pt", "dtype": "float32"})
    return {name: file_record(root, name) for name in (CONFIG, TOKENIZER, TOKENIZER_CONFIG, FULL_WEIGHTS)}


def write_layer_variant(root: Path, layer: int, precision: str,
                        linears: Mapping[str, QuantizedLinear]) -> dict[str, Any]:
    """One layer's seven runtime linears at ``precision``; returns its manifest record."""
    from safetensors.torch import save_file

    missing = [p for p in PROJECTIONS if p not in linears]
    if missing:
        raise EngineDirError(f"layer {layer} {precision}: missing projections {missing}")
    tensors: dict[str, torch.Tensor] = {}
    metas: dict[str, dict[str, str]] = {}
    for proj in PROJECTIONS:
        for key, t in linears[proj].tensors().items():
            tensors[f"{proj}.{key}"] = t.detach().cpu().contiguous()
        metas[proj] = linears[proj].metadata()
    rel = layer_file(layer, precision)
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / rel), metadata={
        "format_version": str(FORMAT_VERSION), "layer": str(layer), "precision": precision, "projs": json.dumps(metas),
    })
    record = file_record(root, rel)
    record["runtime_nbytes"] = sum(linears[p].nbytes for p in PROJECTIONS)
    record["formats"] = sorted({m["format"] for m in metas.values()})
    return record


def read_layer_variant(path: Path) -> dict[str, QuantizedLinear]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        metas = json.loads(meta["projs"])
    except Exception as exc:  # noqa: BLE001 - safetensors' SafetensorError derives from Exception only
        raise EngineDirError(f"{path}: unreadable layer file ({type(exc).__name__}: {exc})") from exc
    out: dict[str, QuantizedLinear] = {}
    for proj in PROJECTIONS:
        prefix = proj + "."
        part = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if proj not in metas or not part:
            raise EngineDirError(f"{path}: no tensors for {proj}")
        out[proj] = load_quantized_linear(part, metas[proj])
    return out


# ------------------------------------------------------------------------------------ atomic build


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tagged_siblings(final: Path, tag: str) -> list[tuple[Path, int]]:
    out = []
    for p in final.parent.glob(f".{final.name}{tag}*"):
        try:
            out.append((p, int(p.name[len(final.name) + 1 + len(tag):].split("-")[0])))
        except ValueError:
            continue
    return out


def clean_stale_builds(final: Path) -> list[Path]:
    """Remove staging directories of dead builds; put back an engine dir a dead build moved aside."""
    removed: list[Path] = []
    if not final.parent.is_dir():
        return removed
    for path, pid in _tagged_siblings(final, _OLD_TAG):
        if _pid_alive(pid):
            continue
        if not final.exists() and (path / MANIFEST).is_file():
            os.rename(path, final)
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for path, pid in _tagged_siblings(final, _STAGING_TAG):
        if not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def staging_path(final: Path) -> Path:
    return final.parent / f".{final.name}{_STAGING_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def commit_staging(staging: Path, final: Path) -> None:
    """Rename a complete staging directory (manifest written) onto ``final``."""
    if not (staging / MANIFEST).is_file():
        raise EngineDirError(f"{staging}: refusing to commit a build without {MANIFEST}")
    old: Path | None = None
    if final.exists():
        old = final.parent / f".{final.name}{_OLD_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    try:
        os.rename(staging, final)
    except OSError:
        if old is not None:
            os.rename(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_build(final: Path) -> Iterator[Path]:
    """Yield an empty staging directory next to ``final``; on success (the body must have written the
    manifest) rename it into place, on any exception delete it and leave ``final`` untouched."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(final)
    staging.mkdir()
    try:
        yield staging
        commit_staging(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# -------------------------------------------------------------------------------------- reading


def read_manifest(root: str | os.PathLike) -> dict[str, Any]:
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        hint = " (not an engine directory, or its build never finished; run `make build-engines`)"
        raise EngineDirError(f"{path} not found{hint}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))  # never the locale's (ASCII inside Triton)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineDirError(f"{path}: unreadable manifest ({exc})") from exc
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise EngineDirError(f"{path}: format_version {version!r} is not supported (this code reads {FORMAT_VERSION}); "
                             "rebuild with `python -m builder --force`")
    return manifest


def manifest_files(manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every file record of the manifest (model files, profile, layer variants, the unified checkpoints: full model
    and morph levels, and any legacy TensorRT-LLM checkpoints: per precision, full precision, morph levels)."""
    records = list(manifest["files"].values())
    for layer in manifest["layers"]:
        records.extend(layer["variants"].values())
    trtllm = manifest.get("trtllm", {})
    exports = [(manifest.get("hf") or {}).get("full") or {}, *manifest.get("levels", {}).get("entries", {}).values(),
               *trtllm.get("precisions", {}).values(), trtllm.get("full") or {},
               *((trtllm.get("levels") or {}).get("entries") or {}).values()]
    for export in exports:
        records.extend(export.get("files", []))
    return records


def check_files(root: Path, manifest: Mapping[str, Any], verify_checksums: bool = False) -> None:
    for rec in manifest_files(manifest):
        path = root / rec["file"]
        if not path.is_file():
            raise EngineDirError(f"{root}: manifest lists {rec['file']} but the file is missing")
        size = path.stat().st_size
        if size != rec["bytes"]:
            raise EngineDirError(f"{path}: size {size} bytes, manifest says {rec['bytes']}")
        if verify_checksums and sha256_file(path) != rec["sha256"]:
            raise EngineDirError(f"{path}: sha256 checksum mismatch (file changed or corrupt)")


def _load_model(root: Path, manifest: Mapping[str, Any]) -> LoadedModel:
    from safetensors.torch import load_file

    config = ModelConfig.from_hf_dict(manifest["model"]["config"], name=manifest["model"]["name"])
    tok_cfg = json.loads((root / TOKENIZER_CONFIG).read_text())
    tokenizer = Tokenizer.from_hf_files(str(root / TOKENIZER), tok_cfg, config.eos_token_ids, config.bos_token_id)
    weights = {k: v.float() for k, v in load_file(str(root / FULL_WEIGHTS)).items()}
    return LoadedModel(config, weights, tokenizer, str(root))


@dataclass
class EngineDir:
    root: Path
    manifest: dict[str, Any]
    loaded: LoadedModel
    verify_checksums: bool = False
    _variants: dict[tuple[int, str], dict[str, QuantizedLinear]] = field(default_factory=dict, repr=False)

    @property
    def config(self) -> ModelConfig:
        return self.loaded.config

    @property
    def precisions(self) -> list[str]:
        return list(self.manifest["precisions"])

    @property
    def swap_order(self) -> list[int]:
        return list(self.manifest["swap_order"])

    @property
    def front_to_back(self) -> list[int]:
        return list(self.manifest["front_to_back"])

    @property
    def back_to_front(self) -> list[int]:
        return list(self.manifest["back_to_front"])

    def variant_record(self, layer: int, precision: str) -> dict[str, Any]:
        if not 0 <= layer < len(self.manifest["layers"]):
            raise EngineDirError(f"layer {layer} out of range (model has {len(self.manifest['layers'])} layers)")
        variants = self.manifest["layers"][layer]["variants"]
        if precision not in variants:
            raise EngineDirError(f"{self.root}: no {precision!r} variant of layer {layer} (built: {sorted(variants)})")
        return variants[precision]

    def layer_variant(self, layer: int, precision: str) -> dict[str, QuantizedLinear]:
        """Layer ``layer``'s seven runtime linears at ``precision``, loaded on first use (sha256 checked
        against the manifest) and cached."""
        key = (layer, precision)
        if key not in self._variants:
            rec = self.variant_record(layer, precision)
            path = self.root / rec["file"]
            if not path.is_file():
                raise EngineDirError(f"{self.root}: manifest lists {rec['file']} but the file is missing")
            # Always verified (a few MB each): a same-size byte flip used to load silently and serve empty text.
            if sha256_file(path) != rec["sha256"]:
                raise EngineDirError(f"{path}: sha256 checksum mismatch (file changed or corrupt)")
            self._variants[key] = read_layer_variant(path)
        return self._variants[key]

    def profile(self) -> dict[str, Any]:
        return json.loads((self.root / PROFILE).read_text())

    @property
    def levels(self) -> dict[str, dict[str, Any]]:
        """Morph levels with an exported unified checkpoint, by name (empty for builds without them)."""
        return exported_levels(self.manifest)

    def level_checkpoint(self, name: str) -> Path:
        return level_checkpoint(self.root, name, self.manifest)


def exported_levels(manifest: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The manifest's morph levels with an exported unified checkpoint, by name."""
    entries = manifest.get("levels", {}).get("entries", {})
    return {name: rec for name, rec in entries.items()
            if rec.get("status") == "exported" and str(rec.get("dir", "")).startswith(HF_DIR + "/")}


def level_checkpoint(root: str | os.PathLike, name: str, manifest: Mapping[str, Any] | None = None) -> Path:
    """The unified checkpoint directory of morph level ``name`` of the engine directory ``root`` (its manifest name,
    e.g. ``int4@25``, or its directory name, ``int4-25``), its files checked against the manifest; EngineDirError
    naming the levels built otherwise."""
    root = Path(root)
    manifest = read_manifest(root) if manifest is None else manifest
    levels = exported_levels(manifest)
    for level, rec in levels.items():
        if name in (level, Path(rec["dir"]).name):
            check_files(root, {"files": {}, "layers": [], "levels": {"entries": {level: rec}}})
            return root / rec["dir"]
    built = ", ".join(levels) or "none (built with LEVELS=none, --no-hf-export or before unified checkpoints)"
    raise EngineDirError(f"{root}: no exported morph level {name!r}; built: {built}")


def load_engine_dir(path: str | os.PathLike, verify_checksums: bool = False) -> EngineDir:
    """Open an engine directory: checks every listed file exists with its recorded size (and, with
    ``verify_checksums``, its sha256), loads config, tokenizer and full weights; variants load lazily."""
    root = Path(path)
    manifest = read_manifest(root)
    try:
        check_files(root, manifest, verify_checksums)
        loaded = _load_model(root, manifest)
    except (KeyError, TypeError) as exc:
        raise EngineDirError(f"{root / MANIFEST}: malformed manifest ({type(exc).__name__}: {exc})") from exc
    return EngineDir(root, manifest, loaded, verify_checksums)


def is_engine_dir(source: str | os.PathLike) -> bool:
    """True when ``source`` is a directory written by ``make build-engines`` (it holds a manifest)."""
    return (Path(source) / MANIFEST).is_file()


def open_model(source: str | os.PathLike, verify_checksums: bool = False,
               level: str | None = None) -> tuple[LoadedModel, EngineDir | None]:
    """The one way to open what a user names as the model: an engine directory (its weights, tokenizer,
    LIS order and prebuilt variants) or any model source :func:`serve.model.loader.load_model` takes. ``level``:
    one of the engine directory's morph levels instead (its unified checkpoint, a static model: no variants)."""
    if level is not None:
        if not is_engine_dir(source):
            raise EngineDirError(f"level {level!r} names a morph level of an engine directory, but {source} is not one "
                                 "(no manifest.json); point the model at its unified checkpoint directory instead")
        return load_model(str(level_checkpoint(source, level))), None
    if is_engine_dir(source):
        ed = load_engine_dir(source, verify_checksums)
        return ed.loaded, ed
    return load_model(str(source)), None
