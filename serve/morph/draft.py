"""The speculative draft's weights: every decoder layer at the draft precisions and a quantized LM head, the same model
at a lower precision (no second model, no training, no new weights).

A layer drafts one ladder step below the precision it serves at (``policy.speculation.precision_below``): int8 for a
full-precision layer by default, int4 for a layer morphing already moved to int8. The variants come from the
morph layer bank when the mode morphs (on CPU its host copies are the very tensors a forward reads), else from
the engine directory's prebuilt variants, else round-to-nearest from the weights; each is built on first use
and kept (host memory outside the arena's ledger: the KV budget does not shrink for it). The LM head is
quantized round-to-nearest per draft precision (int8 per channel, int4 group-wise) from the fp32 head.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from policy import FULL
from policy.speculation import precision_below
from serve.model.linear import DenseLinear, LinearOp
from serve.model.llama import DecoderLayer, LlamaModel
from serve.model.quantized_layer import quantized_layer
from serve.model.quantized_linear import host_packed
from serve.model.rtn import choose_int4_block_size, quantize_linear_rtn
from serve.morph.layer_bank import LayerBank, host_copy
from serve.morph.placement import remap
from serve.morph.plan import VariantSource

LayerSource = Callable[[int, str], DecoderLayer]


def bank_source(bank: LayerBank) -> LayerSource:
    """Variants from the morph layer bank (pinned host copies on CUDA are copied to the device once)."""
    def source(i: int, precision: str) -> DecoderLayer:
        layer = bank.host[i][precision]
        return layer if bank.device.type == "cpu" else remap(layer, lambda t: t.to(bank.device))
    return source


def variant_source(model: LlamaModel, variants: VariantSource) -> LayerSource:
    """Variants from a morph plan's source (an engine directory's prebuilt ones, or round-to-nearest)."""
    def source(i: int, precision: str) -> DecoderLayer:
        layer = host_copy(quantized_layer(model.layers[i], variants(i, precision), precision), model.device)
        return layer if model.device.type == "cpu" else remap(layer, lambda t: t.to(model.device))
    return source


class DraftBank:
    def __init__(self, model: LlamaModel, source: LayerSource, int4_group_size: int | None = None) -> None:
        self.model = model
        self.source = source
        self.int4_group_size = int4_group_size
        self._layers: dict[tuple[int, str], DecoderLayer] = {}
        self._heads: dict[str, LinearOp] = {}

    def layer(self, i: int, precision: str) -> DecoderLayer:
        key = (i, precision)
        if key not in self._layers:
            self._layers[key] = self.source(i, precision)
        return self._layers[key]

    def layers(self, precision: str) -> list[DecoderLayer]:
        """The draft's decoder layers for ``precision``: each one ladder step below the precision it serves at now (read
        from the model every call: morphing may have moved a layer since the last draft)."""
        out = []
        for i, served in enumerate(self.model.layers):
            p = precision_below(served.precision, precision)
            out.append(served if p == served.precision else self.layer(i, p))
        return out

    def precisions(self, precision: str) -> list[str]:
        return [precision_below(layer.precision, precision) for layer in self.model.layers]

    def head(self, precision: str) -> LinearOp:
        """The LM head quantized to ``precision`` (built once per draft precision)."""
        if precision not in self._heads:
            head = self.model.head
            weight = head.plain_weight() if isinstance(head, DenseLinear) else head.weight  # type: ignore[attr-defined]
            group = self.int4_group_size or choose_int4_block_size([weight.shape[1]])
            with torch.inference_mode():
                op = host_packed(quantize_linear_rtn(weight.float().cpu(), precision, group), self.model.device)
            self._heads[precision] = op if self.model.device.type == "cpu" else op.to(self.model.device)  # type: ignore[attr-defined]
        return self._heads[precision]

    def prepare(self, precision: str) -> None:
        """Build ``precision``'s draft now (its layers for the precisions served now, and its head), so the first draft
        step is not also the one that builds them: the controller times its first steps and would read a build as
        the cost of drafting."""
        self.layers(precision)
        self.head(precision)

    def resident(self) -> Mapping[str, int]:
        """Draft layers and heads built so far (stats)."""
        return {"layers": len(self._layers), "heads": len(self._heads)}


def full_layers(model: LlamaModel) -> bool:
    return all(layer.precision == FULL for layer in model.layers)
