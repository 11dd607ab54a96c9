"""Reaching an engine's morph runtime in tests through the engine's public accessor (never an attribute), and the
independent reference a mid-decode swap is checked against."""

from __future__ import annotations

from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.model.llama import DecoderLayer
from serve.model.loader import LoadedModel
from serve.model.quantized_layer import quantized_layer
from serve.morph.layer_bank import host_copy
from serve.morph.placement import remap
from serve.morph.plan import rtn_plan
from serve.morph.runtime import MorphRuntime


def morph(engine: LLMEngine) -> MorphRuntime:
    """The engine's morph runtime; fails the test when the engine hosts none (mode off)."""
    runtime = engine.resource_manager(MorphRuntime)
    assert runtime is not None, f"morph mode {engine.config.morph_mode!r} hosts no morph runtime"
    return runtime


def direct_variant(engine: LLMEngine, loaded: LoadedModel, layer: int, precision: str) -> DecoderLayer:
    """Layer ``layer`` at ``precision`` built as a morphing engine builds its variants (round-to-nearest on the
    loaded weights, fused and packed for the device), but on the device directly: no arena, no layer bank."""
    plan = rtn_plan(loaded.weights, loaded.config.num_layers, [precision], engine.config.int4_group_size)
    variant = host_copy(quantized_layer(engine.model.layers[layer], plan.variant_source(layer, precision), precision),
                        engine.device)
    return variant if engine.device.type == "cpu" else remap(variant, lambda t: t.to(engine.device))


def decode_with_direct_swap_at(engine: LLMEngine, loaded: LoadedModel, swap_step: int, layers: tuple[int, ...],
                               precision: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The independent reference for a mid-decode swap: ``engine`` (mode off, its own KV cache never moved) decodes
    one request and at iteration ``swap_step`` its ``layers`` are replaced in place by their ``precision`` variants.
    A morphing engine that quantizes the same layers at the same step must produce exactly these tokens: the KV
    cached before the swap is what both read afterwards, so a KV block lost, overwritten or remapped by the swap
    (or the variant installed at the wrong layer) shows up as different tokens."""
    assert engine.resource_manager(MorphRuntime) is None, "the reference must not morph"
    tokens: list[int] = []
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       callback=lambda o: tokens.extend(o.new_token_ids))
    step = 0
    while engine.has_unfinished_requests():
        if step == swap_step:
            for i in layers:
                engine.model.layers[i] = direct_variant(engine, loaded, i, precision)
        engine.step()
        step += 1
    return tokens
