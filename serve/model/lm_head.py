"""The LM head's weights as the exact int8 blocks they were stored in, when they were.

GGUF models commonly store the token embedding (tied to the LM head) as Q8_0: per 32 inputs, int8 values
times one fp16 scale. The loader dequantizes every tensor to fp32, so the fp32 head holds exactly ``q * d``.
At decode batch sizes the head is a memory-bound GEMV over vocab x hidden weights (SmolLM2: 49152 x 576,
113 MB in fp32, 29 MB as int8 blocks); llama.cpp reads the Q8_0 tensor directly. :func:`int8_blocks`
recovers ``q`` and ``d`` from the fp32 weights and keeps them only when ``q * d`` gives back every weight bit
for bit, so the kernel (``int8_block_linear`` in qlinear_avx2.cpp, fp32 activations and accumulation) computes
the same logits as the fp32 head up to fp32 summation order. Heads that were never int8 (safetensors
checkpoints, bf16 exports) fail the check and stay fp32. The int8 GEMV widens every weight to fp32, so its cost
grows with the rows: it runs up to ``int8_head_max_rows`` sampled rows (serve/model/crossovers.py: measured by
``make build-engines`` on the machine, else a default), the blocked fp32 head above.
"""

from __future__ import annotations

import torch

BLOCK = 32

_TILE_ROWS = 4096  # rows converted at a time: bounded temporaries for a 49152-row head


def int8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q int8 [N, K], d fp32 [N, K/32])`` with ``q * d == weight`` exactly, or None when ``weight`` (fp32,
    CPU, K a multiple of 32) is not int8 blocks of 32 with one scale each."""
    if (weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu"
            or weight.shape[1] % BLOCK or weight.numel() == 0):
        return None
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8)
    d = torch.empty(n, k // BLOCK, dtype=torch.float32)
    for start in range(0, n, _TILE_ROWS):
        w = weight[start:start + _TILE_ROWS].reshape(-1, k // BLOCK, BLOCK)
        # the largest |q| of a Q8_0 block is 127, so amax / 127 is its scale exactly (amax = 127 * d is exact
        # in fp32: an fp16 scale has 11 significant bits); all-zero blocks get d = 0, q = 0
        scale = w.abs().amax(-1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        values = w / safe
        if not torch.equal(values, values.round()) or values.abs().max() > 127:
            return None
        if not torch.equal(values * scale.unsqueeze(-1), w):
            return None
        q[start:start + _TILE_ROWS] = values.reshape(-1, k).to(torch.int8)
        d[start:start + _TILE_ROWS] = scale
    return q, d
