"""What an engine does with a static checkpoint: a modelopt unified checkpoint whose quantized layers have no
full-precision weights beside them (a morph level exported by ``make build-engines``,
serve/model/unified_checkpoint.py).

It serves such a checkpoint as it is, in morph mode ``off``: every morph mode needs each layer's full-precision
weights (the layer bank's source for every restore, and the source of the variants it swaps in), so a mode that morphs
is refused with the reason, as is ``speculation=always`` (its drafts are quantized variants of full-precision layers
and its output comes from full precision). ``speculation=auto`` is left out with a log line saying why. An engine
directory served with ``level`` (serve/model/engine_dir.py ``level_checkpoint``) is such a checkpoint too.
"""

from __future__ import annotations

import dataclasses

from policy import PolicyConfig
from serve.config import EngineConfig
from serve.logging_setup import get_logger
from serve.model.loader import LoadedModel

log = get_logger("morphserve.engine")


def describe(loaded: LoadedModel) -> str:
    assert loaded.quantized is not None
    layers = loaded.quantized.precisions
    counts = {p: sum(1 for q in layers.values() if q == p) for p in sorted(set(layers.values()))}
    held = ", ".join(f"{n} at {p}" for p, n in counts.items())
    return (f"{loaded.source} is a static checkpoint ({held} of {loaded.config.num_layers} layers, no full-precision "
            "copy)")


def static_config(config: EngineConfig, policy: PolicyConfig, loaded: LoadedModel) -> EngineConfig:
    """``config`` as the engine runs a static checkpoint (speculation auto left out); ValueError naming the reason
    when the config asks for what such a checkpoint cannot give. Any other model: ``config`` unchanged."""
    if loaded.quantized is None or not loaded.quantized.layers:
        return config
    if policy.strategy != "off":
        raise ValueError(f"{describe(loaded)}: morph mode {config.morph_mode!r} needs every layer's full-precision "
                         "weights to morph from; serve it with morph_mode off, or serve the engine directory it came "
                         "from (make build-engines) with a morph mode")
    if config.speculation == "always":
        raise ValueError(f"{describe(loaded)}: speculation always drafts with quantized variants of full-precision "
                         "layers and outputs from full precision; serve it with speculation off or auto")
    if config.speculation == "auto":
        log.info("speculation", mode="auto", built=False, reason=f"{describe(loaded)}: nothing to draft against")
        return dataclasses.replace(config, speculation="off")
    return config
