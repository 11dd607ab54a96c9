"""Full-precision linear ops and fusion helpers; quantized ops live in serve/model/quantized_linear.py.

Every linear op is a callable x[T, K] -> y[T, N] with an exact `nbytes`, so the layer bank can account
for device memory whatever precision a layer runs at.

fp32 on CPU runs our AVX2 kernel (serve/model/kernels/linear_avx2.cpp) up to ``fp32_kernel_max_rows`` rows and
oneDNN's matmul above that (:func:`onednn_linear`): torch's F.linear goes through MKL, which is slower than both on
the AMD CPUs measured (README "fp32 kernels and paged decode attention"). The row counts where our kernels hand
over are this machine's, measured by ``make build-engines`` (serve/model/crossovers.py; defaults where nothing was
measured).

A decoder's fp32 projections and the LM head go one step further (:meth:`DenseLinear.blocked`): their one copy of
the weight is stored in the blocked layout oneDNN's matmul reads fastest (:class:`BlockedLayout`), and oneDNN runs
on those very bytes through a non-owning view, so batched steps get prepacked-weight speed without a second copy
the morph runtime would have to account for; one or two rows run our kernel for that layout
(blocked_linear_avx2.cpp), which streams it faster than any plain-layout GEMV measured here. A tied embedding
looks its tokens up in the blocked head (:meth:`DenseLinear.weight_rows`), so it too stays one copy.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from serve.model import crossovers, kernels


@functools.cache
def onednn_available() -> bool:
    """Whether torch's oneDNN linear (``torch.ops.mkldnn._linear_pointwise``, the op torch's own CPU compiler
    emits) exists in this build."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through oneDNN's matmul on the weight as it lies (plain ``[N, K]`` rows, or the MKLDNN view of
    a blocked weight, :meth:`BlockedLayout.onednn_view`): the same fp32 math as MKL's GEMM, summed in another order,
    and faster than it at every row count measured."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; fp32 CPU operands run our AVX2 kernel up to ``fp32_kernel_max_rows`` rows
    (serve/model/crossovers.py) when it is built (``kernels.ops()``) and oneDNN above (same fp32 math, summed in
    another order)."""
    if (x.dim() == 2 and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.is_contiguous() and (bias is None or bias.dtype == torch.float32)):
        bias = None if bias is None else bias.contiguous()
        if x.shape[0] <= crossovers.current().fp32_kernel_max_rows:
            ops = kernels.ops()
            if ops is not None:
                return ops.fp32_linear(x.contiguous(), weight, bias)
        if onednn_available():
            return onednn_linear(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)


MAX_CACHED_VIEWS = 4096
"""Views a layout keeps before it forgets them all (a served model has one address per weight, a few per swap)."""

PACK_HINT_ROWS = 512
"""The batch size oneDNN is told when it picks the layout (the prefill token budget's order of magnitude)."""


@dataclass(frozen=True, slots=True, eq=False)
class BlockedLayout:
    """oneDNN's blocked layout of an fp32 ``[n, k]`` weight: ``W[i, j]`` at ``(i // block) * k * block + j * block
    + i % block``, described by oneDNN's serialized memory descriptor ``md``. One per weight shape and shared by
    every op of that shape (slots and no ``__dict__``: the placement walk, serve/morph/placement.py, does not take
    it for a weight). ``views`` caches the non-owning MKLDNN view of each address a weight of this shape was
    called at: a view only says "these bytes, this layout", so it stays right for whatever weight lies there."""

    n: int
    k: int
    block: int
    md: torch.Tensor
    views: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # may name freed bytes: never print

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The plain ``[n, k]`` weight in this layout: a ``[n // block, k, block]`` tensor (a shape nothing can
        mistake for the plain one)."""
        return weight.reshape(self.n // self.block, self.block, self.k).transpose(1, 2).contiguous()

    def unpack(self, blocked: torch.Tensor) -> torch.Tensor:
        return blocked.transpose(1, 2).reshape(self.n, self.k)

    def rows(self, blocked: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the plain weight, gathered from ``blocked`` without unpacking the rest."""
        return blocked.transpose(1, 2)[torch.div(ids, self.block, rounding_mode="floor"), ids % self.block]

    def onednn_view(self, blocked: torch.Tensor) -> torch.Tensor:
        """The MKLDNN view of ``blocked``'s bytes. It does not own them: use it only while ``blocked`` lives."""
        ptr = blocked.data_ptr()
        view = self.views.get(ptr)
        if view is None:
            if len(self.views) >= MAX_CACHED_VIEWS:  # weights placed afresh again and again (evaluation copies)
                self.views.clear()
            view = self.views[ptr] = kernels.ops().mkldnn_weight_view(blocked, self.n, self.k, self.md)
        return view


@functools.cache
def blocked_layout(n: int, k: int) -> BlockedLayout | None:
    """The layout oneDNN packs an fp32 ``[n, k]`` weight into on this machine, if it is one our kernel reads (a
    row block of 16, 32, 48 or 64 dividing ``n``, no padding); None otherwise (and without oneDNN or our kernels):
    such weights keep the plain layout. Probed once per shape by packing a weight whose every value is unique."""
    if not onednn_available() or kernels.ops() is None or n * k >= 2 ** 29:
        return None
    # distinct normal floats (bit patterns from 1.0 up): packing copies them, so each value names its position
    probe = torch.arange(n * k, dtype=torch.int32).add_(0x3F800000).view(torch.float32).view(n, k)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, PACK_HINT_ROWS)
        nbytes = torch.ops.mkldnn._nbytes(packed)
        md = torch.ops.mkldnn._get_mkldnn_serialized_md(packed).clone()
        ptr = torch.ops.mkldnn.data_ptr(packed)
    except (AttributeError, RuntimeError):
        return None
    if nbytes != n * k * 4:
        return None
    raw = torch.frombuffer((ctypes.c_float * (n * k)).from_address(ptr), dtype=torch.float32)  # packed stays alive
    for block in (64, 48, 32, 16):
        if n % block == 0:
            layout = BlockedLayout(n, k, block, md)
            if torch.equal(layout.pack(probe).view(-1), raw):
                return layout
    return None


def blocked_linear(x: torch.Tensor, blocked: torch.Tensor, layout: BlockedLayout,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of fp32 CPU ``x`` with a weight stored in ``layout``: our kernel up to ``blocked_kernel_max_rows``
    rows (serve/model/crossovers.py), oneDNN's matmul on the same bytes above."""
    x = x.contiguous()
    if x.shape[0] <= crossovers.current().blocked_kernel_max_rows:
        return kernels.ops().fp32_blocked_linear(x, blocked, layout.n, layout.block, bias)
    return onednn_linear(x, layout.onednn_view(blocked), bias)


class LinearOp(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


class DenseLinear:
    """A full-precision linear. ``weight`` is plain ``[n, k]``, or, with ``layout``, that weight in oneDNN's
    blocked layout (:meth:`blocked`); :meth:`plain_weight` gives ``[n, k]`` either way."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 layout: BlockedLayout | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.layout = layout

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout is not None and x.dim() == 2 and x.dtype == torch.float32:
            return blocked_linear(x, self.weight, self.layout, self.bias)
        return linear(x, self.plain_weight(), self.bias)

    def plain_weight(self) -> torch.Tensor:
        return self.weight if self.layout is None else self.layout.unpack(self.weight)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the plain ``[n, k]`` weight (``F.embedding(ids, plain_weight())``), gathered straight
        from the blocked layout when there is one: a tied embedding looks its tokens up in the LM head's weight
        without a plain copy of it."""
        if self.layout is None:
            return F.embedding(ids, self.weight)
        return self.layout.rows(self.weight, ids)

    def blocked(self) -> "DenseLinear":
        """This op with its weight in oneDNN's blocked layout where that applies (an fp32 CPU weight of a shape
        :func:`blocked_layout` accepts, an fp32 bias or none); otherwise this op unchanged."""
        w = self.weight
        if (self.layout is not None or w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2
                or (self.bias is not None and self.bias.dtype != torch.float32)):
            return self
        layout = blocked_layout(*w.shape)
        if layout is None:
            return self
        bias = None if self.bias is None else self.bias.contiguous()
        return DenseLinear(layout.pack(w), bias, layout)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    @classmethod
    def fused(cls, weights: Sequence[torch.Tensor],
              biases: Sequence[torch.Tensor | None] | None = None) -> "DenseLinear":
        """One matmul for projections that share an input (q/k/v, gate/up): fewer, larger GEMMs."""
        bias = None
        if biases is not None and any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)
                              for w, b in zip(weights, biases)])
        return cls(torch.cat(list(weights), dim=0).contiguous(), bias)


class ConcatLinear:
    """Runs several ops on the same input and concatenates outputs (for ops that cannot be fused)."""

    def __init__(self, ops: Sequence[LinearOp], bias: torch.Tensor | None = None) -> None:
        self.ops = list(ops)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([op(x) for op in self.ops], dim=-1)
        return y + self.bias if self.bias is not None else y

    @property
    def nbytes(self) -> int:
        return sum(op.nbytes for op in self.ops) + (self.bias.nbytes if self.bias is not None else 0)
