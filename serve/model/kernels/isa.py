"""The ISA variants of the CPU kernels and the probe that says which of them this machine executes.

Two variants live in one install (docs/cpu-kernels.md): the AVX2 + FMA baseline, every op
(``morphserve_cpu_kernels``), and AVX-512 (F / BW / VL + VNNI), a second extension module holding only the ops it
has its own code for (``morphserve_cpu_kernels_avx512``); the ops it lacks come from the baseline.

A CPU's flags are not proof of what it executes (a hypervisor can list an extension and trap it), and loading a
module whose code the CPU cannot run kills the process with SIGILL. So a variant is built and its ``probe()`` (one
instruction of each extension it is compiled for) is called **in a child process** first
(:mod:`serve.model.kernels.probe_child`); a signal, a wrong checksum or a failed build there means "not usable
here", and only a usable variant is loaded into this process. The verdict is cached per machine (CPU model, its
flags, the OS kernel) and build in ``isa_probe.json`` beside the builds; a failure the child cannot attribute to
the CPU (a timeout) is not cached.

``MORPHSERVE_CPU_ISA``: ``auto`` (default: the first usable of :data:`PREFERENCE`), ``avx2`` or ``avx512``. A
forced variant this machine cannot use is refused with an error at the first model build, never swapped silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).parent
PROBE_FILE = "isa_probe.json"
PROBE_TIMEOUT_S = 900.0  # the child builds the variant first when nothing is cached (~1-2 min on 2 loaded cores)


@dataclass(frozen=True)
class Variant:
    """One extension module of the kernels: what it is compiled from and with, and what its probe returns."""

    name: str
    module: str                 # the Python module's name (TORCH_EXTENSION_NAME)
    sources: tuple[str, ...]    # compiled; absolute or relative to this package
    headers: tuple[str, ...]    # included by the sources: staged and hashed with them, not compiled
    cflags: tuple[str, ...]
    checksum: int               # what probe() returns where the instructions execute correctly
    requires: tuple[str, ...]   # /proc/cpuinfo flags: a CPU that lacks one is not probed (listing is no proof)
    partial: bool = False       # holds only some ops: the rest come from the baseline

    def paths(self, names: tuple[str, ...]) -> list[Path]:
        return [Path(n) if Path(n).is_absolute() else _HERE / n for n in names]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Variant:
        raw = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


_COMMON_HEADERS = ("avx2_common.h", "attention_common.h", "simd_f32.h", "blocked_linear_impl.h", "q8act_impl.h")
_BASE_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")  # OpenMP: at::parallel_for, torch's intra-op threads

AVX2 = Variant(
    name="avx2", module="morphserve_cpu_kernels",
    sources=("qlinear_avx2.cpp", "q8act_avx2.cpp", "linear_avx2.cpp", "blocked_linear_avx2.cpp", "attention_avx2.cpp",
             "attention_q8_avx2.cpp", "attention_mixed_avx2.cpp", "norm_avx2.cpp", "elementwise_avx2.cpp",
             "bindings.cpp"),
    headers=_COMMON_HEADERS, cflags=_BASE_FLAGS, checksum=-184,
    requires=("avx2", "fma"))
AVX512 = Variant(
    name="avx512", module="morphserve_cpu_kernels_avx512",
    # the decode attention sources are the baseline's, compiled again: attention_common.h's P.V goes 16-wide
    sources=("blocked_linear_avx512.cpp", "q8act_avx512.cpp", "attention_avx2.cpp", "attention_q8_avx2.cpp",
             "attention_mixed_avx2.cpp", "bindings_avx512.cpp"),
    headers=_COMMON_HEADERS,
    # hidden visibility: its ops share names with the baseline's, which is loaded in the same process
    cflags=_BASE_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-fvisibility=hidden"),
    checksum=-1168, requires=("avx512f", "avx512bw", "avx512vl", "avx512_vnni"), partial=True)

BASELINE = AVX2
VARIANTS: dict[str, Variant] = {v.name: v for v in (AVX2, AVX512)}
PREFERENCE: list[str] = ["avx512", "avx2"]  # best first; ``auto`` takes the first usable


def requested() -> str:
    """``MORPHSERVE_CPU_ISA``: ``auto`` or a variant's name (a bad value raises, at the first model build)."""
    raw = os.environ.get("MORPHSERVE_CPU_ISA", "auto").strip().lower() or "auto"
    if raw != "auto" and raw not in VARIANTS:
        raise ValueError(f"MORPHSERVE_CPU_ISA must be auto or one of {', '.join(VARIANTS)}, got {raw!r}")
    return raw


def candidates(wanted: str) -> list[Variant]:
    """The variants to try, best first: every one of the preference order for ``auto``, else the one asked for."""
    names = PREFERENCE if wanted == "auto" else [wanted]
    return [VARIANTS[n] for n in names]


def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists (empty where there is none)."""
    return set(_cpuinfo()[1].split())


def machine_id() -> str:
    """The CPU model, a hash of its flags and the OS kernel: what a probe's verdict holds for."""
    model, flags = _cpuinfo()
    return f"{model} | flags {hashlib.sha256(flags.encode()).hexdigest()[:12]} | {platform.release()}"


def _cpuinfo() -> tuple[str, str]:
    """The first CPU's model name and flags line of /proc/cpuinfo."""
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    return model or platform.machine(), flags


def probe(variant: Variant, build_id: str, cache: Path) -> tuple[bool, str]:
    """Whether ``variant`` (its build ``build_id``) executes on this machine, and why not: cached, else asked of a
    child process that builds it and calls its ``probe()``."""
    path = cache / PROBE_FILE
    key = f"{machine_id()} | {variant.name} {build_id}"
    entry = _read(path).get(key)
    if isinstance(entry, dict) and isinstance(entry.get("usable"), bool):
        return entry["usable"], str(entry.get("why", ""))
    listed = cpu_flags()
    missing = [f for f in variant.requires if f not in listed]
    if listed and missing:
        return False, f"the CPU does not list {', '.join(missing)}"
    usable, why, definite = _run_child(variant)
    if definite:
        data = _read(path)
        data[key] = {"usable": usable, "why": why}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)
    return usable, why


def _read(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _run_child(variant: Variant) -> tuple[bool, str, bool]:
    """(usable, why, definite): the child's verdict; definite when it is the CPU's answer (cacheable)."""
    root = str(_HERE.parents[2])  # the directory holding the serve package: ``-m`` puts the cwd on sys.path
    try:
        done = subprocess.run([sys.executable, "-m", "serve.model.kernels.probe_child", variant.to_json()],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, cwd=root, check=False)
    except subprocess.TimeoutExpired:
        return False, f"the probe took over {PROBE_TIMEOUT_S:.0f} s", False
    if done.returncode < 0:
        sig = signal.Signals(-done.returncode).name
        return False, f"its probe died with {sig} in a child process (an instruction this CPU does not execute)", True
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode == 3:  # the child could not build it: no compiler support, not the CPU's verdict
        return False, f"its build failed: {last or done.stderr.strip()[-300:]}", False
    if done.returncode != 0:
        return False, f"its probe exited {done.returncode}: {done.stderr.strip()[-300:]}", False
    try:
        got = int(last)
    except ValueError:
        return False, f"its probe printed {last!r}", False
    if got != variant.checksum:
        return False, f"its probe computed {got}, not {variant.checksum}", True
    return True, "executed in a child process", True


def merged(base: ModuleType, extra: ModuleType, variant: Variant) -> ModuleType:
    """The baseline's ops with ``extra``'s in place of those it has (a partial variant), as one module."""
    module = ModuleType(f"{base.__name__}+{variant.name}")
    for source in (base, extra):
        module.__dict__.update({k: v for k, v in vars(source).items() if not k.startswith("__") and k != "probe"})
    return module
