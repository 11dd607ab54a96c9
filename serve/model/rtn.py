"""Plain round-to-nearest quantizers into the runtime formats of :mod:`serve.model.quantized_linear`.

No modelopt and no calibration data: int8 per-channel symmetric, int4 symmetric group-wise, fp8 per tensor
or per channel. The runtime uses them for on-the-fly variants (no engine directory). Each format's quantizer
lives in its own module of the package; this module is the dispatch by precision (through the format
registry) and keeps the names its callers import.
"""

from __future__ import annotations

import torch

from serve.model.quantized_linear import (
    QuantizedLinear,
    check_int4_block_size,
    choose_int4_block_size,
    quant_format,
    quantize_fp8_rtn,
    quantize_int4_rtn,
    quantize_int8_rtn,
)

__all__ = ["check_int4_block_size", "choose_int4_block_size", "quantize_fp8_rtn", "quantize_int4_rtn",
           "quantize_int8_rtn", "quantize_linear_rtn"]


def quantize_linear_rtn(weight: torch.Tensor, precision: str, group_size: int = 128) -> QuantizedLinear:
    """The plain RTN quantizer of ``precision`` (``group_size`` is used by grouped formats, int4, only)."""
    return quant_format(precision).quantize_rtn(weight, group_size)
