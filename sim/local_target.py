"""``--system local``: this machine, planned from the engine's own measurements (to validate the planner against
bench.replay on the same trace).

* Sizes: a real engine is built for the model (mode default, every quantized precision held), and the plan takes
  its layers' arena bytes per precision, the bytes outside the arena and the KV block size from it.
* Linears: the engine's measured per-precision StepCosts (serve/model/step_costs.py, cached per machine): the latest
  table, a correction made while serving included; the plan's notes say which (``step_costs_table``: when, whether
  quiet, the conditions).
* The rest of a forward (attention, norms, RoPE, SwiGLU) per layer, and the engine's own per-iteration host time,
  fitted by least squares on a short calibration run of the real engine (mode off) on a synthetic workload of
  mixed prompt and output lengths (not the trace being planned), with a 2 GiB budget so that batches as large as
  the planned engine's fit: forward time minus the linears and the LM head
  ~ layers x (c0 + c1 m + c2 sum(decode KV lengths) + c3 prefill attention work); step time minus forward
  ~ o0 + o1 x sequences. Negative coefficients are dropped and the fit repeated.
* Copies: host memory bandwidth measured with one 64 MiB copy (the CPU engine's swap is a memcpy).
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from policy import FULL
from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.engine.executor import Executor
from serve.engine.sampling_params import SamplingParams
from serve.engine.scheduler import ScheduledChunk
from serve.model.step_costs import device_name
from serve.morph.runtime import MorphRuntime
from sim.executor import batch_shape
from sim.step_model import LocalStepModel, LocalTerms, prefill_work
from sim.target import Target

CALIBRATION_REQUESTS = 40


CALIBRATION_MEMORY = "2GiB"
"""The calibration engine's budget: room for batches as large as the planned engine can ever run (its compute does
not depend on the budget), whatever --device-memory the plan uses."""


def _engine(args: argparse.Namespace, mode: str, device_memory: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=args.model, morph_mode=mode, device_memory=device_memory or args.device_memory,
                                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  num_threads=args.num_threads, morph_precisions="int8,int4", seed=args.seed))


def table_used(costs) -> dict:
    """Which step-cost table the plan stands on: when it was measured, whether quietly, and the conditions (the
    latest of the engine directory's and the per-user cache's; serve/model/step_costs.py)."""
    meta = dict(costs.meta)
    return {"measured": meta.get("measured"), "trusted": meta.get("trusted"), "verdict": meta.get("verdict"),
            "conditions": meta.get("conditions"), "band": meta.get("band")}


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    keep = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while keep:
        sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (sol >= 0).all():
            coef[keep] = sol
            break
        keep.pop(int(np.argmin(sol)))
    return coef


def _fit_without_stalls(x: np.ndarray, y: np.ndarray, spread: float = 5.0) -> np.ndarray:
    """Non-negative least squares, fitted again without the samples far above the first fit (a stall: a collection,
    a first-time allocation, another process) so one slow forward does not become a cost of every step: those whose
    residual exceeds ``spread`` median absolute deviations above the median residual."""
    coef = _nonneg_lstsq(x, y)
    r = y - x @ coef
    med = float(np.median(r))
    mad = float(np.median(np.abs(r - med))) or 1e-9
    keep = r <= med + spread * mad
    return _nonneg_lstsq(x[keep], y[keep]) if keep.sum() >= x.shape[1] and not keep.all() else coef


class TimedExecutor:
    """The engine's executor, each batch's shape and forward time appended to ``samples``."""

    def __init__(self, inner: Executor, samples: list[tuple]) -> None:
        self.inner, self.samples = inner, samples

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        t0 = time.perf_counter()
        out = self.inner.execute(chunks)
        self.samples.append((batch_shape(chunks)[0], time.perf_counter() - t0))
        return out


def calibrate(engine: LLMEngine, costs, seed: int) -> LocalTerms:
    """Run a mixed synthetic workload through the real engine and fit what the linears do not explain."""
    rng = random.Random(seed)
    samples: list[tuple] = []
    engine.executor = TimedExecutor(engine.executor, samples)
    vocab = engine.model_config.vocab_size
    for i in range(CALIBRATION_REQUESTS):
        prompt = [rng.randrange(100, min(vocab, 30000)) for _ in range(rng.choice([24, 64, 160, 320, 480]))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.choice([8, 24, 48]), ignore_eos=True))
    steps: list[tuple[float, float, int]] = []  # (step wall, forward, sequences)
    while engine.has_unfinished_requests():
        before = len(samples)
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        if len(samples) > before:
            shape, fwd = samples[-1]
            steps.append((wall, fwd, shape.num_seqs))
    layers = engine.model_config.num_layers
    rows, ys = [], []
    for shape, fwd in samples:
        m = shape.num_tokens
        known = layers * costs.layer_cost_s(FULL, m) + (costs._interp(costs.rest_s, max(shape.sampled, 1))
                                                         if costs.rest_s else 0.0)
        rows.append([layers, layers * m, layers * sum(shape.decode_kv_lens), layers
                     * prefill_work(shape.prefill_chunks)])
        ys.append(fwd - known)
    c = _fit_without_stalls(np.array(rows, dtype=float), np.array(ys))
    o = _fit_without_stalls(np.array([[1.0, n] for _, _, n in steps]), np.array([w - f for w, f, _ in steps]))
    return LocalTerms(per_layer_const=c[0], per_layer_token=c[1], per_layer_decode_ctx=c[2],
                      per_layer_prefill_work=c[3],
                      step_const=o[0], step_per_seq=o[1],
                      meta={"calibration_steps": len(samples), "requests": CALIBRATION_REQUESTS})


def copy_bandwidth() -> float:
    src = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() / best


def local_target(args: argparse.Namespace) -> Target:
    if args.device_memory is None:
        raise ValueError("--system local needs --device-memory (the budget the real replay runs with)")
    engine = _engine(args, "default")
    try:
        morph = engine.resource_manager(MorphRuntime)
        assert morph is not None, "mode default hosts a morph runtime"
        bank = morph.bank
        sizes = [{p: (bank.nbytes(i, p) if p != FULL else bank.regions[i].num_slots * bank.slot_bytes)
                  for p in bank.host[i]} for i in range(len(bank.regions))]
        costs = morph.costs or morph.controller.costs
        if costs is None:
            from serve.morph.setup import step_costs  # noqa: PLC0415

            costs = step_costs(bank.model, bank, None)
        cfg = engine.model_config
        non_arena, slot = engine.ledger.non_arena_bytes, engine.ledger.slot_bytes
        order = list(morph.controller.swap_order)
    finally:
        engine.shutdown()
    off = _engine(args, "off", CALIBRATION_MEMORY)
    try:
        terms = calibrate(off, costs, args.seed)
    finally:
        off.shutdown()
    bw = copy_bandwidth()
    name = device_name(torch.device("cpu"))
    return Target(system="local", device=name, model_name=args.model, model_config=cfg, layer_nbytes=sizes,
                  non_arena_bytes=non_arena, slot_bytes=slot, device_bytes=None, h2d_bytes_per_s=bw, d2d_bytes_per_s=bw,
                  step_model=LocalStepModel(costs, terms), swap_order=order,
                  notes={"terms": terms.as_dict(), "copy_GBps": round(bw / 1e9, 2), "step_costs": costs.to_dict(),
                         "step_costs_table": table_used(costs)})

