"""This machine's kernel crossovers (serve/model/crossovers.py): measured on a model's own weights by ``make
build-engines`` (builder/step_costs.py), cached per machine beside the step costs, applied when an engine starts.

Each crossover times our kernel against the path that takes over from it, at ascending row counts, on the weights
the engine serves: the decoder's projections one layer after the other with enough layers that the weights stream
from memory as in a real step (plain layout: the fp32 kernel vs oneDNN, or MKL where torch has no oneDNN; blocked
layout: our blocked kernel vs oneDNN on the same bytes), and the LM head (its int8 blocks vs the blocked fp32 head as
the engine runs it). The two are interleaved and the fastest of ``repeats`` kept for each (as the step costs). The
crossover is the row limit whose choice comes closest to the faster kernel at every measured row count
(:func:`best_split`; 0: never ours). On a busy machine the timings are noisy: measure on a quiet one
(``python -m builder.step_costs --force``). A choice the model cannot make (no int8 head, no blocked layout, no kernels)
keeps its default.

Files: ``kernel_crossovers.json`` beside the engine directory's manifest and in the per-user cache
(``$MORPHSERVE_CACHE_DIR`` or ``~/.cache/morphserve``), keyed like the step costs (serve/model/step_costs.py
``machine_key``: CPU model and ISA, threads, torch, kernel sources) with the model's shapes (hidden, attention
width, intermediate, vocabulary).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from policy.measurement import BAND, Verdict, judge
from serve.model import crossovers, kernels
from serve.model.crossovers import DEFAULTS, KernelCrossovers
from serve.model.linear import DenseLinear, onednn_available, onednn_linear
from serve.model.llama import LlamaModel
from serve.model.step_costs import cache_dir, checked, device_name, machine_key, read_entry, store_entry

CROSSOVERS_FILE = "kernel_crossovers.json"
PLAIN_ROWS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BLOCKED_ROWS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
HEAD_ROWS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
STREAM_BYTES = 256 * 2**20
"""Decoder weights a timed pass runs through (more than any CPU cache: they stream from memory, as in a step)."""

Pass = Callable[[int], None]


def best_split(ours: Mapping[int, float], theirs: Mapping[int, float]) -> int:
    """The row limit (0 or a measured row count) whose choice, ours up to it and theirs above, is closest to the
    faster of the two at every measured row count: the smallest sum over row counts of the chosen time over the
    faster time. One noisy point moves it by one step at most, where a first-loss rule would stop there; ties go to
    the smaller limit (the library)."""
    rows = sorted(ours)
    best_limit, best_cost = 0, float("inf")
    for limit in [0, *rows]:
        cost = sum((ours[n] if n <= limit else theirs[n]) / max(min(ours[n], theirs[n]), 1e-12) for n in rows)
        if cost < best_cost - 1e-9:
            best_limit, best_cost = limit, cost
    return best_limit


def time_pair(ours: Pass, theirs: Pass, rows: Sequence[int], repeats: int) -> tuple[dict[int, float], dict[int, float]]:
    """Fastest of ``repeats`` seconds of each pass at each row count, the two interleaved (after one warm-up each)."""
    t_ours: dict[int, float] = {}
    t_theirs: dict[int, float] = {}
    for n in rows:
        samples: dict[int, list[float]] = {0: [], 1: []}
        for run in (ours, theirs):
            run(n)
        for _ in range(repeats):
            for i, run in enumerate((ours, theirs)):
                t0 = time.perf_counter()
                run(n)
                samples[i].append(time.perf_counter() - t0)
        t_ours[n], t_theirs[n] = min(samples[0]), min(samples[1])
    return t_ours, t_theirs


def model_shape(model: LlamaModel) -> tuple[int, int, int, int]:
    cfg = model.config
    return cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size, cfg.vocab_size


def _streamed_ops(model: LlamaModel) -> list[DenseLinear]:
    """The decoder's full-precision projections, layer after layer, up to STREAM_BYTES (or every layer)."""
    ops: list[DenseLinear] = []
    total = 0
    for layer in model.layers:
        for op in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if isinstance(op, DenseLinear):
                ops.append(op)
                total += op.nbytes
        if total >= STREAM_BYTES:
            break
    return ops


def _inputs(widths: set[int], rows: Sequence[int]) -> dict[tuple[int, int], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {(n, k): torch.randn(n, k, generator=gen) for n in rows for k in widths}


def _plain(model: LlamaModel, ops, repeats: int) -> tuple[int, dict] | None:
    """Our fp32 kernel vs what runs above it (oneDNN, else MKL's F.linear) on plain copies of the weights."""
    weights = [(op.plain_weight().contiguous(), op.bias) for op in _streamed_ops(model)]
    if not weights:
        return None
    x = _inputs({w.shape[1] for w, _ in weights}, PLAIN_ROWS)
    other = onednn_linear if onednn_available() else F.linear
    ours = lambda n: [ops.fp32_linear(x[n, w.shape[1]], w, b) for w, b in weights]  # noqa: E731
    theirs = lambda n: [other(x[n, w.shape[1]], w, b) for w, b in weights]  # noqa: E731
    t_ours, t_theirs = time_pair(ours, theirs, PLAIN_ROWS, repeats)
    return best_split(t_ours, t_theirs), _table(t_ours, t_theirs)


def _blocked(model: LlamaModel, ops, repeats: int) -> tuple[int, dict] | None:
    """Our blocked-layout kernel vs oneDNN on the same bytes, on the weights as the engine stores them."""
    blocked = [op for op in _streamed_ops(model) if op.layout is not None]
    if not blocked:
        return None
    x = _inputs({op.layout.k for op in blocked}, BLOCKED_ROWS)
    ours = lambda n: [ops.fp32_blocked_linear(x[n, op.layout.k], op.weight, op.layout.n, op.layout.block,  # noqa: E731
                                              op.bias) for op in blocked]
    theirs = lambda n: [onednn_linear(x[n, op.layout.k], op.layout.onednn_view(op.weight), op.bias)  # noqa: E731
                        for op in blocked]
    t_ours, t_theirs = time_pair(ours, theirs, BLOCKED_ROWS, repeats)
    return best_split(t_ours, t_theirs), _table(t_ours, t_theirs)


def _head(model: LlamaModel, ops, repeats: int) -> tuple[int, dict] | None:
    """The head's int8 blocks vs the fp32 head as the engine runs it (with the blocked crossover in force)."""
    if model.int8_head is None:
        return None
    x = _inputs({model.config.hidden_size}, HEAD_ROWS)
    k = model.config.hidden_size
    ours = lambda n: ops.int8_block_linear(x[n, k], *model.int8_head)  # noqa: E731
    theirs = lambda n: model.head(x[n, k])  # noqa: E731
    t_ours, t_theirs = time_pair(ours, theirs, HEAD_ROWS, repeats)
    return best_split(t_ours, t_theirs), _table(t_ours, t_theirs)


def _table(t_ours: Mapping[int, float], t_theirs: Mapping[int, float]) -> dict[str, list]:
    rows = sorted(t_ours)
    return {"rows": rows, "ours_us": [round(t_ours[n] * 1e6, 1) for n in rows],
            "theirs_us": [round(t_theirs[n] * 1e6, 1) for n in rows]}


@torch.inference_mode()
def measure(model: LlamaModel, repeats: int = 5) -> tuple[KernelCrossovers, dict[str, Any]]:
    """This machine's crossovers for ``model`` (fp32 on CPU), and the timings they come from (microseconds)."""
    ops = kernels.ops()
    if ops is None or model.device.type != "cpu" or model.dtype != torch.float32:
        return DEFAULTS, {"note": f"nothing to measure: our kernels run fp32 on CPU only ({kernels.describe()})"}
    values = DEFAULTS.values()
    timings: dict[str, Any] = {}
    for name, field, run in (("fp32 plain", "fp32_kernel_max_rows", _plain),
                             ("fp32 blocked", "blocked_kernel_max_rows", _blocked)):
        got = run(model, ops, repeats)
        if got is not None:
            values[field], timings[name] = got
    with crossovers.using(blocked_kernel_max_rows=values["blocked_kernel_max_rows"]):
        got = _head(model, ops, repeats)
    if got is not None:
        values["int8_head_max_rows"], timings["int8 head"] = got
    measured = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    not_measured = [f for f, name in (("int8_head_max_rows", "int8 head"), ("blocked_kernel_max_rows", "fp32 blocked"),
                                      ("fp32_kernel_max_rows", "fp32 plain")) if name not in timings]
    source = f"measured {measured} on {device_name(model.device)}"
    if not_measured:
        source += f" (default: {', '.join(not_measured)})"
    return KernelCrossovers.from_values(values, source), {"measured": measured, "repeats": repeats, **timings}


def key_for(model: LlamaModel) -> dict[str, Any]:
    return machine_key(model.device, model.dtype, model_shape(model))


def places(engine_dir: Path | None) -> list[Path]:
    """Where this machine's crossovers are looked for and stored: the engine directory's file, then the cache's."""
    return ([engine_dir / CROSSOVERS_FILE] if engine_dir is not None else []) + [cache_dir() / CROSSOVERS_FILE]


def find_entry(model: LlamaModel, engine_dir: Path | None) -> tuple[dict[str, Any], KernelCrossovers, Path] | None:
    """This machine's stored entry for ``model`` (the engine directory's first, then the cache's), the crossovers
    it holds, and where it was found."""
    key = key_for(model)
    for path in places(engine_dir):
        entry = read_entry(path, key)
        if entry is None:
            continue
        try:
            found = KernelCrossovers.from_values(entry["values"],
                                                 f"{entry.get('source', 'measured')}; read from {path}")
        except (KeyError, TypeError, ValueError):
            continue
        return entry, found, path
    return None


def lookup(model: LlamaModel, engine_dir: Path | None) -> KernelCrossovers | None:
    hit = find_entry(model, engine_dir)
    return hit[1] if hit is not None else None


def measure_trusted(model: LlamaModel, repeats: int = 5, attempts: int = 1, pause_s: float = 0.0,
                    on_attempt: Callable[[int, Verdict], None] | None = None
                    ) -> tuple[KernelCrossovers, dict[str, Any], Verdict]:
    """:func:`measure` under the conditions check of policy/measurement.py (the host's load, a reference kernel's
    drift; each choice keeps the fastest of its repeats, so no spread), again while the host is busy, at most
    ``attempts`` times: the last result, its entry (conditions recorded) and its verdict."""
    for attempt in range(1, attempts + 1):
        (found, timings), conditions = checked(lambda: measure(model, repeats), model.device, model.dtype,
                                               lambda _: 0.0)
        verdict = judge(conditions)
        if on_attempt is not None:
            on_attempt(attempt, verdict)
        if verdict.trusted or attempt == attempts:
            entry = {**entry_for(model, found, timings), "conditions": conditions.as_dict(),
                     "trusted": verdict.trusted, "band": BAND, "verdict": verdict.why()}
            return found, entry, verdict
        time.sleep(pause_s)
    raise AssertionError("unreachable")


def entry_for(model: LlamaModel, found: KernelCrossovers, timings: Mapping[str, Any]) -> dict[str, Any]:
    return {"values": found.values(), "source": found.source, "timings": dict(timings), "key": key_for(model)}


def store(model: LlamaModel, engine_dir: Path | None, entry: Mapping[str, Any]) -> list[Path]:
    """``entry`` (:func:`entry_for`) as this machine's, in the engine directory's file and the cache's."""
    targets = places(engine_dir)
    for path in targets:
        store_entry(path, key_for(model), entry)
    return targets


def apply_measured(model: LlamaModel, engine_dir: Path | None) -> KernelCrossovers:
    """At engine start: this machine's measured crossovers for ``model`` when there are some, else the defaults,
    made current for the process (an fp32 CPU model only; elsewhere the defaults, which nothing then reads)."""
    found = None
    if model.device.type == "cpu" and model.dtype == torch.float32:
        found = lookup(model, engine_dir)
    chosen = found or DEFAULTS
    crossovers.use(chosen)
    return chosen
