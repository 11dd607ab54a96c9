"""Our CPU kernels (AVX2 + FMA): weight-only int8 / int4 linears (``qlinear_avx2.cpp`` with fp32 activations,
``q8act_avx2.cpp`` with int8 activations, the default: :func:`int8_activations`), the fp32 linears
(``linear_avx2.cpp`` on plain weights, ``blocked_linear_avx2.cpp`` on oneDNN's blocked layout, with the non-owning
oneDNN view of such weights), paged decode and prompt attention (``attention_avx2.cpp``; over int8 KV
``attention_q8_avx2.cpp``, over tables mixing fp32 and int8 blocks ``attention_mixed_avx2.cpp``), RMSNorm
(``norm_avx2.cpp``) and the fused SwiGLU / RoPE + KV write (``elementwise_avx2.cpp``), one extension module.

torch's own CPU kernels (``aten._weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``) are fast on
AVX-512 but slower than fp32 on AVX2-only CPUs; these are memory-bound GEMVs with fp32 activations and
fp32 accumulation over the same integer weights and bf16 scales (README "Quantized CPU kernels").

The extension is compiled once per machine with ``torch.utils.cpp_extension.load`` (gcc + ninja, ~30-60 s)
into a cache directory: ``make install`` builds it (``python -m serve.model.kernels --build``), otherwise the
first quantized layer built on CPU does and logs it. ``MORPHSERVE_KERNEL_CACHE`` overrides the directory
(default ``~/.cache/morphserve/kernels/<torch version>``; one subdirectory per content hash of the sources). When the
CPU lacks AVX2/FMA, the compiler is missing or the build fails, one warning is logged and :func:`ops` returns None: the
quantized layers then use torch's kernels. ``MORPHSERVE_QKERNELS=torch`` forces that fallback (benchmarks compare the
two).

**ISA variants** (serve/model/kernels/isa.py, docs/cpu-kernels.md): the AVX2 + FMA module above is the baseline; an
AVX-512 (F / BW / VL + VNNI) module built beside it gives the blocked fp32 linear and the int8-activation kernels
16-wide / VPDPBUSD code. Each variant is probed in a child process before it is loaded here (a CPU that lists a flag
but traps the instruction kills the child, not this process); the best usable one is chosen once per process and
named by :func:`describe`. ``MORPHSERVE_CPU_ISA=avx2|avx512`` forces one (an unusable forced one is an error); the
AVX-512 build or probe failing otherwise falls back to AVX2 with one warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from serve.model.kernels import isa
from serve.model.kernels.isa import Variant

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": the module or None once decided; "why": why None; "isa": the variant
_variants: dict[str, ModuleType | None] = {}  # variant_ops()


def cache_dir() -> Path:
    env = os.environ.get("MORPHSERVE_KERNEL_CACHE")
    if env:
        return Path(env)
    version = torch.__version__.replace("+", "_")
    return Path.home() / ".cache" / "morphserve" / "kernels" / version


def cpu_supported() -> bool:
    """AVX2 and FMA (torch reports "AVX2" only when both are present; AVX-512 machines have both)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def ops() -> ModuleType | None:
    """The compiled kernels, or None when torch's kernels must be used (decided once per process)."""
    if "ops" not in _state:
        with _lock:
            if "ops" not in _state:
                _state["ops"] = _load()
    return _state["ops"]  # type: ignore[return-value]


def int8_activations() -> bool:
    """Whether the quantized layers' GEMVs round their activations to int8 (q8act_avx2.cpp): the default; set
    ``MORPHSERVE_QACTIVATIONS=fp32`` for fp32 activations (exact to the dequantized weights but ~1.5x slower
    on AVX2). Called per layer call, so a benchmark or test can switch it in one process: the value is parsed
    only when it changes, and :func:`ops` checks it once at start, so a bad value fails before any request."""
    return _parse_activations(os.environ.get("MORPHSERVE_QACTIVATIONS", "int8"))


@functools.lru_cache(maxsize=8)
def _parse_activations(raw: str) -> bool:
    value = raw.lower()
    if value not in ("int8", "fp32"):
        raise ValueError(f"MORPHSERVE_QACTIVATIONS must be int8 or fp32, got {raw!r}")
    return value == "int8"


def isa_name() -> str | None:
    """The ISA variant :func:`ops` runs (``avx2``, ``avx512``), or None when torch's kernels run."""
    ops()
    return _state.get("isa")  # type: ignore[return-value]


def describe() -> str:
    """Which kernels the quantized CPU layers run on, for benchmark reports and logs."""
    module = ops()
    if module is not None:
        acts = "int8" if int8_activations() else "fp32"
        label = {"avx2": "AVX2", "avx512": "AVX-512"}.get(str(_state.get("isa")), str(_state.get("isa")))
        return f"morphserve {label} ({torch.get_num_threads()} threads, {acts} activations in quantized layers)"
    return f"torch aten ({_state.get('why', 'unknown')})"


def _load() -> ModuleType | None:
    int8_activations()  # a bad MORPHSERVE_QACTIVATIONS fails here, at the first model build
    wanted = isa.requested()  # and a bad MORPHSERVE_CPU_ISA
    if os.environ.get("MORPHSERVE_QKERNELS", "").lower() == "torch":
        _state["why"] = "MORPHSERVE_QKERNELS=torch"
        return None
    if not cpu_supported():
        _state["why"] = f"CPU capability {torch.backends.cpu.get_cpu_capability()} lacks AVX2/FMA"
        _log.warning("quantized CPU kernels: %s; using torch's kernels", _state["why"])
        return None
    base_ok, why = isa.probe(isa.BASELINE, build_dir().name, cache_dir())
    if not base_ok:
        if wanted == isa.BASELINE.name:
            raise RuntimeError(f"MORPHSERVE_CPU_ISA={wanted}: the {wanted} kernels cannot run on this machine ({why})")
        _state["why"] = f"the {isa.BASELINE.name} kernels are not usable here: {why}"
        _log.warning("quantized CPU kernels: %s; using torch's kernels", _state["why"])
        return None
    try:
        base = build()
    except Exception as exc:  # noqa: BLE001 - any build failure means: fall back, once, loudly
        _state["why"] = f"build failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
        _log.warning("quantized CPU kernels could not be built (%s); using torch's kernels", exc)
        return None
    for variant in isa.candidates(wanted):
        module, why = _usable(variant, base)
        if module is not None:
            _state["isa"] = variant.name
            _log.info("CPU kernels: the %s variant (MORPHSERVE_CPU_ISA=%s)", variant.name, wanted)
            return module
        if wanted != "auto":
            raise RuntimeError(f"MORPHSERVE_CPU_ISA={wanted}: the {variant.name} kernels cannot run on this machine "
                               f"({why}); unset it or choose another of {', '.join(isa.VARIANTS)}")
        _log.warning("CPU kernels: the %s variant is not usable here (%s); trying the next", variant.name, why)
    _state["why"] = "no ISA variant of the kernels executes on this CPU"
    _log.warning("quantized CPU kernels: %s; using torch's kernels", _state["why"])
    return None


def variant_ops(name: str) -> ModuleType | None:
    """The ops of one ISA variant whatever :func:`ops` chose (tests and benchmarks compare the variants), or None
    when it is not usable here (its probe failed, or the baseline cannot be built)."""
    with _lock:
        if name not in _variants:
            try:
                base = build()
            except Exception:  # noqa: BLE001 - as ops(): no kernels
                return None
            _variants[name] = _usable(isa.VARIANTS[name], base)[0]
        return _variants[name]


def _usable(variant: Variant, base: ModuleType) -> tuple[ModuleType | None, str]:
    """``variant``'s ops (the baseline's where it has none of its own) once its probe ran in a child process, or
    None and why not. The module is loaded into this process only after its probe passed."""
    usable, why = isa.probe(variant, build_dir(variant).name, cache_dir())
    if not usable:
        return None, why
    if variant.name == isa.BASELINE.name:
        return base, why
    try:
        module = build(variant=variant)  # built and probed by the child: a cache hit
    except Exception as exc:  # noqa: BLE001 - as a failed probe
        return None, f"its build failed: {type(exc).__name__}: {exc}"
    return (isa.merged(base, module, variant) if variant.partial else module), why


def build_dir(variant: Variant = isa.BASELINE) -> Path:
    """The build directory of a variant's exact sources and flags: ``cache_dir() / <content hash>``.

    ninja rebuilds whenever a source's path or command line changes, so one directory shared by copies of the
    package at different paths (a checkout, a pip-installed deployment) would recompile on every switch
    (~100 s, seen as timeouts in make test). Keyed by content, each version builds once and is reused."""
    h = hashlib.sha256(variant.module.encode() + b"\0" + " ".join(variant.cflags).encode())
    for p in variant.paths(variant.sources + variant.headers):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return cache_dir() / h.hexdigest()[:16]


def _staged_sources(variant: Variant, into: Path) -> list[Path]:
    """Copies of a variant's sources under its build directory, so every copy of the package compiles the same
    paths (written only when missing: unchanged mtimes keep ninja's cached objects valid)."""
    into.mkdir(parents=True, exist_ok=True)
    sources = variant.paths(variant.sources)
    staged = []
    for p in sources + variant.paths(variant.headers):
        target = into / p.name
        if not target.exists() or target.read_bytes() != p.read_bytes():
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(p.read_bytes())
            tmp.replace(target)
        if p in sources:
            staged.append(target)
    return staged


def project_ninja_dir() -> str | None:
    """The directory holding the ``ninja`` binary of the pip ``ninja`` package this process imports, or None.

    ``ninja.BIN_DIR`` is empty in an interpreter whose own venv lacks the binary but sees the package through
    another venv's site-packages (the Dynamo venv layers the project venv this way, ``.venv-dynamo``), so the
    package's venv ``bin/`` is tried next."""
    try:
        import ninja  # noqa: PLC0415 - the pip package pyproject depends on
    except ImportError:
        return None
    package = Path(ninja.__file__).resolve().parent   # <venv>/lib/pythonX.Y/site-packages/ninja
    for directory in (getattr(ninja, "BIN_DIR", ""), str(package.parents[3] / "bin")):
        if directory and (Path(directory) / "ninja").is_file():
            return directory
    return None


@contextlib.contextmanager
def _project_ninja_first() -> Iterator[None]:
    """PATH with the ninja of the project's own ``ninja`` package first, while building.

    torch runs whichever ``ninja`` is first on PATH, and two ninja versions keep incompatible build logs: seen
    here, a system ninja 1.11 (processes started without the venv on PATH, e.g. pytest, and the Dynamo venv's
    workers, whose ``ninja.BIN_DIR`` was empty) and the venv's 1.13 each discarded the other's log and
    recompiled everything (~100-185 s) on every switch. One binary for every process keeps the cached build
    valid."""
    bin_dir = project_ninja_dir()
    if bin_dir is None:
        _log.warning("the ninja package's binary was not found; building with the first ninja on PATH")
        yield
        return
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = bin_dir + os.pathsep + before
    try:
        yield
    finally:
        os.environ["PATH"] = before


def build(verbose: bool = False, variant: Variant = isa.BASELINE) -> ModuleType:
    """Compile (or load the cached build of) a variant's extension module; raises when it cannot be built. Loading
    runs the module's code: a variant other than the baseline is built here only after its probe passed (or in
    the probe's child)."""
    from torch.utils import cpp_extension

    directory = build_dir(variant)
    directory.mkdir(parents=True, exist_ok=True)
    sources = _staged_sources(variant, directory / "src")
    t0 = time.perf_counter()
    # torch's own build baton is a plain "lock" file that every later load waits on forever when a build was
    # killed half-way (seen: a test's subprocess killed on timeout hung every engine start after it). An
    # flock dies with its process, so under it any leftover baton is stale and is removed.
    with (directory / "build.flock").open("w") as held, _project_ninja_first():
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        module = cpp_extension.load(name=variant.module, sources=[str(p) for p in sources],
                                    extra_cflags=list(variant.cflags), extra_ldflags=["-fopenmp"],
                                    build_directory=str(directory), verbose=verbose)
    seconds = time.perf_counter() - t0
    if seconds > 2.0:  # a real compile, not a cache hit
        _log.warning("built the quantized CPU kernels (%s) in %.0f s (cached in %s)", variant.name, seconds, directory)
    return module
