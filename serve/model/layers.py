"""The decoder layer's projections: the one table of their names and where they live in HF checkpoints."""

from __future__ import annotations

# In the order a decoder layer applies them (attention, then MLP).
PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS: tuple[str, ...] = PROJECTIONS[:4]
PROJECTION_MODULE: dict[str, str] = {p: ("self_attn" if p in ATTENTION_PROJECTIONS else "mlp") for p in PROJECTIONS}


def projection_key(layer: int, proj: str) -> str:
    """HF name prefix of a projection, e.g. ``model.layers.3.self_attn.q_proj``."""
    return f"model.layers.{layer}.{PROJECTION_MODULE[proj]}.{proj}"
