"""The engine's one assembly: what the loop runs on, built from a config and a device (:func:`build_parts`), and the
scheduler the config names (:func:`make_scheduler`).

A device (:class:`EngineDevice`) answers what differs between the server's engine and the planner's: the server's
is a model loaded onto a torch device (serve/engine/torch_device.py), the planner's a GPU of NVIDIA's tables as
byte counts and step times on a virtual clock (sim/device.py). Everything between (the memory arithmetic, the KV
pool, which resource managers the mode hosts, in which order, and what each needs of the others) is built here, once,
for both: ``LLMEngine`` calls :func:`build_parts` on a ``TorchDevice``, the planner on its ``SimDevice``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from policy import PolicyConfig, StepCosts
from serve.config import EngineConfig
from serve.engine.executor import Executor
from serve.engine.kv_rung import build_kv_rung, kv_blocks_per_slot
from serve.engine.memory_assembly import EngineMemory, MemoryDevice, build_memory
from serve.engine.quality_meter import build_quality_meter
from serve.engine.scheduler import Scheduler
from serve.engine.slai import SlaiConfig, SlaiScheduler
from serve.memory.block_pool import BlockPool
from serve.memory.pressure import PressureSource
from serve.model.llama import LlamaModel
from serve.model.model_config import ModelConfig
from serve.model.tokenizer import Tokenizer
from serve.morph.layer_bank import MorphBank
from serve.morph.plan import MorphPlan
from serve.morph.setup import build_runtime
from serve.resource_seam import ResourceManager


class EngineDevice(MemoryDevice, Protocol):
    """What an engine is assembled on. :func:`build_parts` asks it, in this order: the mode's policy, the variants
    it morphs with, its memory (serve/engine/memory_assembly.py ``MemoryDevice``: sizes, budget, arena, layer bank,
    KV cache), the morph runtime's step costs and pressure source, and last its executor (and the resource managers
    that come with it)."""

    tokenizer: Tokenizer
    torch_device: torch.device  # where the loop's tensors live (logits, sampling, generators)
    model: LlamaModel | None    # None: simulated

    def policy(self, config: EngineConfig) -> PolicyConfig:
        """The mode's policy with what depends on the device (``kv_rung="auto"``) made concrete."""
        ...

    def morph_plan(self, config: EngineConfig, policy: PolicyConfig) -> MorphPlan | None:
        """The variants, swap order and their source; None when nothing morphs and no engine directory has any."""
        ...

    def morph_costs(self, policy: PolicyConfig, plan: MorphPlan, bank: MorphBank) -> StepCosts | None:
        """The per-precision step costs the cost-aware controller weighs (None: it decides without them)."""
        ...

    def pressure(self, config: EngineConfig, policy: PolicyConfig) -> PressureSource | None:
        """Where the morph runtime reads free memory outside the engine (None: nowhere)."""
        ...

    def executor(self, config: EngineConfig, memory: EngineMemory, plan: MorphPlan | None, max_model_len: int,
                 clock: Callable[[], float]) -> tuple[Executor, list[ResourceManager]]:
        """What runs a batch, and the resource managers that come with it (self-speculative decoding)."""
        ...

    def cost_check(self, managers: list[ResourceManager], memory: EngineMemory) -> ResourceManager | None:
        """The check of the step-cost table the ``managers`` weigh against this machine while serving, handing them
        a corrected one (serve/morph/cost_check.py); None where there is nothing to time (a simulated device, no
        table)."""
        ...


@dataclass
class EngineParts:
    """What the loop runs on; ``model`` is None when the parts are simulated."""

    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    memory: EngineMemory
    resources: list[ResourceManager]  # in the order the loop calls them
    executor: Executor
    model: LlamaModel | None = None


def build_parts(config: EngineConfig, device: EngineDevice, clock: Callable[[], float]) -> EngineParts:
    """The engine's parts on ``device``: its memory, the resource managers the mode asks for and the executor."""
    policy = device.policy(config)
    plan = device.morph_plan(config, policy)
    max_model_len = config.context_length(device.model_config.max_position_embeddings)
    memory = build_memory(config, device, policy, plan)
    resources = resource_managers(config, device, policy, plan, memory, clock)
    executor, more = device.executor(config, memory, plan, max_model_len, clock)
    check = device.cost_check([*resources, *more], memory)  # last: it corrects the table the others read
    return EngineParts(device.model_config, device.tokenizer, max_model_len, device.torch_device, device.dtype, memory,
                       [*resources, *more, *([check] if check is not None else [])], executor, device.model)


def resource_managers(config: EngineConfig, device: EngineDevice, policy: PolicyConfig, plan: MorphPlan | None,
                      memory: EngineMemory, clock: Callable[[], float]) -> list[ResourceManager]:
    """The levers the mode hosts, in the order the loop calls them: the KV-precision rung (the cheapest lever) ahead
    of layer morphing. What one needs of another goes in through its constructor: the runtime the blocks a freed slot
    becomes, the rung the runtime's next swap (read-only, ``LayerSwaps``), the runtime the quality meter's reading
    (read-only, ``QualitySource``). The meter comes last: it observes the batch the levers shaped."""
    if memory.bank is None or plan is None:
        return []
    mixed = memory.kv.mixes_formats
    meter = build_quality_meter(config.quality_meter, policy.quality_confidence, device.model, memory.bank,
                                memory.pool, memory.kv, clock, config.seed,
                                floor_set=policy.quality_floor is not None or bool(policy.quality_floor_by_tier))
    # the meter observes last; the floor reads it
    morph = build_runtime(policy, plan.swap_order, memory.bank, memory.pool, memory.ledger, memory.kv,
                          config.block_size, clock, costs=device.morph_costs(policy, plan, memory.bank),
                          prefix_cache=config.prefix_cache_across_morph, pressure=device.pressure(config, policy),
                          step_token_budget=config.max_num_batched_tokens,
                          kv_blocks_per_freed_slot=kv_blocks_per_slot(memory.kv) if mixed else 1.0, quality=meter)
    rung = [build_kv_rung(policy, memory.pool, memory.kv, config.prefix_cache_across_morph, morph,
                          clock)] if mixed else []
    return [*rung, morph, *([meter] if meter is not None else [])]


def make_scheduler(config: EngineConfig, pool: BlockPool, clock: Callable[[], float],
                   on_shortfall: Callable[[int], object] | None = None, device_type: str = "cpu") -> Scheduler:
    """The scheduler policy the config names (decisions only; the executor interface is the same).
    ``on_shortfall(blocks)``: called before the scheduler preempts for want of KV blocks (quantize before preempt)."""
    if config.scheduler == "slai":
        theta_low, theta_high = config.slai_thetas(device_type)  # unset: the device's calibration
        slai = SlaiConfig(theta=config.slai_theta, theta_low=theta_low, theta_high=theta_high,
                          kv_threshold=config.slai_theta_kv_threshold, max_decodes=config.slai_max_decodes,
                          deadline_admission=config.slai_admission == "deadline")
        return SlaiScheduler(pool, config.block_size, config.max_num_seqs, config.max_num_batched_tokens, clock, slai,
                             prefix_caching=config.enable_prefix_caching, on_shortfall=on_shortfall)
    return Scheduler(pool, config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
                     prefix_caching=config.enable_prefix_caching, on_shortfall=on_shortfall)
