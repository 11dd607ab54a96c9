"""The one vocabulary of layer precisions, shared by every room (policy is the leaf everyone may import).

A configuration signature writes one character per decoder layer (the morph runtime's events, the
benchmark's summaries, the quality evaluator): f = full, 8 = int8, 4 = int4, e = fp8.
"""

from __future__ import annotations

from collections.abc import Iterable

FULL = "full"
# Quantized precisions a layer can be swapped to, in the order the builder writes them.
QUANTIZED_PRECISIONS: tuple[str, ...] = ("int8", "int4", "fp8")
ALL_PRECISIONS: tuple[str, ...] = (FULL, *QUANTIZED_PRECISIONS)
PRECISION_CODE: dict[str, str] = {FULL: "f", "int8": "8", "int4": "4", "fp8": "e"}
CODE_PRECISION: dict[str, str] = {code: precision for precision, code in PRECISION_CODE.items()}
# The KV cache's storage formats (EngineConfig.kv_cache_dtype; serve/model/kv_format.py): "auto" keeps K/V at the
# engine's dtype, "int8" / "fp8" store 8-bit codes with per token-head scales (fp8: CUDA only).
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "int8", "fp8")


def check_quantized_precision(precision: str) -> str:
    """``precision`` itself when it is a quantized precision, else ValueError naming the known ones."""
    if precision not in QUANTIZED_PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {QUANTIZED_PRECISIONS}")
    return precision


def signature(precisions: Iterable[str]) -> str:
    """The configuration signature of per-layer precisions, e.g. ``['full', 'int4'] -> 'f4'``."""
    return "".join(PRECISION_CODE[p] for p in precisions)


def full_signature(num_layers: int) -> str:
    return PRECISION_CODE[FULL] * num_layers
