"""The KV cache's storage formats: full precision (the engine's dtype) and 8-bit (int8 on CPU, fp8 e4m3 on CUDA).

``kv_cache_dtype`` (EngineConfig; vLLM's ``--kv-cache-dtype``, TensorRT-LLM's ``KvCacheConfig.dtype``): ``auto`` keeps
K/V at the engine's dtype; ``int8`` / ``fp8`` store every K and V row as 8-bit codes with one fp32 scale per
(token, kv head): ``scale = absmax / 127`` and ``code = round(x / scale)`` for int8 (symmetric, round half to even);
``scale = absmax / 448`` and ``code = e4m3(x / scale)`` for fp8 (448 is e4m3fn's largest finite value).

One 8-bit block holds, in this order, the codes ``[2 (K, V), layers, block_size, kv_heads, head_dim]`` (one byte
each) and the scales ``[2, layers, block_size, kv_heads]`` (fp32), padded up to a multiple of ``unit`` bytes:
one layer's K (or V) codes of a block (``block_size * kv_heads * head_dim`` bytes), so every block starts on a
whole "entry" of the codes viewed as ``[entries, block_size, kv_heads, head_dim]`` and of the scales viewed as
``[entries, block_size, kv_heads]`` (the decode kernel and the dense reads index whole entries, as the
full-precision path does), and a multiple of the arena's 64-byte alignment. Per token-head fp32 scales cost
``4 / head_dim`` of the codes (6 % at head_dim 64): SmolLM2-135M (30 layers, 3 kv heads, head_dim 64, block 16)
has 737,280-byte fp32 blocks and 196,608-byte int8 blocks, 3.75x the tokens in the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from policy.precisions import KV_CACHE_DTYPES

QMAX = {"int8": 127.0, "fp8": 448.0}
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
ARENA_ALIGN = 64
"""serve/memory/arena.py ALIGN (this room may not import serve.memory): every block starts 64-byte aligned."""


@dataclass(frozen=True)
class KVLayout:
    """One KV block's bytes for a model shape and a ``kv_cache_dtype`` (the module docstring gives the layout)."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    kv_cache_dtype: str
    model_dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    @classmethod
    def of(cls, config, block_size: int, model_dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVLayout:
        """``config``: a ModelConfig (or anything with num_layers, num_kv_heads and head_dim)."""
        return cls(config.num_layers, block_size, config.num_kv_heads, config.head_dim, kv_cache_dtype, model_dtype)

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def row_elems(self) -> int:
        """Elements of one token's K (or V) in one layer: every kv head."""
        return self.kv_heads * self.head_dim

    @property
    def code_bytes(self) -> int:
        """The K and V values of every layer: codes (8-bit) or the engine dtype's elements (auto)."""
        size = 1 if self.quantized else torch.empty((), dtype=self.model_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.row_elems * size

    @property
    def scale_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.kv_heads * 4 if self.quantized else 0

    @property
    def entry_bytes(self) -> int:
        """One layer's K (or V) codes of a block: the unit the decode kernel indexes."""
        return self.block_size * self.row_elems

    @property
    def scale_entry_bytes(self) -> int:
        """One layer's K (or V) scales of a block."""
        return self.block_size * self.kv_heads * 4

    @property
    def unit(self) -> int:
        return math.lcm(self.entry_bytes, self.scale_entry_bytes, ARENA_ALIGN)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: the arena's slot when this format is the engine's."""
        if not self.quantized:
            return self.code_bytes
        if (2 * self.num_layers * self.head_dim) % 4:
            raise ValueError(f"8-bit KV needs layers x head_dim even, got {self.num_layers} x {self.head_dim}")
        return -(-(self.code_bytes + self.scale_bytes) // self.unit) * self.unit

    @property
    def entries_per_block(self) -> int:
        """Code entries (``entry_bytes`` each) one block spans, padding included."""
        return self.block_bytes // self.entry_bytes

    @property
    def scale_entries_per_block(self) -> int:
        return self.block_bytes // self.scale_entry_bytes

    @property
    def scale_entry_offset(self) -> int:
        """Where a block's scales start, in scale entries from the block's start."""
        return self.code_bytes // self.scale_entry_bytes


def check_kv_cache_dtype(kv_cache_dtype: str, device_type: str) -> None:
    """A clear error for a format the device cannot serve: fp8 KV is CUDA-only (no CPU fp8 attention)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8" and device_type != "cuda":
        raise ValueError("kv_cache_dtype fp8 (e4m3) needs a CUDA device; on CPU use int8 (int8 codes with fp32 "
                         "scales, read in place by the CPU attention kernel) or auto")


def quantize(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, kv_heads, head_dim]`` -> (codes ``[N, kv_heads, head_dim]`` as int8 bytes (fp8 codes reinterpreted),
    fp32 scales ``[N, kv_heads]``), one scale per row and head: ``absmax / QMAX`` (0 for an all-zero row)."""
    xf = x.float()
    scale = xf.abs().amax(-1) / QMAX[kv_cache_dtype]
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    y = xf * inv.unsqueeze(-1)
    if kv_cache_dtype == "int8":
        codes = y.round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.int8)
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, kv_cache_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """``codes [..., kv_heads, head_dim]`` (int8 bytes) x ``scales [..., kv_heads]`` in ``dtype``."""
    values = codes.float() if kv_cache_dtype == "int8" else codes.view(torch.float8_e4m3fn).float()
    return (values * scales.unsqueeze(-1)).to(dtype)
