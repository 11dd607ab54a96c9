"""Per-layer quantized variants: modelopt calibration (builder/quantize.py), RTN only if modelopt fails."""

from __future__ import annotations

import contextlib
import io
import re
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from builder.quantize import quantize_model_rtn, quantize_with_modelopt, token_batches_loop
from serve.logging_setup import get_logger
from serve.model.quantized_linear import QuantizedLinear, quant_format

log = get_logger("builder.variants")

_LINEAR_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)$")


@dataclass
class VariantResult:
    precision: str
    layers: dict[int, dict[str, QuantizedLinear]]
    method: str
    block_size: int | None
    seconds: float
    fallback_reason: str | None = None
    quantized_model: nn.Module | None = None  # modelopt's fake-quant model, kept for the TensorRT-LLM export

    def describe(self) -> dict[str, object]:
        formats = sorted({q.format for layer in self.layers.values() for q in layer.values()})
        return {"method": self.method, "format": formats[0] if len(formats) == 1 else formats,
                "group_size": self.block_size, "seconds": round(self.seconds, 3),
                "fallback_reason": self.fallback_reason}


def by_layer(named: Mapping[str, QuantizedLinear]) -> dict[int, dict[str, QuantizedLinear]]:
    """``{"model.layers.3.mlp.up_proj": q}`` -> ``{3: {"up_proj": q}}``."""
    out: dict[int, dict[str, QuantizedLinear]] = {}
    for name, q in named.items():
        match = _LINEAR_NAME.search(name)
        if match is None:
            raise ValueError(f"not a decoder-layer linear: {name}")
        out.setdefault(int(match.group(1)), {})[match.group(2)] = q
    return dict(sorted(out.items()))


@contextlib.contextmanager
def captured_output(event: str) -> Iterator[None]:
    """modelopt prints and warns freely; keep the CLI's stdout clean and log it at debug level instead."""
    buffer = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(buffer):
        warnings.simplefilter("always")
        yield
    log.debug(event, stdout=buffer.getvalue()[-2000:], warnings=sorted({str(w.message)[:200] for w in caught}))


def build_variants(model: nn.Module, precision: str, batches: list[torch.Tensor], group_size: int) -> VariantResult:
    """Quantize every decoder linear of ``model`` (left unchanged) at ``precision``."""
    start = time.perf_counter()
    fmt = quant_format(precision)
    block_size = group_size if fmt.grouped else None
    try:
        with captured_output("modelopt_quantize"), torch.no_grad():
            result = quantize_with_modelopt(model, precision, token_batches_loop(batches), block_size=block_size)
        method = fmt.modelopt.method
        return VariantResult(precision, by_layer(result.layers), method, result.block_size,
                             time.perf_counter() - start, quantized_model=result.model)
    except Exception as exc:  # noqa: BLE001 - any modelopt failure falls back to RTN, recorded in the manifest
        reason = f"{type(exc).__name__}: {exc}"
        log.warning("modelopt_failed_using_rtn", precision=precision, error=reason)
        layers = quantize_model_rtn(model, precision, block_size)
        return VariantResult(precision, by_layer(layers), "round-to-nearest fallback (builder/quantize.py)",
                             block_size, time.perf_counter() - start,
                             fallback_reason=reason)
