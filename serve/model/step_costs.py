"""Measure what each precision's decoder layer costs per step on this device, and cache it per machine.

The controller's cost rule (policy/cost_rule.py) needs, for full precision and each quantized variant,
the time one layer's linear projections take at decode batch sizes and prefill chunk sizes. Only the
linears differ between precisions (attention, norms and RoPE do not), so those are what is timed, on the
very layer objects the engine serves (fused as the engine fuses them), precisions interleaved within each
repetition so a noisy neighbour hits them alike; the fastest repetition is kept (as timeit advises: slower
ones measure the neighbours, not the kernel).

Every measurement records the conditions it ran under (other processes' CPU time, steal, the repeats' spread, a
reference kernel before and after; :func:`measure_checked`), and policy/measurement.py judges them: a table measured
while the host was busy is measured again (:func:`measure_trusted`) and, if the host stays busy, never stored as
this machine's. The stored table carries its conditions and the band it is trusted to (``meta``).

Cache: ``step_costs.json`` beside an engine directory's manifest (written by ``make build-engines``) and a
per-user cache (``$MORPHSERVE_CACHE_DIR`` or ``~/.cache/morphserve``), both keyed by the machine: device
name and instruction set, torch version, threads, dtype, layer shape and a fingerprint of the kernel
sources. A faster kernel (a new extension, a torch upgrade) changes the key, so it is measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from policy.costs import StepCosts
from policy.measurement import BAND, Conditions, Verdict, judge
from serve.model import kernels as qkernels
from serve.model.linear import LinearOp
from serve.model.llama import DecoderLayer
from serve.process.host_load import HostLoad

DECODE_BATCHES: tuple[int, ...] = (1, 8, 32)
PREFILL_CHUNKS: tuple[int, ...] = (128, 512)
TOKEN_COUNTS: tuple[int, ...] = DECODE_BATCHES + PREFILL_CHUNKS
COSTS_FILE = "step_costs.json"
_KERNEL_SUFFIXES = (".cpp", ".cc", ".cu", ".so", ".pyd")
_KERNEL_FILES = ("linear.py", "rtn.py")
_KERNEL_PACKAGES = ("quantized_linear",)
"""Packages of serve/model whose every Python source counts as kernel source (one module per format)."""


def device_name(device: torch.device) -> str:
    """GPU name, or the CPU model with the SIMD level the kernels dispatch on (AVX-512 or not matters)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
            if model and flags:
                break
    except OSError:
        pass
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2" if flags else "?"
    return f"{model} ({isa}, {os.cpu_count()} cpus)"


def kernel_fingerprint() -> str:
    """Hash of the kernel sources and any compiled extension in serve/model: a new kernel means new costs."""
    here = Path(__file__).parent
    files = sorted(p for p in here.rglob("*") if p.is_file() and _is_kernel_source(p.relative_to(here)))
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _is_kernel_source(rel: Path) -> bool:
    in_package = rel.parts[0] in _KERNEL_PACKAGES and rel.suffix == ".py"
    return rel.name in _KERNEL_FILES or rel.suffix in _KERNEL_SUFFIXES or in_package


def machine_key(device: torch.device, dtype: torch.dtype, shape: Sequence[int]) -> dict[str, Any]:
    return {"device": device_name(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "dtype": str(dtype).removeprefix("torch."), "layer_shape": list(shape), "kernels": kernel_fingerprint(),
            "cpu_kernels": _cpu_kernels(device)}


def _cpu_kernels(device: torch.device) -> str:
    """Whose CPU kernels the costs were timed on, and which ISA variant of ours (their costs differ)."""
    if device.type != "cpu" or qkernels.ops() is None:
        return "torch"
    return f"morphserve-{qkernels.isa_name()}"


def key_id(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _ops(layer: DecoderLayer) -> list[tuple[LinearOp, int]]:
    """(op, input width) for the layer's linears, in forward order."""
    return [(layer.qkv, 0), (layer.o, 1), (layer.gate_up, 0), (layer.down, 2)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure(layers: Mapping[str, DecoderLayer | Sequence[DecoderLayer]], shape: Sequence[int], device: torch.device,
            dtype: torch.dtype, head: Callable[[torch.Tensor], torch.Tensor] | None = None,
            token_counts: Sequence[int] = TOKEN_COUNTS, repeats: int = 7, min_sample_s: float = 2e-3) -> StepCosts:
    """Time each precision's layer linears at each token count. ``layers[p]``: one layer, or several (the model's
    layers, as a step streams them): their linears run one layer after the other and the cost is per layer. One
    layer timed again and again is cache-hot, and how fast depends on where its copy lies, while a step reads each
    layer once (the measurements: docs/morphing.md, "The table timed over every layer").
    ``shape`` = (hidden, attention width, intermediate): the input
    widths of qkv/gate_up, o and down. ``head`` (the LM head as a step runs it, ``LlamaModel.logits``) times the
    part of the step no morph changes."""
    widths = list(shape)
    inputs = {n: [torch.randn(n, w, device=device, dtype=dtype) for w in widths] for n in token_counts}
    stacks = {p: [ls] if isinstance(ls, DecoderLayer) else list(ls) for p, ls in layers.items()}
    runs: dict[str, Any] = {p: (lambda n, stack=stack: [op(inputs[n][w]) for layer in stack for op, w in _ops(layer)])
                            for p, stack in stacks.items()}
    per = {p: len(stack) for p, stack in stacks.items()} | {"rest": 1}
    if head is not None:
        runs["rest"] = lambda n: head(inputs[n][0])
    inner: dict[tuple[str, int], int] = {}
    for name, run in runs.items():  # warm-up, and calls per sample so one sample lasts >= min_sample_s
        for n in token_counts:
            once = []
            for _ in range(3):
                _sync(device)
                t0 = time.perf_counter()
                run(n)
                _sync(device)
                once.append(time.perf_counter() - t0)
            inner[name, n] = max(1, min(64, int(min_sample_s / max(min(once), 1e-7))))
    samples: dict[tuple[str, int], list[float]] = {k: [] for k in inner}
    for _ in range(repeats):
        for n in token_counts:
            for name, run in runs.items():
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(inner[name, n]):
                    run(n)
                _sync(device)
                samples[name, n].append((time.perf_counter() - t0) / inner[name, n] / per[name])
    med = {k: min(v) for k, v in samples.items()}
    return StepCosts(device=device_name(device), token_counts=tuple(token_counts),
                     layer_s={p: tuple(med[p, n] for n in token_counts) for p in layers},
                     rest_s=tuple(med["rest", n] for n in token_counts) if head is not None else (),
                     meta={"repeats": repeats, "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "spread": spread(samples.values())})


def spread(samples: Any) -> float:
    """How much repeats disagree: the median over cells of (median / fastest - 1)."""
    ratios = sorted(sorted(v)[len(v) // 2] / min(v) - 1 for v in samples if v and min(v) > 0)
    return ratios[len(ratios) // 2] if ratios else 0.0


@torch.inference_mode()
def reference_time(device: torch.device, dtype: torch.dtype, repeats: int = 7) -> float:
    """The fastest of ``repeats`` runs of a fixed reference kernel (a 16-row matmul over 1024 x 1024 weights):
    timed before and after a measurement, it says whether the machine changed speed meanwhile."""
    x = torch.randn(16, 1024, device=device, dtype=dtype)
    w = torch.randn(1024, 1024, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(8):
            torch.mm(x, w)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def checked(run: Callable[[], Any], device: torch.device, dtype: torch.dtype,
            spread_of: Callable[[Any], float]) -> tuple[Any, Conditions]:
    """``run()``'s result and the conditions it ran under (policy/measurement.py): the host's load, the
    repeats' spread (``spread_of(result)``), the reference kernel's drift across it."""
    before = reference_time(device, dtype)
    with HostLoad() as load:
        result = run()
    after = reference_time(device, dtype)
    return result, Conditions(load.other_share, load.steal_share, spread_of(result), abs(after / before - 1),
                              load.known)


def measure_checked(*args: Any, **kwargs: Any) -> tuple[StepCosts, Conditions, Verdict]:
    """:func:`measure`, with the conditions it ran under and their verdict; both recorded in the table's meta."""
    layers, shape, device, dtype = args[:4]
    costs, conditions = checked(lambda: measure(*args, **kwargs), device, dtype, lambda c: c.meta["spread"])
    verdict = judge(conditions)
    meta = {**costs.meta, "conditions": conditions.as_dict(), "trusted": verdict.trusted, "band": BAND,
            "verdict": verdict.why()}
    return StepCosts(costs.device, costs.token_counts, costs.layer_s, costs.rest_s, meta), conditions, verdict


def measure_trusted(*args: Any, attempts: int = 3, pause_s: float = 10.0,
                    on_attempt: Callable[[int, Verdict], None] | None = None,
                    **kwargs: Any) -> tuple[StepCosts, Verdict]:
    """:func:`measure_checked` until the verdict trusts the table, at most ``attempts`` times with ``pause_s``
    between (the neighbour may finish); the last table and its verdict either way (the caller stores only a
    trusted one)."""
    for attempt in range(1, attempts + 1):
        costs, _, verdict = measure_checked(*args, **kwargs)
        if on_attempt is not None:
            on_attempt(attempt, verdict)
        if verdict.trusted or attempt == attempts:
            return costs, verdict
        time.sleep(pause_s)
    raise AssertionError("unreachable")


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def read_entry(path: Path, key: Mapping[str, Any]) -> dict[str, Any] | None:
    """This machine's entry in a per-machine file (step costs, kernel crossovers), if there is one."""
    entry = _read(path).get(key_id(key))
    return entry if isinstance(entry, dict) and entry else None


def store_entry(path: Path, key: Mapping[str, Any], entry: Mapping[str, Any]) -> None:
    """Add or replace this machine's entry in a per-machine file (write to a temp file, then rename)."""
    data = _read(path)
    data[key_id(key)] = dict(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    tmp.replace(path)


def lookup(path: Path, key: Mapping[str, Any], precisions: Sequence[str]) -> StepCosts | None:
    """The entry for this machine in a costs file, if it has every precision asked for."""
    entry = read_entry(path, key)
    if not entry:
        return None
    try:
        costs = StepCosts.from_dict(entry)
    except (KeyError, TypeError, ValueError):
        return None
    return costs if all(p in costs.layer_s for p in precisions) else None


def store(path: Path, key: Mapping[str, Any], costs: StepCosts) -> None:
    """Add or replace this machine's entry (write to a temp file, then rename)."""
    store_entry(path, key, {**costs.to_dict(), "meta": {**costs.meta, "key": dict(key)}})


def cache_dir() -> Path:
    """The per-user cache of per-machine measurements: ``$MORPHSERVE_CACHE_DIR`` or ``~/.cache/morphserve``."""
    return Path(os.environ.get("MORPHSERVE_CACHE_DIR") or Path.home() / ".cache" / "morphserve")


def cache_path() -> Path:
    return cache_dir() / COSTS_FILE


def find_measured(shape: Sequence[int], device: torch.device, dtype: torch.dtype, precisions: Sequence[str],
                  engine_dir: Path | None) -> tuple[StepCosts | None, str]:
    """This machine's costs from the engine directory (``make build-engines`` measured them), never measured here
    and never from the per-user cache (which a morphing engine may fill at start: a lever that stays off without
    costs, speculative decoding, must not turn on because another engine ran before)."""
    if engine_dir is None:
        return None, "no engine directory"
    path = engine_dir / COSTS_FILE
    found = lookup(path, machine_key(device, dtype, shape), precisions)
    return (found, str(path)) if found is not None else (None, f"none for this machine in {path}")


def load_or_measure(layers: Mapping[str, DecoderLayer], shape: Sequence[int], device: torch.device, dtype: torch.dtype,
                    head: Callable[[torch.Tensor], torch.Tensor] | None = None, engine_dir: Path | None = None,
                    repeats: int = 3) -> tuple[StepCosts, str]:
    """This machine's costs and where they came from: the latest of the engine directory's file and the per-user
    cache (where an engine writes a table it corrected while serving), or a fresh (short) measurement, then stored
    in the cache when it was quiet."""
    key = machine_key(device, dtype, shape)
    precisions = list(layers)
    places = ([engine_dir / COSTS_FILE] if engine_dir is not None else []) + [cache_path()]
    found = [(costs, str(path)) for path in places if (costs := lookup(path, key, precisions)) is not None]
    if found:  # the latest measurement: a table corrected while serving (cache) wins over the build's
        return max(found, key=lambda f: str(f[0].meta.get("measured", "")))
    costs, _, verdict = measure_checked(layers, shape, device, dtype, head=head, repeats=repeats)
    if not verdict.trusted:  # used by this engine, never stored as this machine's
        return costs, f"measured at start on a busy host, not cached ({verdict.why()})"
    try:
        store(cache_path(), key, costs)
    except OSError:
        return costs, "measured at start (cache not writable)"
    return costs, f"measured at start, cached in {cache_path()}"
