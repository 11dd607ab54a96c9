"""The device the server's engine is assembled on (serve/engine/assembly.py ``EngineDevice``): the model loaded onto
a torch device (CPU or CUDA), its memory a real arena with the weights placed in their regions, layers moved by the
layer bank, the paged KV cache, this machine's measured step costs and memory pressure, and the torch executor
(self-speculative decoding around it when asked). The planner's device answers the same questions with byte counts
and a virtual clock (sim/device.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from policy import FULL, PolicyConfig, StepCosts, resolve_kv_rung
from serve.config import EngineConfig
from serve.engine.executor import Executor, TorchExecutor
from serve.engine.memory_assembly import EngineMemory, LayerSizes
from serve.engine.memory_budget import device_memory_bytes
from serve.engine.spec_assembly import wrap_executor
from serve.engine.static_model import static_config
from serve.logging_setup import get_logger
from serve.memory.arena import ALIGN, Arena
from serve.memory.pressure import PressureSource, pressure_source
from serve.memory.sizing import ArenaPlan
from serve.model import kernels
from serve.model.crossover_measure import apply_measured
from serve.model.kv_cache import BlockStore, PagedKVCache, block_shape, kv_bytes_per_block
from serve.model.kv_format import KVLayout, check_kv_cache_dtype
from serve.model.llama import DecoderLayer, LlamaModel
from serve.model.loader import LoadedModel
from serve.model.quantized_layer import build_model
from serve.morph.cost_check import CostCheck
from serve.morph.layer_bank import LayerBank, MorphBank
from serve.morph.placement import arena_nbytes, remap
from serve.morph.plan import (
    MorphPlan,
    check_device_supports,
    host_bank,
    load_model_and_plan,
    morph_precisions,
    resolve_plan,
)
from serve.morph.runtime import MorphRuntime
from serve.morph.setup import cost_inputs, step_costs
from serve.resource_seam import ResourceManager

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


class TorchDevice:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """The config's model on the config's device (``loaded``: weights already in memory, else the model is
        opened: an engine directory brings its variants and swap order)."""
        self.torch_device = device = resolve_device(config.device)
        self.dtype = DTYPES[config.dtype or ("float32" if device.type == "cpu" else "bfloat16")]
        self.memory_kind = device.type
        self.built_plan: MorphPlan | None = None  # an engine directory's variants
        if loaded is None:
            loaded, self.built_plan = load_model_and_plan(config.model, config.level)
        self.loaded = loaded
        self.model_config, self.tokenizer = loaded.config, loaded.tokenizer
        # a static checkpoint's quantized layers come from its runtime layers (serve/engine/static_model.py)
        static_config(config, self.policy(config), loaded)  # what such a checkpoint cannot serve, refused before work
        self.model: LlamaModel = build_model(loaded, device, self.dtype,
                                             config.context_length(loaded.config.max_position_embeddings))
        # where our CPU kernels hand over to oneDNN on this machine (measured by make build-engines, else defaults)
        chosen = apply_measured(self.model, self.built_plan.engine_dir if self.built_plan is not None else None)
        # and which kernels (and ISA variant: serve/model/kernels/isa.py) the CPU layers run
        cpu_kernels = kernels.describe() if device.type == "cpu" else "none (CUDA)"
        log.info("kernel_crossovers", source=chosen.source, cpu_kernels=cpu_kernels, **chosen.values())
        self._host: dict[int, dict[str, DecoderLayer]] | None = None  # every layer at every precision (morphing)

    def policy(self, config: EngineConfig) -> PolicyConfig:
        return resolve_kv_rung(config.policy_config(), self.torch_device.type, self.dtype == torch.float32,
                               config.kv_cache_dtype)

    def morph_plan(self, config: EngineConfig, policy: PolicyConfig) -> MorphPlan | None:
        return resolve_plan(self.built_plan, policy, morph_precisions(policy, config.morph_precisions),
                            self.loaded.weights, self.model_config.num_layers, config.int4_group_size, config.model)

    # ---- memory (serve/engine/memory_assembly.py) ----------------------------------------------------------------
    def device_memory_bytes(self, text: str) -> int:
        return device_memory_bytes(self.torch_device, text)

    def kv_block_bytes(self, config: EngineConfig) -> int:
        check_kv_cache_dtype(config.kv_cache_dtype, self.torch_device.type)
        slot = kv_bytes_per_block(self.model_config, config.block_size, self.dtype, config.kv_cache_dtype)
        if slot % ALIGN:
            raise ValueError(f"a KV block of {slot} bytes is not a multiple of {ALIGN}; choose another block_size")
        return slot

    def layer_sizes(self, morphing: MorphPlan | None) -> LayerSizes:
        """The loaded layers' arena bytes, and (morphing) every variant's, quantized now into host memory."""
        model = self.model
        if morphing is not None:
            check_device_supports(model.device, morphing.precisions)
            self._host = host_bank(model, morphing)
        norms = sum(layer.input_norm.nbytes + layer.post_attention_norm.nbytes for layer in model.layers)
        variants = None
        if self._host is not None:
            variants = [{p: arena_nbytes(v) for p, v in per_layer.items() if p != FULL} for per_layer
                        in self._host.values()]
        return LayerSizes([arena_nbytes(layer) for layer in model.layers], variants, model.non_layer_nbytes + norms)

    def place(self, arena_plan: ArenaPlan, morphing: MorphPlan | None,
              releasable: bool) -> tuple[Arena, LayerBank | None]:
        arena = Arena(arena_plan.arena_slots, arena_plan.slot_bytes, self.torch_device, releasable=releasable)
        for i, r in enumerate(arena_plan.regions):  # full weights move into their regions; the originals are dropped
            self.model.layers[i] = remap(self.model.layers[i], arena.allocator(r).place)
        if self._host is None:
            return arena, None
        return arena, LayerBank(self.model, arena, arena_plan.regions, arena_plan.staging, self._host)

    def check_kv_rung(self, kv_format: str) -> None:
        check_kv_cache_dtype(kv_format, self.torch_device.type)

    def kv_cache(self, config: EngineConfig, arena: Arena | None, max_blocks: int,
                 rung: KVLayout | None) -> PagedKVCache:
        assert arena is not None  # place() always makes one here
        cfg, bs = self.model_config, config.block_size
        if config.kv_cache_dtype == "auto":
            return PagedKVCache(cfg, bs, arena.slots_as(self.dtype, block_shape(cfg, bs)), max_blocks,
                                None if rung is None else BlockStore.quantized(rung, arena.buf))
        return PagedKVCache.quantized(cfg, bs, arena.buf, max_blocks, config.kv_cache_dtype, self.dtype)

    # ---- the morph runtime's inputs --------------------------------------------------------------------------------
    def morph_costs(self, policy: PolicyConfig, plan: MorphPlan, bank: MorphBank) -> StepCosts | None:
        """A cost-aware dynamic mode's step costs: the engine directory's or this machine's cache, else measured now
        on the layers the bank serves."""
        if policy.cost_aware and policy.strategy == "dynamic":
            assert isinstance(bank, LayerBank)
            return step_costs(self.model, bank, plan.engine_dir)
        return None

    def pressure(self, config: EngineConfig, policy: PolicyConfig) -> PressureSource | None:
        return pressure_source(config.memory_pressure_source,
                               self.torch_device) if policy.strategy == "dynamic" else None

    def executor(self, config: EngineConfig, memory: EngineMemory, plan: MorphPlan | None, max_model_len: int,
                 clock: Callable[[], float]) -> tuple[Executor, list[ResourceManager]]:
        assert isinstance(memory.kv, PagedKVCache)
        config = static_config(config, self.policy(config), self.loaded)  # a static checkpoint drafts nothing
        executor, speculation = wrap_executor(config, self.model, TorchExecutor(self.model, memory.kv),
                                              memory.bank if isinstance(memory.bank, LayerBank) else None, plan,
                                              self.loaded.weights, max_model_len, clock)
        return executor, [speculation] if speculation is not None else []

    def cost_check(self, managers: list[ResourceManager], memory: EngineMemory) -> ResourceManager | None:
        """The morph runtime's cost-aware table checked while serving; a correction goes to every manager that weighs
        step costs (the runtime's controller, speculation's)."""
        runtime = next((m for m in managers if isinstance(m, MorphRuntime)), None)
        if runtime is None or runtime.costs is None or not isinstance(memory.bank, LayerBank):
            return None
        users = [m for m in managers if callable(getattr(m, "use_costs", None))]
        layers, shape, head = cost_inputs(self.model, memory.bank)
        return CostCheck(self.model, layers, shape, head, runtime.costs, str(runtime.costs.meta.get("measured", "")),
                         on_correct=lambda costs: [m.use_costs(costs) for m in users])
