"""The int4 weight layouts: the portable nibble packing stored on disk, our AVX2 kernel's blocked layout, torch's
CPU and CUDA (tinygemm) packings, and the group sizes and shapes the kernels accept."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from serve.model import kernels
from serve.model.quantized_linear.common import _check

INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
"""Group sizes accepted by ``aten._weight_int4pack_mm_for_cpu``."""

_INT4_N_MULTIPLE = 16
"""``aten._convert_weight_to_int4pack_for_cpu`` requires N % 16 == 0."""

_INT4_BLOCK = 32
"""Inputs per 16-byte run of the ``"avx2"`` int4 layout (see :func:`pack_int4_blocked`)."""


def choose_int4_block_size(in_features: Iterable[int]) -> int:
    """128 when every in_features allows it, else 64 (e.g. SmolLM's hidden 576), else 32."""
    dims = sorted(set(in_features))
    for block in (128, 64, 32):
        if all(k % block == 0 for k in dims):
            return block
    raise ValueError(f"no int4 block size in (128, 64, 32) divides all input dims {dims}")


def check_int4_block_size(in_features: Iterable[int], block_size: int) -> None:
    if block_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {block_size}")
    bad = sorted({k for k in in_features if k % block_size})
    if bad:
        dims = ", ".join(map(str, bad))
        raise ValueError(
            f"int4 group size {block_size} does not divide in_features {dims}; "
            "use a group size that divides every input dim (e.g. 64 or 32 for a hidden size of 576)"
        )


def _validate_int4_shape(n: int, k: int, group_size: int) -> None:
    _check(
        group_size in INT4_GROUP_SIZES,
        f"int4 group size must be one of {INT4_GROUP_SIZES} (CPU kernel limit), got {group_size}",
    )
    _check(
        k % group_size == 0,
        f"int4 group size {group_size} does not divide in_features {k}; "
        f"use a group size that divides it (e.g. 64 or 32 for a hidden size of 576)",
    )
    _check(
        n % _INT4_N_MULTIPLE == 0,
        f"int4 CPU kernel needs out_features divisible by {_INT4_N_MULTIPLE}, got {n}",
    )


def pack_int4_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Portable storage packing: codes ``[N, K]`` in 0..15 -> uint8 ``[N, K/2]``,
    low nibble = even k, high nibble = odd k."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_int4_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_nibbles`: uint8 ``[N, K/2]`` -> int32 codes ``[N, K]``."""
    low = (packed & 0x0F).to(torch.int32)
    high = (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def unpack_int4_out_pairs(packed: torch.Tensor) -> torch.Tensor:
    """modelopt's unified-checkpoint int4 layout (``pack_int4_in_uint8``): uint8 ``[N/2, K]``, byte ``[j, k]`` holds
    row 2j's signed code in its low nibble and row 2j+1's in its high nibble -> unsigned codes ``[N, K]`` in 0..15
    (signed + 8, i.e. the nibble with its sign bit flipped)."""
    _check(packed.dim() == 2 and packed.dtype == torch.uint8,
           f"int4 weight must be uint8 [out/2, in], got {packed.dtype} {tuple(packed.shape)}")
    pairs = torch.stack([packed & 0x0F, packed >> 4], dim=1)  # [N/2, 2, K]: rows 2j, 2j+1
    return (pairs ^ 0x08).reshape(-1, packed.shape[1]).to(torch.int32)


def pack_int4_blocked(codes: torch.Tensor) -> torch.Tensor:
    """Our CPU kernel's layout (``"avx2"``): codes ``[N, K]`` in 0..15, K a multiple of 32 -> uint8
    ``[N, K/2]``; per row, each run of 32 inputs is 16 bytes, byte j = code[32b + j] | code[32b + 16 + j] << 4
    (one 16-byte load unpacks to two runs of 16 consecutive inputs)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // _INT4_BLOCK, 2, _INT4_BLOCK // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4_blocked(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_blocked`: uint8 ``[N, K/2]`` -> int32 codes ``[N, K]``."""
    n = packed.shape[0]
    p = packed.reshape(n, -1, _INT4_BLOCK // 2)
    return torch.stack([p & 0x0F, p >> 4], dim=2).reshape(n, -1).to(torch.int32)


def _cpu_int4_layout() -> str:
    return "avx2" if kernels.ops() is not None else "cpu"


def _layout_device(layout: str) -> str:
    return "cpu" if layout == "avx2" else layout


def _pack_int4_for_kernel(codes: torch.Tensor, device: torch.device, layout: str | None = None) -> torch.Tensor:
    """Codes packed for ``device``'s kernel; on CPU ``layout`` (default: ours when it is available)."""
    codes = codes.to(torch.int32)
    if device.type == "cuda":
        return _pack_int4_cuda(codes.to(device))
    if (layout or _cpu_int4_layout()) == "avx2":
        return pack_int4_blocked(codes.cpu())
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.cpu().contiguous(), 1)


def _pack_int4_cuda(codes: torch.Tensor) -> torch.Tensor:
    # Checked on an H200 (codes identical after repacking): the CUDA tinygemm packer takes uint8 [N, K/2] with the
    # *even* k in the high nibble (as torchao does) and returns an int32 tiled layout.
    k = codes.shape[1]
    inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
    nibbles = ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack(nibbles, inner_k_tiles)
