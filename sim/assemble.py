"""Build a planner engine: the server's own assembly (serve/engine/assembly.py ``build_parts``: memory arithmetic,
KV pool, resource managers and their order) on a simulated device, :class:`SimDevice`, then the real LLMEngine loop
on a virtual clock.

The device answers the assembly's questions for a ``Target`` (sim/target.py: a GPU of NVIDIA's tables, or this
machine): sizes in bytes and no tensors, a layer bank whose copies take bytes over bandwidth (sim/bank.py), a KV
cache that keeps only its block table (``SimKV``), the tables' step costs for the cost-aware controller, and an
executor whose steps advance the clock (sim/executor.py), with self-speculative decoding modelled
(sim/speculation.py) when the plan assumes an acceptance rate.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import torch

from policy import FULL, PolicyConfig, StepCosts, resolve_kv_rung
from serve.config import EngineConfig
from serve.engine.assembly import build_parts
from serve.engine.engine import LLMEngine
from serve.engine.executor import Executor
from serve.engine.memory_assembly import EngineMemory, LayerSizes
from serve.memory.pressure import PressureSource
from serve.memory.sizing import ArenaPlan
from serve.model.kv_format import KVLayout
from serve.model.linear import LinearOp
from serve.model.tokenizer import Tokenizer
from serve.morph.layer_bank import MorphBank
from serve.morph.plan import MorphPlan, morph_precisions
from serve.resource_seam import ResourceManager
from sim.bank import SimKV, SimLayerBank
from sim.clock import VirtualClock
from sim.executor import SimExecutor
from sim.kernel_tables import KV_TABLE_DTYPE, TableError
from sim.speculation import ModelledSpeculation, SimSpeculation
from sim.step_model import TableStepModel
from sim.target import Target, resolve_budget, with_kv_cache_dtype


@functools.lru_cache(maxsize=1)
def prompt_tokenizer() -> Tokenizer:
    """The embedded model's tokenizer: the planner builds the replay's prompts from the same text, so prompt
    content (prefix-cache hits) is as in the real replay; lengths come from the trace."""
    from serve.model.embedded import EMBEDDED_MODEL  # noqa: PLC0415
    from serve.model.loader import load_model  # noqa: PLC0415

    return load_model(EMBEDDED_MODEL).tokenizer


def no_weights(layer: int, precision: str) -> Mapping[str, LinearOp]:
    raise TableError("the planner holds no weights: a plan's layers are their byte sizes")


class SimDevice:
    """The planner's device (serve/engine/assembly.py ``EngineDevice``) for one ``Target`` and one run."""

    torch_device = torch.device("cpu")  # the loop's logits and sampling run on the host
    dtype = torch.bfloat16              # the GPU engine's (the tables' bf16 rows)
    model = None

    def __init__(self, target: Target, clock: VirtualClock, speculation: ModelledSpeculation | None = None) -> None:
        self.target, self.clock, self.speculation = target, clock, speculation
        self.tokenizer = prompt_tokenizer()
        cfg = target.model_config
        self.model_config = dataclasses.replace(cfg, vocab_size=max(cfg.vocab_size, self.tokenizer.vocab_size))
        self.memory_kind = "cpu" if target.device_bytes is None else "cuda"  # --system local: this CPU
        self._sizes: list[dict[str, int]] = []
        self._kv = SimKV()

    def policy(self, config: EngineConfig) -> PolicyConfig:
        # kv_rung auto: no rung, as the server resolves it on a GPU (until the fp8 rung has run on one); the planner
        # models the rung on GPU tables only (kv_rung=fp8 asks for it)
        return resolve_kv_rung(config.policy_config(), "cuda", False, config.kv_cache_dtype)

    def morph_plan(self, config: EngineConfig, policy: PolicyConfig) -> MorphPlan | None:
        """The mode's precisions, refused where the target has no bytes (tables: no GEMM rows) for one of them."""
        if policy.strategy == "off":
            return None
        precisions = morph_precisions(policy, config.morph_precisions)
        have = set(self.target.layer_nbytes[0])
        missing = [p for p in precisions if p not in have]
        if missing:
            offered = sorted(have - {FULL})
            raise TableError(f"morph mode {config.morph_mode!r} needs {missing}, which {self.target.device} does not "
                             f"offer (has {offered}); override the ladder, e.g. {config.morph_mode}+ladder='"
                             f"[\"{offered[0] if offered else 'int4'}\"]'")
        return MorphPlan(precisions, list(self.target.swap_order), no_weights)

    # ---- memory: byte counts (serve/engine/memory_assembly.py) -----------------------------------------------------
    def device_memory_bytes(self, text: str) -> int:
        return resolve_budget(self.target, text)

    def kv_block_bytes(self, config: EngineConfig) -> int:
        return self.target.slot_bytes

    def layer_sizes(self, morphing: MorphPlan | None) -> LayerSizes:
        held = (FULL, *(morphing.precisions if morphing is not None else ()))
        self._sizes = [{p: n for p, n in per_layer.items() if p in held} for per_layer in self.target.layer_nbytes]
        variants = [{p: n for p, n in s.items() if p != FULL} for s in self._sizes] if morphing is not None else None
        return LayerSizes([s[FULL] for s in self._sizes], variants, self.target.non_arena_bytes)

    def place(self, arena: ArenaPlan, morphing: MorphPlan | None, releasable: bool) -> tuple[None, SimLayerBank | None]:
        if morphing is None:
            return None, None
        t = self.target
        return None, SimLayerBank(self._sizes, arena.regions, arena.staging, t.slot_bytes, self.clock,
                                  t.h2d_bytes_per_s, t.d2d_bytes_per_s)

    def check_kv_rung(self, kv_format: str) -> None:
        """The rung is modelled on a GPU system's tables with rows for its format (fp8; int8 KV has none)."""
        if not isinstance(self.target.step_model, TableStepModel):
            raise TableError(f"kv_rung={kv_format}: the planner models it on a GPU system's tables (fp8 KV rows), "
                             f"not on {self.target.device}")
        if kv_format not in KV_TABLE_DTYPE:
            raise TableError(f"kv_rung={kv_format}: the attention tables have no {kv_format}-KV rows (they have "
                             f"bf16 and fp8); use kv_rung=fp8")

    def kv_cache(self, config: EngineConfig, arena: None, max_blocks: int, rung: KVLayout | None) -> SimKV:
        if rung is not None:
            full = KVLayout.of(self.model_config, config.block_size, self.dtype)
            self._kv = SimKV(max_blocks, full, rung, self.clock, self.target.d2d_bytes_per_s)
        return self._kv

    # ---- the morph runtime's inputs, the executor ------------------------------------------------------------------
    def morph_costs(self, policy: PolicyConfig, plan: MorphPlan, bank: MorphBank) -> StepCosts | None:
        return self.target.step_costs(plan.precisions) if policy.cost_aware else None

    def pressure(self, config: EngineConfig, policy: PolicyConfig) -> PressureSource | None:
        return None  # no outside memory on a virtual device

    def cost_check(self, managers: list[ResourceManager], memory: EngineMemory) -> ResourceManager | None:
        return None  # the target's step model is the table: nothing to time on a virtual device

    def executor(self, config: EngineConfig, memory: EngineMemory, plan: MorphPlan | None, max_model_len: int,
                 clock: Callable[[], float]) -> tuple[Executor, list[ResourceManager]]:
        step_model = self.target.step_model
        if self._kv.q8 is not None:  # the KV-precision rung's blocks read their format's attention rows
            assert isinstance(step_model, TableStepModel)  # check_kv_rung refused any other
            step_model = step_model.reading(kv_rung=self._kv.q8.layout.kv_cache_dtype)
        speculation = None
        if self.speculation is not None and config.speculation != "off":
            if not isinstance(step_model, TableStepModel):
                raise TableError(f"self-speculative decoding is modelled on a GPU system's tables, not on "
                                 f"{self.target.device}; here run it for real: bench.replay --speculation")
            speculation = SimSpeculation(self.speculation, config.speculation, step_model,
                                         set(self.target.layer_nbytes[0]),
                                         max_model_len, config.max_num_batched_tokens, self.clock)
        token_id = self.tokenizer.encode(" the")[-1]  # every sampled row yields it (the replay forces output lengths)
        executor = SimExecutor(step_model, memory.bank, self.model_config.num_layers, self.clock, token_id, self._kv,
                               speculation=speculation)
        return executor, [speculation] if speculation is not None else []


def build_engine(config: EngineConfig, target: Target, clock: VirtualClock,
                 speculation: ModelledSpeculation | None = None) -> LLMEngine:
    """The planner's engine for ``config`` (its mode, memory budget, scheduler, KV format) on ``target``;
    ``speculation``: self-speculative decoding modelled with that acceptance (config.speculation decides how: off,
    auto, always; sim/speculation.py), on a GPU system's tables only."""
    device = SimDevice(with_kv_cache_dtype(target, config), clock, speculation)
    return LLMEngine(config, clock=clock, parts=build_parts(config, device, clock))
