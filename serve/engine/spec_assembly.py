"""Wiring self-speculative decoding into the engine's parts: the draft bank, this machine's measured step costs,
the controller, the resource manager and the speculative executor around the torch executor.

``speculation`` off builds none of it (the torch executor as before). ``auto`` needs the step costs measured on this
machine with the LM head's in the engine directory (``make build-engines`` writes them): without them it logs why
and builds nothing (a model loaded from a GGUF file or a Hugging Face directory, or an engine built on another
machine); it never measures at start. ``always`` drafts without a cost model. The first draft precision (int8) is built
here, at start; the others on first use (serve/morph/draft.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from policy import FULL
from policy.speculation import SpeculationConfig, SpeculationController
from serve.config import EngineConfig
from serve.engine.executor import TorchExecutor
from serve.engine.spec_executor import SpeculativeExecutor
from serve.engine.spec_manager import SpeculationManager
from serve.logging_setup import get_logger
from serve.model.llama import LlamaModel
from serve.model.step_costs import find_measured
from serve.morph.draft import DraftBank, LayerSource, bank_source, variant_source
from serve.morph.layer_bank import LayerBank
from serve.morph.plan import MorphPlan, rtn_plan

log = get_logger("morphserve.speculation")

DRAFT_PRECISIONS = ("int8", "int4")


def draft_source(model: LlamaModel, bank: LayerBank | None, plan: MorphPlan | None,
                 weights: Mapping[str, torch.Tensor] | None, config: EngineConfig) -> tuple[LayerSource, str]:
    """Where draft layers come from: the morph layer bank when it holds the precisions, else the plan's variants (an
    engine directory's), else round-to-nearest from the weights."""
    if bank is not None and set(DRAFT_PRECISIONS) <= bank.precisions:
        return bank_source(bank), "layer bank"
    if plan is not None and plan.engine_dir is not None:
        return variant_source(model, plan.variant_source), f"engine directory {plan.engine_dir}"
    if weights is None:
        raise ValueError("speculation needs the layers' variants: an engine directory, a morphing layer bank or "
                         "the model's weights")
    rtn = rtn_plan(weights, model.config.num_layers, list(DRAFT_PRECISIONS), config.int4_group_size)
    return variant_source(model, rtn.variant_source), "round-to-nearest"


def wrap_executor(config: EngineConfig, model: LlamaModel, executor: TorchExecutor, bank: LayerBank | None,
                  plan: MorphPlan | None, weights: Mapping[str, torch.Tensor] | None, max_model_len: int,
                  clock: Callable[[], float]) -> tuple[TorchExecutor | SpeculativeExecutor, SpeculationManager | None]:
    """The executor the engine runs and the speculation manager to host (None: speculation is not built)."""
    if config.speculation == "off":
        return executor, None
    cfg = model.config
    shape = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    costs, where = find_measured(shape, model.device, model.dtype, [FULL, *DRAFT_PRECISIONS],
                                 plan.engine_dir if plan is not None else None)
    if config.speculation == "auto" and (costs is None or not costs.rest_s):
        log.info("speculation", mode="auto", built=False,
                 reason=f"no step costs with the LM head measured on this machine ({where}); run make build-engines")
        return executor, None
    source, origin = draft_source(model, bank, plan, weights, config)
    controller = SpeculationController(SpeculationConfig(mode=config.speculation, precisions=DRAFT_PRECISIONS), costs)
    drafts = DraftBank(model, source, config.int4_group_size)
    drafts.prepare(DRAFT_PRECISIONS[0])  # built now, not inside the first (timed) draft step
    manager = SpeculationManager(controller, drafts, config.max_num_batched_tokens, max_model_len, clock)
    log.info("speculation", mode=config.speculation, built=True, drafts_from=origin, costs=where)
    return SpeculativeExecutor(executor, manager, tuple(cfg.eos_token_ids), seed=config.seed + 1), manager
