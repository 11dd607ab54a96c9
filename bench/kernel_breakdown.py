"""Where a `make bench-peer` workload spends its time, per CPU kernel, and A/B of one kernel path in one process.

  .venv/bin/python -m bench.kernel_breakdown --mode off --workload 32 [--ab fused_norm --rounds 4]

Runs one of bench.peer's offline workloads (name prefix: "batch-1", "32", "64") through the engine in
``--mode`` and times every call of our CPU kernels (the extension's functions, wrapped for the run) and of
torch's SDPA and oneDNN's linear: seconds and calls per function against the wall time of the workload (the rest: small torch
ops, Python, the scheduler). With ``--ab ATTR`` it instead alternates the model's kernel attribute ATTR
(``fused_norm``, ``fused_elementwise``, ``paged_attention``, ``prompt_attention`` or ``int8_head``) between on and off (None: the torch path),
or ``trim_last_layer`` (the last layer's attention projection and MLP for the sampled rows only, vs every row), or the quantized layers'
activations (``int8_activations``: int8 vs fp32, MORPHSERVE_QACTIVATIONS), or their short path for decode
inputs (``q8_short_path``: the direct kernel call vs the general path), or the fp32 projections' weight layout
(``blocked_weights``: oneDNN's blocked layout as the engine stores it vs plain ``[N, K]`` copies of the same
weights, made outside the arena for the run), or the LM head's (``blocked_head``: the engine's blocked head vs a
plain copy of it; token lookups stay on the blocked copy), for ``--rounds`` rounds, the
order flipped every round, and prints the median (min-max) tok/s of each side: a same-process A/B, the only
kind this noisy 2-core machine can tell apart.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch.nn.functional as F

from bench.peer import make_engine, workloads
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams


class _TimedOps:
    """The kernels module with every function call timed into ``seconds`` / ``calls``."""

    def __init__(self, ops, seconds: dict[str, float], calls: collections.Counter) -> None:
        self._ops, self._seconds, self._calls = ops, seconds, calls

    def __getattr__(self, name: str) -> Callable:
        return _timed(getattr(self._ops, name), name, self._seconds, self._calls)


def _timed(fn: Callable, name: str, seconds: dict[str, float], calls: collections.Counter) -> Callable:
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - t0
            calls[name] += 1
    return run


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


def breakdown(mode: str, prefix: str, threads: int) -> str:
    from serve.model import kernels  # noqa: PLC0415

    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    from serve.model import linear  # noqa: PLC0415

    real_ops, real_sdpa, real_onednn = kernels.ops, F.scaled_dot_product_attention, linear.onednn_linear
    ops = real_ops()
    kernels.ops = lambda: None if ops is None else _TimedOps(ops, seconds, calls)  # read at layer/model build and per call
    F.scaled_dot_product_attention = _timed(real_sdpa, "torch sdpa", seconds, calls)
    linear.onednn_linear = _timed(real_onednn, f"oneDNN linear (blocked projections > {linear.BLOCKED_KERNEL_MAX_ROWS} "
                                  f"rows, plain > {linear.FP32_KERNEL_MAX_ROWS})", seconds, calls)
    try:
        engine = make_engine(mode, threads, "smollm2-135m")
        name, work = _workload(engine, prefix)
        engine.generate([[200] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        seconds.clear()
        calls.clear()
        t0 = time.perf_counter()
        tok_s = _run(engine, work)
        wall = time.perf_counter() - t0
    finally:
        kernels.ops, F.scaled_dot_product_attention, linear.onednn_linear = real_ops, real_sdpa, real_onednn
    lines = [f"{name}, mode {mode}: {tok_s:.1f} tok/s, {wall:.2f} s wall", "| function | seconds | share of wall | calls |",
             "|---|---:|---:|---:|"]
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {s:.3f} | {100 * s / wall:.1f} % | {calls[name]} |")
    rest = wall - sum(seconds.values())
    lines.append(f"| rest (small torch ops, Python, scheduler) | {rest:.3f} | {100 * rest / wall:.1f} % | |")
    return "\n".join(lines)


def _switch(engine: LLMEngine, attr: str) -> Callable[[bool], None]:
    """A function that turns ``attr`` on or off: a model kernel attribute, ``int8_activations`` (the
    MORPHSERVE_QACTIVATIONS setting the quantized layers read at every call) or ``q8_short_path`` (the quantized
    layers' direct kernel call for decode inputs; off: every call takes the general path)."""
    if attr == "q8_short_path":
        from serve.model.quantized_linear import common  # noqa: PLC0415 - the formats call common._q8_gemv_input

        short = common._q8_gemv_input

        def set_short(on: bool | None) -> None:
            common._q8_gemv_input = short if on is not False else (lambda x, in_features: False)
        return set_short
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


def ab(mode: str, prefix: str, threads: int, attr: str, rounds: int) -> str:
    engine = make_engine(mode, threads, "smollm2-135m")
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
    return f"{name}, mode {mode}\n" + "\n".join(f"{attr} {side}: median {statistics.median(v):.2f} tok/s ({min(v):.2f}-{max(v):.2f}), "
                     f"{len(v)} rounds" for side, v in result.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernel_breakdown", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="off", help="morph mode (default: %(default)s)")
    p.add_argument("--workload", default="32", help="bench.peer workload name prefix: batch-1, 32 or 64")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ab", default=None,
                   choices=("fused_norm", "fused_elementwise", "paged_attention", "prompt_attention", "int8_head", "int8_activations",
                            "q8_short_path", "blocked_weights", "blocked_head", "trim_last_layer"),
                   help="alternate this kernel path on/off instead of the per-kernel breakdown")
    p.add_argument("--rounds", type=int, default=4, help="A/B rounds (default: %(default)s)")
    args = p.parse_args(argv)
    print(ab(args.mode, args.workload, args.threads, args.ab, args.rounds) if args.ab
          else breakdown(args.mode, args.workload, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
