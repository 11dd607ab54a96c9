"""What a plan runs on (``Target``): a model's shapes and byte sizes, the device's memory and copy bandwidths, and a
step model. ``table_target`` makes one from aiconfigurator-core's tables (a GPU); ``sim/local_target.py`` makes one
from this machine's engine. sim/assemble.py assembles the planner's engine on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from policy import StepCosts
from serve.config import EngineConfig
from serve.engine.memory_budget import budget_bytes
from serve.model.kv_cache import kv_bytes_per_block
from serve.model.model_config import ModelConfig
from sim.kernel_tables import GEMM_DTYPE, KV_TABLE_DTYPE, KernelTables, TableError
from sim.model_specs import kv_block_nbytes, layer_nbytes, load_model_config, non_layer_nbytes
from sim.step_model import StepModel, TableStepModel


@dataclass
class Target:
    system: str
    device: str                          # the device in words (the tables' GPU, or this machine's CPU)
    model_name: str
    model_config: ModelConfig
    layer_nbytes: Sequence[Mapping[str, int]]  # per layer: bytes at each precision it can take, full included
    non_arena_bytes: int
    slot_bytes: int
    device_bytes: int | None             # what a fractional --device-memory is a fraction of (None: sizes only)
    h2d_bytes_per_s: float
    d2d_bytes_per_s: float
    step_model: StepModel                # TableStepModel | LocalStepModel
    swap_order: list[int]
    notes: dict

    def step_costs(self, precisions: Sequence[str]) -> StepCosts:
        return self.step_model.step_costs(precisions)


def table_target(system: str, model: str, block_size: int, overhead_s: float) -> Target:
    tables = KernelTables(system)
    cfg = load_model_config(model)
    available = [p for p, d in GEMM_DTYPE.items() if d in tables.gemm_dtypes]
    per_layer = {p: layer_nbytes(cfg, p) for p in available}
    spec = tables.spec
    return Target(system=system, device=f"{spec.device} ({spec.name}, TensorRT-LLM {spec.version} tables)",
                  model_name=model, model_config=cfg, layer_nbytes=[dict(per_layer) for _ in range(cfg.num_layers)],
                  non_arena_bytes=non_layer_nbytes(cfg), slot_bytes=kv_block_nbytes(cfg, block_size),
                  device_bytes=spec.mem_capacity, h2d_bytes_per_s=spec.pcie_bw, d2d_bytes_per_s=spec.mem_bw * 0.8 / 2,
                  step_model=TableStepModel(tables, cfg, overhead_s), swap_order=list(range(cfg.num_layers)),
                  notes={"swap_order": "front to back (no weights, no LIS profile; time and memory do not depend "
                                       "on the order, quality would)",
                         "overhead_ms_per_iteration": overhead_s * 1e3,
                         "h2d_GBps": spec.pcie_bw / 1e9, "device_memory_GiB": round(spec.mem_capacity / 2**30, 1)})


def resolve_budget(target: Target, text: str) -> int:
    """--device-memory as the engine reads it: a size, or a fraction of the target device's memory."""
    return budget_bytes(text, lambda: target.device_bytes,
                        f"a fractional --device-memory needs a GPU system; {target.system} takes a size such as 600MiB")


def with_kv_cache_dtype(target: Target, config: EngineConfig) -> Target:
    """``target`` with the KV format ``config`` names: its block bytes (the engine's 8-bit layout: codes and per
    token-head scales) and, on the tables, the attention rows of that KV dtype (fp8; int8 KV has none: refused)."""
    if config.kv_cache_dtype == "auto":
        return target
    if not isinstance(target.step_model, TableStepModel):
        raise TableError(f"kv_cache_dtype {config.kv_cache_dtype}: the planner models it on a GPU system's tables "
                         f"(fp8 KV rows), not on {target.device}")
    if config.kv_cache_dtype not in KV_TABLE_DTYPE:
        raise TableError(f"the attention tables have no {config.kv_cache_dtype}-KV rows (they have bf16 and fp8)")
    step_model = target.step_model.reading(kv_cache_dtype=config.kv_cache_dtype)
    slot = kv_bytes_per_block(target.model_config, config.block_size, torch.bfloat16, config.kv_cache_dtype)
    return dataclasses.replace(target, slot_bytes=slot, step_model=step_model,
                               notes={**target.notes, "kv_cache_dtype": config.kv_cache_dtype, "kv_block_bytes": slot})
