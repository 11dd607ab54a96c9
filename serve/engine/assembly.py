"""Building what the engine loop runs on: the device and dtype, the model, its memory, the resource managers (the
morph runtime when the mode morphs), the executor (:func:`build_parts`), and the scheduler the config names
(:func:`make_scheduler`).

The planner (sim/) builds :class:`EngineParts` of its own (a simulated executor, layer bank and virtual clock)
and hands them to the very engine loop the server runs; both ways in end in ``LLMEngine``'s one assembly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from policy import resolve_kv_rung
from serve.config import EngineConfig
from serve.engine.executor import TorchExecutor
from serve.engine.scheduler import Scheduler
from serve.engine.slai import SlaiConfig, SlaiScheduler
from serve.logging_setup import get_logger
from serve.memory.pressure import pressure_source
from serve.model.crossover_measure import apply_measured
from serve.model.llama import LlamaModel
from serve.model.loader import LoadedModel
from serve.model.model_config import ModelConfig
from serve.model.tokenizer import Tokenizer
from serve.engine.memory_assembly import EngineMemory, build_memory
from serve.engine.kv_rung import build_kv_rung, kv_blocks_per_slot
from serve.resource_seam import ResourceManager
from serve.engine.spec_assembly import wrap_executor
from serve.morph.plan import load_model_and_plan, resolve_plan
from serve.morph.setup import build_runtime

log = get_logger("morphserve.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when a GPU is visible, else CPU; a CUDA device that is not there is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device "
                             f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


@dataclass
class EngineParts:
    """What the loop runs on. ``executor.execute(chunks) -> (logits, sampled chunks)`` is the executor contract
    (TorchExecutor's); ``model`` is None when the parts are simulated."""

    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    memory: EngineMemory
    resources: list[ResourceManager]  # in the order the loop calls them
    executor: Any
    model: LlamaModel | None = None


def build_parts(config: EngineConfig, loaded: LoadedModel | None, clock: Callable[[], float]) -> EngineParts:
    """The model on its device, its memory (arena, KV pool, layer bank), the resource managers the mode asks for
    (the morph runtime) and the torch executor. ``loaded``: weights already in memory (else the config's model is
    opened)."""
    device = resolve_device(config.device)
    dtype = DTYPES[config.dtype or ("float32" if device.type == "cpu" else "bfloat16")]
    plan = None
    if loaded is None:
        loaded, plan = load_model_and_plan(config)
    max_model_len = config.context_length(loaded.config.max_position_embeddings)
    model = LlamaModel(loaded.config, loaded.weights, device, dtype, max_model_len)
    policy = resolve_kv_rung(config.policy_config(), device.type, dtype == torch.float32, config.kv_cache_dtype)
    plan = resolve_plan(config, policy, loaded.weights, loaded.config.num_layers, plan)
    # where our CPU kernels hand over to oneDNN on this machine (measured by make build-engines, else defaults)
    chosen = apply_measured(model, plan.engine_dir if plan is not None else None)
    log.info("kernel_crossovers", source=chosen.source, **chosen.values())
    memory = build_memory(config, model, plan, policy)
    resources: list[ResourceManager] = []
    if memory.bank is not None and plan is not None:
        morph = build_runtime(policy, plan, memory.bank, memory.pool, memory.ledger, memory.kv, config.block_size,
                              clock=clock, prefix_cache=config.prefix_cache_across_morph,
                              pressure=pressure_source(config.memory_pressure_source, device)
                              if policy.strategy == "dynamic" else None,
                              step_token_budget=config.max_num_batched_tokens,
                              kv_blocks_per_freed_slot=kv_blocks_per_slot(memory.kv) if memory.kv.mixes_formats else 1.0)
        resources.append(morph)
        if memory.kv.mixes_formats:  # the KV-precision rung, the cheapest lever, goes before layer swapping
            resources.insert(0, build_kv_rung(policy, memory.pool, memory.kv, config.prefix_cache_across_morph, morph,
                                              clock))
    # self-speculative decoding (off: the torch executor alone); its manager runs after the morph runtime's
    executor, speculation = wrap_executor(config, model, TorchExecutor(model, memory.kv), memory.bank, plan,
                                          loaded.weights, max_model_len, clock)
    if speculation is not None:
        resources.append(speculation)
    return EngineParts(loaded.config, loaded.tokenizer, max_model_len, device, dtype, memory, resources,
                       executor, model)


def make_scheduler(config: EngineConfig, pool, clock: Callable[[], float],
                   on_shortfall: Callable[[int], object] | None = None, device_type: str = "cpu") -> Scheduler:
    """The scheduler policy the config names (decisions only; the executor interface is the same).
    ``on_shortfall(blocks)``: called before the scheduler preempts for want of KV blocks (quantize before preempt)."""
    if config.scheduler == "slai":
        theta_low, theta_high = config.slai_thetas(device_type)  # unset: the device's calibration
        slai = SlaiConfig(theta=config.slai_theta, theta_low=theta_low, theta_high=theta_high,
                          kv_threshold=config.slai_theta_kv_threshold, max_decodes=config.slai_max_decodes)
        return SlaiScheduler(pool, config.block_size, config.max_num_seqs, config.max_num_batched_tokens, clock, slai,
                             prefix_caching=config.enable_prefix_caching, on_shortfall=on_shortfall)
    return Scheduler(pool, config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
                     prefix_caching=config.enable_prefix_caching, on_shortfall=on_shortfall)
