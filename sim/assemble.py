"""Build a planner engine: the real LLMEngine loop, scheduler, block pool, ledger and morph runtime over a simulated
layer bank and executor on a virtual clock.

A ``Target`` is what the plan runs on: a model's shapes and byte sizes, the device's memory and copy bandwidths,
and a step model. ``table_target`` makes one from aiconfigurator-core's tables; ``sim/local_target.py`` makes
one from this machine's engine.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from policy import FULL, PolicyConfig, StepCosts, resolve_kv_rung
from serve.config import EngineConfig
from serve.memory.budget import budget_bytes
from serve.engine.assembly import EngineParts
from serve.engine.engine import LLMEngine
from serve.memory.block_pool import BlockPool
from serve.memory.sizing import plan_arena
from serve.engine.kv_rung import build_kv_rung, kv_blocks_per_slot
from serve.model.kv_cache import kv_bytes_per_block
from serve.model.kv_format import KVLayout
from serve.model.model_config import ModelConfig
from serve.model.tokenizer import Tokenizer
from serve.engine.memory_assembly import EngineMemory
from serve.morph.plan import MorphPlan
from serve.morph.setup import build_runtime
from sim.bank import SimKV, SimLayerBank
from sim.clock import VirtualClock
from sim.executor import SimExecutor
from sim.kernel_tables import GEMM_DTYPE, KV_TABLE_DTYPE, KernelTables, TableError
from sim.model_specs import kv_block_nbytes, layer_nbytes, load_model_config, non_layer_nbytes
from sim.speculation import ModelledSpeculation, SimSpeculation
from sim.step_model import TableStepModel


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
    step_model: object                   # TableStepModel | LocalStepModel
    swap_order: list[int]
    notes: dict

    def step_costs(self, precisions: Sequence[str]) -> StepCosts:
        return self.step_model.step_costs(precisions)  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=1)
def prompt_tokenizer() -> Tokenizer:
    """The embedded model's tokenizer: the planner builds the replay's prompts from the same text, so prompt
    content (prefix-cache hits) is as in the real replay; lengths come from the trace."""
    from serve.model.embedded import EMBEDDED_MODEL  # noqa: PLC0415
    from serve.model.loader import load_model  # noqa: PLC0415

    return load_model(EMBEDDED_MODEL).tokenizer


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
    step_model = copy.copy(target.step_model)
    step_model.kv_cache_dtype = config.kv_cache_dtype
    slot = kv_bytes_per_block(target.model_config, config.block_size, torch.bfloat16, config.kv_cache_dtype)
    return dataclasses.replace(target, slot_bytes=slot, step_model=step_model,
                               notes={**target.notes, "kv_cache_dtype": config.kv_cache_dtype, "kv_block_bytes": slot})


def kv_rung_layout(config: EngineConfig, policy: PolicyConfig, target: Target) -> KVLayout | None:
    """The KV-precision rung's 8-bit layout when the plan runs it (``kv_rung``, a dynamic mode over bf16 KV), on a GPU
    system's tables with rows for that format (fp8; int8 KV has none: refused, as ``--kv-cache-dtype int8``)."""
    if policy.kv_rung is None or policy.strategy != "dynamic":
        return None
    if config.kv_cache_dtype != "auto":
        raise ValueError(f"the KV rung (kv_rung={policy.kv_rung}) writes 8-bit blocks into a full-precision KV cache; "
                         f"kv_cache_dtype {config.kv_cache_dtype} is 8-bit already")
    if not isinstance(target.step_model, TableStepModel):
        raise TableError(f"kv_rung={policy.kv_rung}: the planner models it on a GPU system's tables (fp8 KV rows), "
                         f"not on {target.device}")
    if policy.kv_rung not in KV_TABLE_DTYPE:
        raise TableError(f"kv_rung={policy.kv_rung}: the attention tables have no {policy.kv_rung}-KV rows (they have "
                         f"bf16 and fp8); use kv_rung=fp8")
    return KVLayout.of(target.model_config, config.block_size, torch.bfloat16, policy.kv_rung)


def build_engine(config: EngineConfig, target: Target, clock: VirtualClock,
                 speculation: ModelledSpeculation | None = None) -> LLMEngine:
    """The planner's engine for ``config`` (its mode, memory budget, scheduler, KV format) on ``target``;
    ``speculation``: self-speculative decoding modelled with that acceptance (config.speculation decides how: off,
    auto, always; sim/speculation.py), on a GPU system's tables only."""
    target = with_kv_cache_dtype(target, config)
    # kv_rung auto: no rung, as the server resolves it on a GPU (until the fp8 rung has run on one); the planner
    # models the rung on GPU tables only (kv_rung=fp8 asks for it)
    policy = resolve_kv_rung(config.policy_config(), "cuda", False, config.kv_cache_dtype)
    morphing = policy.strategy != "off"
    extra = [p.strip() for p in config.morph_precisions.split(",") if p.strip()]
    precisions = sorted(set(policy.ladder) | set(extra)) if morphing else []
    have = set(target.layer_nbytes[0])
    missing = [p for p in precisions if p not in have]
    if missing:
        raise TableError(f"morph mode {config.morph_mode!r} needs {missing}, which {target.device} does not offer "
                         f"(has {sorted(have - {FULL})}); override the ladder, e.g. {config.morph_mode}+ladder='"
                         f"[\"{sorted(have - {FULL})[0] if have - {FULL} else 'int4'}\"]'")
    sizes = [{p: n for p, n in per_layer.items() if p in (FULL, *precisions)} for per_layer in target.layer_nbytes]
    variants = [{p: n for p, n in s.items() if p != FULL} for s in sizes] if morphing else None
    arena = plan_arena(config, target.slot_bytes, [s[FULL] for s in sizes], variants, target.non_arena_bytes,
                       lambda text: resolve_budget(target, text))
    rung = kv_rung_layout(config, policy, target)
    # the rung's chunks take logical ids above everything else: at most the 8-bit blocks of every KV slot, base and
    # layer chunks (as serve/engine/memory_assembly.py)
    rung_ids = 0 if rung is None else -(-arena.max_blocks * target.slot_bytes // rung.block_bytes) + 1
    pool = BlockPool(arena.base_blocks, max_blocks=arena.max_blocks + rung_ids, kv_format=config.kv_cache_dtype)
    ledger = arena.ledger()
    bank = SimLayerBank(sizes, arena.regions, arena.staging, target.slot_bytes, clock, target.h2d_bytes_per_s,
                        target.d2d_bytes_per_s) if morphing else None
    kv = SimKV() if rung is None else SimKV(pool.max_blocks, KVLayout.of(target.model_config, config.block_size,
                                                                          torch.bfloat16), rung, clock,
                                            target.d2d_bytes_per_s)
    kv.map_blocks(0, list(range(arena.base.start, arena.base.end)))
    memory = EngineMemory(arena=None, pool=pool, ledger=ledger, kv=kv, bank=bank, base=arena.base)  # type: ignore[arg-type]
    resources = []
    if bank is not None:
        costs = target.step_costs(precisions) if policy.cost_aware else None
        morph = build_runtime(policy, MorphPlan(precisions, list(target.swap_order), None),  # type: ignore[arg-type]
                              bank, pool, ledger, memory.kv, config.block_size,  # type: ignore[arg-type]
                              clock=clock, costs=costs, prefix_cache=config.prefix_cache_across_morph,
                              step_token_budget=config.max_num_batched_tokens,
                              kv_blocks_per_freed_slot=kv_blocks_per_slot(kv) if rung is not None else 1.0)  # type: ignore[arg-type]
        resources.append(morph)
        if rung is not None:  # the KV-precision rung, the cheapest lever, goes before layer swapping (as the engine)
            resources.insert(0, build_kv_rung(policy, pool, kv, config.prefix_cache_across_morph, morph, clock))  # type: ignore[arg-type]
            step_model = copy.copy(target.step_model)
            step_model.kv_rung = rung.kv_cache_dtype  # type: ignore[attr-defined]
            target = dataclasses.replace(target, step_model=step_model)
    tokenizer = prompt_tokenizer()
    cfg = target.model_config
    engine_cfg = dataclasses.replace(cfg, vocab_size=max(cfg.vocab_size, tokenizer.vocab_size))
    token_id = tokenizer.encode(" the")[-1]
    max_len = config.context_length(cfg.max_position_embeddings)
    spec = None
    if speculation is not None and config.speculation != "off":
        if not isinstance(target.step_model, TableStepModel):
            raise TableError(f"self-speculative decoding is modelled on a GPU system's tables, not on {target.device}; "
                             "here run it for real: bench.replay --speculation")
        spec = SimSpeculation(speculation, config.speculation, target.step_model, have, max_len,
                              config.max_num_batched_tokens, clock)
        resources.append(spec)
    executor = SimExecutor(target.step_model, bank, cfg.num_layers, clock, token_id, kv,  # type: ignore[arg-type]
                           speculation=spec)
    parts = EngineParts(model_config=engine_cfg, tokenizer=tokenizer, max_model_len=max_len,
                        device=torch.device("cpu"), dtype=torch.bfloat16, memory=memory, resources=resources,
                        executor=executor)
    return LLMEngine(config, clock=clock, parts=parts)
