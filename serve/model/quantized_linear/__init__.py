"""Runtime weight-only quantized linear layers that feed aten kernels (and our CPU kernels) directly.

One module per format, each a small dataclass (``forward``, ``dequantize``, exact ``nbytes``, ``to(device)``,
safetensors round trips) with its round-to-nearest quantizer:

- :mod:`.int8` -- :class:`Int8WeightOnly`: int8 ``[N, K]`` + bf16 per-output-channel scales;
- :mod:`.int4` -- :class:`Int4WeightOnly`: group-wise 4-bit codes, bf16 scale and zero, optional AWQ
  ``pre_quant_scale``; its kernel layouts in :mod:`.int4_packing`;
- :mod:`.fp8` -- :class:`Fp8WeightOnly`: e4m3fn ``[N, K]`` + fp32 per-tensor or per-channel scale;

:mod:`.common` holds what they share (the :class:`QuantizedLinear` protocol, input handling, the CPU kernel
dispatch, rounding), :mod:`.registry` the one table of formats the rest of the code base looks formats up in.
This package re-exports them, so ``serve.model.quantized_linear`` reads as one module to its callers.
"""

from serve.model.quantized_linear.common import (
    SMALL_BATCH,
    Calibration,
    QuantizedLinear,
    _q8_activations,
    _q8_gemv_input,
)
from serve.model.quantized_linear.fp8 import Fp8WeightOnly, quantize_fp8_rtn
from serve.model.quantized_linear.int4 import Int4WeightOnly, quantize_int4_rtn
from serve.model.quantized_linear.int4_packing import (
    INT4_GROUP_SIZES,
    check_int4_block_size,
    choose_int4_block_size,
    pack_int4_blocked,
    pack_int4_nibbles,
    unpack_int4_blocked,
    unpack_int4_nibbles,
)
from serve.model.quantized_linear.int8 import Int8WeightOnly, quantize_int8_rtn
from serve.model.quantized_linear.registry import (
    FORMATS,
    REGISTRY,
    ModeloptRecipe,
    QuantFormat,
    format_of,
    fuse_quantized,
    host_packed,
    load_quantized_linear,
    quant_format,
)

__all__ = [
    "FORMATS", "INT4_GROUP_SIZES", "REGISTRY", "SMALL_BATCH", "Calibration", "Fp8WeightOnly", "Int4WeightOnly",
    "Int8WeightOnly", "ModeloptRecipe", "QuantFormat", "QuantizedLinear", "check_int4_block_size",
    "choose_int4_block_size", "format_of", "fuse_quantized", "host_packed", "load_quantized_linear",
    "pack_int4_blocked", "pack_int4_nibbles", "quant_format", "quantize_fp8_rtn", "quantize_int4_rtn",
    "quantize_int8_rtn", "unpack_int4_blocked", "unpack_int4_nibbles", "_q8_activations", "_q8_gemv_input",
]
