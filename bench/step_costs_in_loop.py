"""The step-cost table as ``make build-engines`` measures it beside the same linears timed inside real engine steps.

  .venv/bin/python -m bench.step_costs_in_loop [--model engines/smollm2-135m] [--batches 1,8,32] [--steps 12]

In one process, on one engine (mode default, 2 GiB so nothing morphs, no speculation), on a quiet machine
(it prints the load):

1. ``measure`` as the builder calls it (serve/model/step_costs.py on serve/morph/setup.py ``cost_inputs``: on CPU
   every layer of each precision, one after the other, per layer);
2. the served layer 0 (the arena's copy the forward runs) alone, timed again and again (cache-hot);
3. every served layer's linears one after the other (weights streamed as a step streams them), per layer;
4. decode steps at each batch size, each decoder projection and the LM head wrapped by a timer: the linears' seconds
   per layer inside a step, the head's, the forward's and the step's (medians over ``--steps``, the first two
   decode steps dropped).

What the table predicts for a decode step's linears is ``layers x cell(batch)``; the in-loop column is what they
took; (2) is how the table was measured before (one layer repeated), (3) the served copies streamed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from policy import FULL
from serve.config import EngineConfig
from serve.config_flags import add_engine_flags
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.model import crossovers, kernels
from serve.model.step_costs import TOKEN_COUNTS, _ops, measure
from serve.morph.runtime import MorphRuntime
from serve.morph.setup import cost_inputs

PROJECTIONS = ("qkv", "o", "gate_up", "down")


class Timed:
    """A linear op whose calls add their seconds to ``acc[0]``."""

    def __init__(self, op, acc: list[float]) -> None:
        self.op, self.acc = op, acc

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = self.op(x)
        self.acc[0] += time.perf_counter() - t0
        return y

    @property
    def nbytes(self) -> int:
        return self.op.nbytes


@torch.inference_mode()
def streamed(layers: list, shape: tuple[int, int, int], repeats: int = 5) -> list[float]:
    """Per-layer seconds of every layer's linears run one after the other, at each token count (fastest repeat)."""
    out = []
    for n in TOKEN_COUNTS:
        xs = [torch.randn(n, w) for w in shape]
        run: Callable[[], list] = lambda: [op(xs[w]) for layer in layers for op, w in _ops(layer)]  # noqa: E731
        run()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
        out.append(best / len(layers))
    return out


def decode_steps(engine: LLMEngine, batch: int, steps: int, lin: list[float], head: list[float]) -> dict[str, float]:
    """Medians (ms) over decode steps of ``batch`` sequences: step wall, forward, linears, per layer, LM head."""
    inner = engine.executor
    forwards: list[tuple[bool, float]] = []

    class Executor:
        def execute(self, chunks):
            t0 = time.perf_counter()
            result = inner.execute(chunks)
            forwards.append((len(chunks) == batch and all(c.num_tokens == 1 for c in chunks),
                             time.perf_counter() - t0))
            return result

    engine.executor = Executor()
    for i in range(batch):
        engine.add_request([100 + (7 * i + j) % 5000 for j in range(24)],
                           SamplingParams(max_tokens=steps + 6, ignore_eos=True))
    rows = []
    while engine.has_unfinished_requests():
        lin[0] = head[0] = 0.0
        before = len(forwards)
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        if len(forwards) > before and forwards[-1][0]:
            rows.append((wall, forwards[-1][1], lin[0], head[0]))
    engine.executor = inner
    rows = rows[2:]
    layers = engine.model_config.num_layers
    med = [statistics.median(r[k] for r in rows) * 1e3 for k in range(4)]
    return {"steps": len(rows), "wall_ms": med[0], "forward_ms": med[1], "linears_ms": med[2],
            "per_layer_ms": med[2] / layers, "head_ms": med[3]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_costs_in_loop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p, ("model", "num_threads"), defaults={"model": "engines/smollm2-135m", "num_threads": 2})
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", default=None, help="write the numbers here")
    args = p.parse_args(argv)
    print("load before", os.getloadavg(), flush=True)
    engine = LLMEngine(EngineConfig(model=args.model, morph_mode="default", morph_precisions="int8,int4",
                                    policy_overrides={"cost_aware": False}, num_threads=args.num_threads,
                                    device_memory="2GiB", speculation="off"))
    out: dict[str, object] = {}
    try:
        layers, shape, head_fn = cost_inputs(engine.model, engine.resource_manager(MorphRuntime).bank)
        model = engine.model
        out["context"] = {"threads": torch.get_num_threads(), "crossovers": crossovers.current().values(),
                          "kernels": kernels.describe()}
        ms = lambda row: [round(v * 1e3, 3) for v in row]  # noqa: E731
        table = measure(layers, shape, model.device, model.dtype, head=head_fn, repeats=7)
        out["table"] = {**{q: ms(table.layer_s[q]) for q in table.layer_s}, "rest": ms(table.rest_s)}
        served0 = measure({FULL: model.layers[0]}, shape, model.device, model.dtype, repeats=7)
        out["served_layer0"] = ms(served0.layer_s[FULL])
        out["streamed_served"] = ms(streamed(list(model.layers), shape))
        lin, head = [0.0], [0.0]
        originals = [{name: getattr(layer, name) for name in PROJECTIONS} for layer in model.layers]
        for layer in model.layers:
            for name in PROJECTIONS:
                setattr(layer, name, Timed(getattr(layer, name), lin))
        model.logits = Timed(head_fn, head)  # the instance attribute shadows the method the forward calls
        try:
            for batch in (int(b) for b in args.batches.split(",")):
                got = decode_steps(engine, batch, args.steps, lin, head)
                got["table_layer_ms"] = table.layer_cost_s(FULL, batch) * 1e3
                got["table_rest_ms"] = table.rest_cost_s(batch) * 1e3
                out[f"decode_{batch}"] = {k: round(v, 3) for k, v in got.items()}
        finally:
            del model.logits
            for layer, ops in zip(model.layers, originals):
                for name, op in ops.items():
                    setattr(layer, name, op)
    finally:
        engine.shutdown()
    print("load after", os.getloadavg())
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
