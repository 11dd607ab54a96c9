"""Where a `make bench-peer` workload spends its time, per CPU kernel, and A/B of one kernel path in one process.

  .venv/bin/python -m bench.kernel_breakdown --morph-mode off --workload 32 [--ab fused_norm --rounds 4] [--model M]

Runs one of bench.peer's offline workloads (name prefix: "batch-1", "32", "64") through the engine in
``--morph-mode`` and reports, per function, the seconds and calls of our CPU kernels (the extension's functions),
torch's SDPA and oneDNN's linear (serve/model/linear.py ``onednn_linear``) against the wall time of the workload
(the rest: small torch ops, Python, the scheduler). The kernels are timed from outside, by the interpreter's profile
hook (``sys.setprofile``) on the thread that steps the engine: nothing of the runtime is replaced. The hook slows
every Python call, so the wall time and tok/s come from an unprofiled run of the same workload just before, and the
kernel seconds from the profiled one.

With ``--ab ATTR`` it instead alternates the model's kernel attribute ATTR (``fused_norm``, ``fused_elementwise``,
``paged_attention``, ``prompt_attention`` or ``int8_head``) between on and off (None: the torch path), or
``trim_last_layer`` (the last layer's attention projection and MLP for the sampled rows only, vs every row), or the
quantized layers' activations (``int8_activations``: int8 vs fp32, MORPHSERVE_QACTIVATIONS), or the fp32
projections' weight layout (``blocked_weights``: oneDNN's blocked layout as the engine stores it vs plain ``[N, K]``
copies of the same weights, made outside the arena for the run), or the LM head's (``blocked_head``: the engine's
blocked head vs a plain copy of it; token lookups stay on the blocked copy), for ``--rounds`` rounds, the order
flipped every round, and prints the median [min-max] tok/s of each side: a same-process A/B, the only kind this
noisy 2-core machine can tell apart. (The quantized layers' short decode path, A/B'd on 2026-12-01 by replacing a
private function, is no longer switchable: the runtime has no knob for it.)
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from collections.abc import Callable
from types import CodeType, FrameType, ModuleType
from typing import Any

import torch.nn.functional as F

from bench.peer import make_engine, workloads
from serve.config import EMBEDDED_MODEL
from serve.config_flags import add_engine_flags
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from workload.repeats import cell

AB_SWITCHES = ("fused_norm", "fused_elementwise", "paged_attention", "prompt_attention", "int8_head",
               "int8_activations",
               "blocked_weights", "blocked_head", "trim_last_layer")


class KernelTimer:
    """Seconds and calls per kernel, from the profile hook's call and return events: C functions of our kernel
    extension and torch's SDPA (``c_call`` / ``c_return``), and the Python functions in ``python_functions``
    (``call`` / ``return`` of their code). Install with ``sys.setprofile(timer)``; remove with
    ``sys.setprofile(None)``."""

    def __init__(self, extension: ModuleType | None, python_functions: dict[CodeType, str]) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        # the ops' function objects: an ISA variant's ops come from two extension modules (serve/model/kernels/isa.py)
        self._extension = {id(f) for f in vars(extension).values() if callable(f)} if extension is not None else set()
        self._python = python_functions
        self._open_c: list[tuple[object, str, float]] = []
        self._open_py: dict[FrameType, tuple[str, float]] = {}

    def _c_name(self, fn: Any) -> str | None:
        if fn is F.scaled_dot_product_attention:
            return "torch sdpa"
        if id(fn) in self._extension:
            return fn.__name__
        return None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        now = time.perf_counter()
        if event == "c_call":
            name = self._c_name(arg)
            if name is not None:
                self._open_c.append((arg, name, now))
        elif event in ("c_return", "c_exception"):
            if self._open_c and self._open_c[-1][0] is arg:
                _, name, t0 = self._open_c.pop()
                self._add(name, now - t0)
        elif event == "call":
            name = self._python.get(frame.f_code)
            if name is not None:
                self._open_py[frame] = (name, now)
        elif event == "return" and frame in self._open_py:
            name, t0 = self._open_py.pop(frame)
            self._add(name, now - t0)

    def _add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1


def _workload(engine: LLMEngine, prefix: str) -> tuple[str, dict]:
    found = {k: v for k, v in workloads(engine.model_config.vocab_size).items() if k.startswith(prefix)}
    if len(found) != 1:
        raise SystemExit(f"--workload {prefix!r} names {len(found)} of bench.peer's workloads")
    return next(iter(found.items()))


def _run(engine: LLMEngine, work: dict) -> float:
    """Output tok/s of one cold run (prefix cache reset first, as bench.peer's cold rows: A/B rounds repeat the
    same prompts, and a warm cache would skip most of their prefill)."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in work["max_tokens"]]
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    engine.generate(work["prompts"], params)
    return sum(work["max_tokens"]) / (time.perf_counter() - t0)


def breakdown(mode: str, prefix: str, threads: int, model: str = EMBEDDED_MODEL) -> str:
    from serve.model import crossovers, kernels, linear  # noqa: PLC0415

    engine = make_engine(mode, threads, model)  # applies this machine's measured crossovers, if any
    cross = crossovers.current()
    timer = KernelTimer(kernels.ops(), {linear.onednn_linear.__code__: f"oneDNN linear (blocked projections > "
                                        f"{cross.blocked_kernel_max_rows} rows, plain > {cross.fp32_kernel_max_rows})"})
    try:
        name, work = _workload(engine, prefix)
        engine.generate([[200] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        tok_s = _run(engine, work)
        wall = time.perf_counter() - t0
        sys.setprofile(timer)
        try:
            _run(engine, work)
        finally:
            sys.setprofile(None)
    finally:
        engine.shutdown()
    lines = [f"{name}, mode {mode}: {tok_s:.1f} tok/s, {wall:.2f} s wall (unprofiled run; kernel seconds from a "
             "profiled run of the same workload)", "| function | seconds | share of wall | calls |",
             "|---|---:|---:|---:|"]
    for fn, sec in sorted(timer.seconds.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {fn} | {sec:.3f} | {100 * sec / wall:.1f} % | {timer.calls[fn]} |")
    rest = wall - sum(timer.seconds.values())
    lines.append(f"| rest (small torch ops, Python, scheduler) | {rest:.3f} | {100 * rest / wall:.1f} % | |")
    return "\n".join(lines)


def _switch(engine: LLMEngine, attr: str) -> Callable[[bool], None]:
    """A function that turns ``attr`` on or off: a model kernel attribute, ``int8_activations`` (the
    MORPHSERVE_QACTIVATIONS setting the quantized layers read at every call), or a layout of the fp32 weights."""
    if attr == "int8_activations":
        before = os.environ.get("MORPHSERVE_QACTIVATIONS")

        def set_acts(on: bool | None) -> None:
            if on is not None:
                os.environ["MORPHSERVE_QACTIVATIONS"] = "int8" if on else "fp32"
            elif before is None:  # restore
                os.environ.pop("MORPHSERVE_QACTIVATIONS", None)
            else:
                os.environ["MORPHSERVE_QACTIVATIONS"] = before
        return set_acts
    if attr == "blocked_weights":
        from serve.model.linear import DenseLinear  # noqa: PLC0415
        from serve.morph.layer_bank import remap_ops  # noqa: PLC0415

        def plain(op):
            return DenseLinear(op.plain_weight().contiguous(), op.bias) if isinstance(op, DenseLinear) else op
        blocked = list(engine.model.layers)
        if not any(getattr(op, "layout", None) is not None for layer in blocked for op in vars(layer).values()):
            raise SystemExit("no blocked weights on this machine: nothing to compare")
        plain_layers = [remap_ops(layer, plain) for layer in blocked]
        return lambda on: engine.model.layers.__setitem__(slice(None), plain_layers if on is False else blocked)
    if attr == "blocked_head":
        from serve.model.linear import DenseLinear  # noqa: PLC0415

        head = engine.model.head
        if head.layout is None:
            raise SystemExit("the LM head is not blocked on this machine: nothing to compare")
        plain_head = DenseLinear(head.plain_weight().contiguous(), head.bias)  # a second copy, for the run only
        return lambda on: setattr(engine.model, "head", plain_head if on is False else head)
    kernel = getattr(engine.model, attr)
    if kernel is None:
        raise SystemExit(f"{attr} is already off on this machine (no kernels): nothing to compare")
    return lambda on: setattr(engine.model, attr, None if on is False else kernel)


def ab(mode: str, prefix: str, threads: int, attr: str, rounds: int, model: str = EMBEDDED_MODEL) -> str:
    engine = make_engine(mode, threads, model)
    name, work = _workload(engine, prefix)
    engine.generate([[200] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    switch = _switch(engine, attr)
    result: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for r in range(rounds):
            for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
                switch(side == "on")
                result[side].append(_run(engine, work))
    finally:
        switch(None)
        engine.shutdown()
    return f"{name}, mode {mode}\n" + "\n".join(f"{attr} {side}: {cell(v, 2)} tok/s, {len(v)} rounds"
                                                  for side, v in result.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernel_breakdown", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p, ("model", "morph_mode", "num_threads"),
                     aliases={"morph_mode": ["--mode"], "num_threads": ["--threads"]},
                     defaults={"model": EMBEDDED_MODEL, "morph_mode": "off", "num_threads": 2})
    p.add_argument("--workload", default="32", help="bench.peer workload name prefix: batch-1, 32 or 64")
    p.add_argument("--ab", default=None, choices=AB_SWITCHES,
                   help="alternate this kernel path on/off instead of the per-kernel breakdown")
    p.add_argument("--rounds", type=int, default=4, help="A/B rounds (default: %(default)s)")
    args = p.parse_args(argv)
    print(ab(args.morph_mode, args.workload, args.num_threads, args.ab, args.rounds, args.model) if args.ab
          else breakdown(args.morph_mode, args.workload, args.num_threads, args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
