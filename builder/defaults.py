"""CLI defaults shared by builder/__main__.py (kept free of torch imports) and builder/build.py."""

from __future__ import annotations

from policy.precisions import QUANTIZED_PRECISIONS as PRECISIONS  # noqa: F401 - the CLI's default list (stdlib-only import)
from serve.model.embedded import EMBEDDED_MODEL

MODEL = EMBEDDED_MODEL
CALIB_TOKENS = 512
"""modelopt calibration tokens (2 sequences of 256): int8 + int4 AWQ + fp8 take ~25 s for SmolLM2-135M."""
PROFILE_TOKENS = 256
"""Tokens for the layer-importance profile; its cost is ~ tokens x layers^3 (~2 min for 30 layers, 2 cores)."""
SEQ_LEN = 256
KV_BLOCK_SIZE = 16
"""Tokens per KV block assumed for the morph levels' ``kv_blocks_freed`` (serve.config.EngineConfig.block_size;
builder may not import serve.config, tests/builder/test_builder.py checks the two agree)."""
