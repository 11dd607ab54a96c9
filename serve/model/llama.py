"""Llama-family decoder forward in plain torch over a paged KV cache.

One forward serves a mixed batch: decode tokens (one per sequence) followed by prefill chunks (each attended
causally, offset by the tokens already cached). GQA is computed without repeating K/V: the query heads of a
group become extra query rows against their shared KV head. On fp32 CPU our kernels attend (decode straight over
the paged blocks, fp32 or int8 KV, prompt chunks with the prompt attention kernel); elsewhere torch's SDPA does,
decodes as a padded batch and chunks after cached tokens under an explicit mask, over K/V read back from the cache
(8-bit KV dequantized). With 8-bit KV every attention sees K/V as stored: a whole prompt attends over its own
fresh K/V after their round trip through the codes, so chunking and prefix hits do not change what is attended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from serve.model import crossovers, kernels
from serve.model.kv_cache import KVIndex, PagedKVCache
from serve.model.linear import DenseLinear, LinearOp
from serve.model.lm_head import int8_blocks
from serve.model.model_config import ModelConfig
from serve.model.rope import RotaryEmbedding, rotate


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, computed in fp32 and cast back to the input dtype before the weight (as HF does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: LinearOp
    o: LinearOp
    gate_up: LinearOp
    down: LinearOp
    precision: str = "full"

    @property
    def nbytes(self) -> int:
        return (self.input_norm.nbytes + self.post_attention_norm.nbytes + self.qkv.nbytes + self.o.nbytes
                + self.gate_up.nbytes + self.down.nbytes)


@dataclass
class PrefillChunk:
    """A prompt chunk in the flat batch: ``num_tokens`` tokens from ``token_start``, its sequence's positions
    ``context_start`` on. With nothing cached before it (``context_start`` 0: a whole prompt, or a first chunk) it
    attends causally over its own fresh K/V; otherwise also over the cached tokens, read through its block table."""

    token_start: int             # index into the flat token batch
    num_tokens: int
    context_start: int = 0       # tokens of its sequence already cached (= its first token's position)
    block_table: torch.Tensor | None = None  # [ceil(context_len / block_size)] logical block ids; None at start 0

    @property
    def context_len(self) -> int:
        """Tokens this chunk attends to: the cached ones and its own."""
        return self.context_start + self.num_tokens


@dataclass
class ForwardBatch:
    """The executor-to-model contract (vLLM's shape): where each token's K/V is written (``slot_mapping``), and
    what each decode attends to as its block table and context length. The model maps logical blocks to physical
    slots (``kv.block_map``) and builds any mask itself."""

    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    slot_mapping: torch.Tensor    # [T] logical slot (block * block_size + offset) each token's K/V is written to
    num_decodes: int              # the first num_decodes tokens are single-token decodes
    decode_block_tables: torch.Tensor | None = None  # [B, nb] logical block ids; a shorter context's row padded
    #                                                  with its own first block (mapped, never attended)
    decode_context_lens: torch.Tensor | None = None  # [B] tokens each decode attends to (its new one included)
    decode_ragged: bool = False   # some context is shorter than nb * block_size (the dense path masks the rest)
    prefills: list[PrefillChunk] = field(default_factory=list)
    sample_indices: torch.Tensor | None = None  # [S] flat token indices whose logits are wanted


@dataclass(frozen=True)
class _ChunkContext:
    """Where a prompt chunk after cached tokens reads its context: its blocks' physical slots, and the causal mask
    over them where SDPA attends (the prompt kernel needs none)."""

    blocks: torch.Tensor          # [1, nb] physical slots
    formats: torch.Tensor         # [1, nb] their block formats (kv.block_format)
    length: int                   # tokens attended (cached + the chunk's own)
    mask: torch.Tensor | None     # [num_tokens, length] bool, query i sees keys up to its position

    @staticmethod
    def of(pc: PrefillChunk, kv: PagedKVCache, masked: bool) -> _ChunkContext:
        assert pc.block_table is not None, "a chunk after cached tokens reads them through its block table"
        mask = None
        if masked:
            dev = pc.block_table.device
            q_pos = torch.arange(pc.context_start, pc.context_len, device=dev)
            mask = torch.arange(pc.context_len, device=dev)[None, :] <= q_pos[:, None]
        return _ChunkContext(kv.block_map[pc.block_table].view(1, -1), kv.block_format[pc.block_table].view(1, -1),
                             pc.context_len, mask)

    def read(self, kv: PagedKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[length, kv_heads, head_dim]`` (contiguous): whole blocks gathered, the tail past ``length``
        dropped."""
        k, v = kv.read_blocks(layer, self.blocks, self.formats)
        return k[0, : self.length], v[0, : self.length]


@dataclass
class _BatchKV:
    """The batch's KV locations and RoPE tables, computed once per forward and shared by every layer."""

    new: KVIndex
    decode_blocks: torch.Tensor | None   # [B, nb] physical slots of the decodes' blocks
    decode_formats: torch.Tensor | None  # [B, nb] their block formats (kv.block_format)
    decode_entries: Any                  # kv.decode_index of them: the paged kernel's layer-0 entries (layer i: + i);
    #                                      None: the dense path attends (no kernel, or formats it cannot read)
    decode_mask: torch.Tensor | None     # [B, 1, 1, nb * block_size] bool; None when nothing is padding (or unmasked)
    decode_lens: torch.Tensor | None     # [B] context length of each decode (its new token included)
    prefills: list[_ChunkContext | None]  # None for a chunk at position 0 (attends over its own fresh K/V)
    cos: torch.Tensor
    sin: torch.Tensor

    @staticmethod
    def locate(batch: ForwardBatch, kv: PagedKVCache, rope: RotaryEmbedding, decode_kernel: bool,
               dense_chunks: bool) -> _BatchKV:
        """``decode_kernel``: the paged decode kernels may attend (they take the lengths; where they cannot read
        the blocks, SDPA does, over gathered K/V under a mask); ``dense_chunks``: SDPA attends the chunks after
        cached tokens, so they need masks (the prompt kernel is causal by construction)."""
        blocks = formats = entries = mask = lens = None
        if batch.num_decodes:
            assert batch.decode_block_tables is not None and batch.decode_context_lens is not None
            tables, lens = batch.decode_block_tables, batch.decode_context_lens
            blocks, formats = kv.block_map[tables], kv.block_format[tables]
            if decode_kernel:
                entries = kv.decode_index(blocks, formats)
            if entries is None and batch.decode_ragged:
                width = blocks.shape[1] * kv.block_size
                mask = (torch.arange(width, device=lens.device)[None, :] < lens[:, None]).view(-1, 1, 1, width)
        return _BatchKV(kv.locate(batch.slot_mapping), blocks, formats, entries, mask, lens,
                        [None if pc.context_start == 0 else _ChunkContext.of(pc, kv, dense_chunks)
                         for pc in batch.prefills],
                        *rope.tables(batch.positions))


def build_decoder_layer(weights: dict[str, torch.Tensor], i: int, device: torch.device,
                        dtype: torch.dtype) -> DecoderLayer:
    p = f"model.layers.{i}."
    w = lambda name: weights[p + name].to(device=device, dtype=dtype)  # noqa: E731
    b = lambda name: weights[p + name].to(device=device, dtype=dtype) if p + name in weights else None  # noqa: E731
    # fp32 CPU weights go into oneDNN's blocked layout (serve/model/linear.py: DenseLinear.blocked); others stay
    return DecoderLayer(
        input_norm=w("input_layernorm.weight"),
        post_attention_norm=w("post_attention_layernorm.weight"),
        qkv=DenseLinear.fused([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"),
                               w("self_attn.v_proj.weight")],
                              [b("self_attn.q_proj.bias"), b("self_attn.k_proj.bias"),
                               b("self_attn.v_proj.bias")]).blocked(),
        o=DenseLinear(w("self_attn.o_proj.weight")).blocked(),
        gate_up=DenseLinear.fused([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]).blocked(),
        down=DenseLinear(w("mlp.down_proj.weight")).blocked(),
    )


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, max_positions: int, layers: dict[int, DecoderLayer] | None = None) -> None:
        """``layers``: decoder layers already built (a static checkpoint's quantized ones,
        serve/model/quantized_layer.py); every other layer is built from ``weights``."""
        self.config = config
        self.device = device
        self.dtype = dtype
        embed = weights["model.embed_tokens.weight"].to(device=device, dtype=dtype)
        self.norm = weights["model.norm.weight"].to(device=device, dtype=dtype)
        head = embed if config.tie_word_embeddings else weights["lm_head.weight"].to(device=device, dtype=dtype)
        built = layers or {}
        self.layers = [built[i] if i in built else build_decoder_layer(weights, i, device, dtype)
                       for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(config, max_positions, device, dtype)
        self.scale = config.head_dim ** -0.5
        group = config.num_heads // config.num_kv_heads
        # decode attention over the paged blocks (attention_avx2.cpp) where the kernel applies: fp32 on CPU
        self.paged_attention = (kernels.ops() if dtype == torch.float32 and device.type == "cpu"
                                and config.head_dim % 8 == 0 and group <= 16 else None)
        # prompt chunks' causal attention, GQA heads stacked (attention_avx2.cpp): whole prompts over their own K/V,
        # later chunks over the cached context gathered first; same conditions
        self.prompt_attention = self.paged_attention
        # RMSNorm, fused with the residual add before it (norm_avx2.cpp): fp32 on CPU
        self.fused_norm = kernels.ops() if dtype == torch.float32 and device.type == "cpu" else None
        # SwiGLU and RoPE + the KV write, one pass each (elementwise_avx2.cpp, bit-identical to the torch ops)
        self.fused_elementwise = self.fused_norm if config.head_dim % 2 == 0 else None
        # the LM head as the exact int8 blocks a GGUF Q8_0 embedding holds (serve/model/lm_head.py), for decode
        on_cpu_fp32 = dtype == torch.float32 and device.type == "cpu" and kernels.ops() is not None
        self.int8_head = int8_blocks(head) if on_cpu_fp32 else None
        # the fp32 head, like the decoder's projections, in oneDNN's blocked layout on fp32 CPU (one copy: a tied
        # embedding looks its tokens up in it, DenseLinear.weight_rows); the token embedding as an op of its own
        self.head = DenseLinear(head).blocked()
        self.embedding = self.head if config.tie_word_embeddings else DenseLinear(embed)
        # the last layer's attention projection and MLP only for the rows that are sampled (a prompt's last token,
        # each decode row): the others feed nothing after it. Their K/V is still written. Off (None): every row.
        self.trim_last_layer: bool | None = True

    @property
    def non_layer_nbytes(self) -> int:
        tied = self.head is self.embedding
        head_blocks = 0 if self.int8_head is None else sum(t.nbytes for t in self.int8_head)
        return (self.embedding.nbytes + self.norm.nbytes + (0 if tied else self.head.nbytes) + head_blocks
                + self.rope.cos.nbytes * 2)

    def rms_norm(self, h: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of the residual stream ``h``, after ``h += delta`` (in place) when a delta is given."""
        eps = self.config.rms_norm_eps
        if self.fused_norm is not None:
            if delta is None:
                return self.fused_norm.rms_norm(h, weight, eps)
            return self.fused_norm.add_rms_norm_(h, delta.contiguous(), weight, eps)
        if delta is not None:
            h.add_(delta)
        return rms_norm(h, weight, eps)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache, layers: list[DecoderLayer] | None = None,
                head: LinearOp | None = None) -> torch.Tensor:
        """Logits [S, vocab] (fp32) for batch.sample_indices (all tokens if None). ``layers`` / ``head``: run
        these decoder layers and LM head instead of the model's own (a speculative draft: the same weights at a
        lower precision, writing its K/V into the same cache)."""
        layers = self.layers if layers is None else layers
        h = self.embedding.weight_rows(batch.input_ids)
        where = _BatchKV.locate(batch, kv, self.rope, self.paged_attention is not None, self.prompt_attention is None)
        delta = None  # each layer's MLP output, added to h by the next norm
        keep = batch.sample_indices
        trim = bool(self.trim_last_layer) and keep is not None and keep.numel() < h.shape[0]
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            h, delta = self._layer(i, layer, h, delta, batch, kv, where, keep if trim and i == last else None)
        if keep is not None and not trim:
            h = h.index_select(0, keep)
            delta = None if delta is None else delta.index_select(0, keep)
        h = self.rms_norm(h, self.norm, delta)
        return self.logits(h) if head is None else head(h).float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the final hidden states: from the int8 blocks up to ``int8_head_max_rows`` rows
        (serve/model/crossovers.py; same weights, summed in another order), else the fp32 head."""
        if self.int8_head is not None and h.shape[0] <= crossovers.current().int8_head_max_rows:
            return kernels.ops().int8_block_linear(h.contiguous(), *self.int8_head)
        return self.head(h).float()

    def _layer(self, i: int, layer: DecoderLayer, h: torch.Tensor, delta: torch.Tensor | None, batch: ForwardBatch,
               kv: PagedKVCache, where: _BatchKV,
               keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after this layer's attention, and its MLP output (added by the next norm); with
        ``keep``, both only for those rows (every row's K/V is still written)."""
        cfg = self.config
        x = self.rms_norm(h, layer.input_norm, delta)
        qkv = layer.qkv(x)
        T = x.shape[0]
        fused = self.fused_elementwise
        # rotated in place, k/v cached (8-bit tokens' k/v in qkv become what a read returns)
        if fused is not None and qkv.is_contiguous() and kv.rope_write_(
                fused, qkv, where.cos.view(T, -1), where.sin.view(T, -1), cfg.num_heads, cfg.num_kv_heads, i,
                where.new):
            q = qkv[:, : cfg.q_size].view(T, cfg.num_heads, cfg.head_dim)
            k = qkv[:, cfg.q_size: cfg.q_size + cfg.kv_size].view(T, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, cfg.q_size + cfg.kv_size:].view(T, cfg.num_kv_heads, cfg.head_dim)
        else:
            # q and k rotated together (one pass over [T, heads + kv_heads, head_dim]; elementwise, so identical)
            qk = rotate(qkv[:, : cfg.q_size + cfg.kv_size].view(T, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim),
                        where.cos, where.sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads:]
            v = qkv[:, cfg.q_size + cfg.kv_size:].view(T, cfg.num_kv_heads, cfg.head_dim)
            k, v = kv.write(i, where.new, k, v)  # 8-bit KV: k and v as stored (dequantized), for a whole prompt
        attn = self._attention(i, q, k, v, batch, kv, where)
        if keep is not None:
            h, attn = h.index_select(0, keep), attn.index_select(0, keep)
        x = self.rms_norm(h, layer.post_attention_norm, layer.o(attn))
        gu = layer.gate_up(x)
        if fused is not None and gu.is_contiguous():
            return h, layer.down(fused.silu_mul(gu))
        inter = gu.shape[-1] // 2
        return h, layer.down(F.silu(gu[:, :inter]) * gu[:, inter:])

    def _attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                   kv: PagedKVCache, where: _BatchKV) -> torch.Tensor:
        """q ``[T, heads, hd]``; k, v ``[T, kv_heads, hd]``: this forward's tokens, already written to ``kv``."""
        cfg = self.config
        kvh, group, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        out = torch.empty(q.shape[0], cfg.q_size, device=q.device, dtype=q.dtype)
        B = batch.num_decodes
        if B and where.decode_entries is not None:  # straight over the paged blocks, no dense K/V copies
            out[:B] = kv.paged_decode(self.paged_attention, q[:B].reshape(B, cfg.q_size).contiguous(),
                                      where.decode_entries, i, where.decode_lens, self.scale)
        elif B:
            qd = q[:B].view(B, kvh, group, hd)
            kd, vd = kv.read_blocks(i, where.decode_blocks, where.decode_formats)
            kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)  # [B, kvh, L, hd]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=where.decode_mask, scale=self.scale)
            out[:B] = o.reshape(B, cfg.q_size)
        for pc, ctx in zip(batch.prefills, where.prefills):
            n, t0 = pc.num_tokens, pc.token_start
            if self.prompt_attention is not None:  # causal over the chunk's own keys, after the cached ones
                kc, vc = (k[t0: t0 + n], v[t0: t0 + n]) if ctx is None else ctx.read(kv, i)
                self.prompt_attention.prefill_attention_(q[t0: t0 + n], kc, vc, out[t0: t0 + n], self.scale)
                continue
            if ctx is None:  # a whole prompt: its K/V are this forward's, no gather from the cache needed
                o = F.scaled_dot_product_attention(
                    q[t0: t0 + n].transpose(0, 1).unsqueeze(0), k[t0: t0 + n].transpose(0, 1).unsqueeze(0),
                    v[t0: t0 + n].transpose(0, 1).unsqueeze(0), is_causal=True, scale=self.scale, enable_gqa=True)
                out[t0: t0 + n] = o[0].transpose(0, 1).reshape(n, cfg.q_size)
                continue
            # a chunk after cached tokens: gather the context, each query head group's rows under one mask
            qp = q[t0: t0 + n].view(n, kvh, group, hd).permute(1, 2, 0, 3).reshape(1, kvh, group * n, hd)
            kp, vp = ctx.read(kv, i)
            kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)  # [1, kvh, ctx, hd]
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=ctx.mask.repeat(group, 1), scale=self.scale)
            out[t0: t0 + n] = o.view(kvh, group, n, hd).permute(2, 0, 1, 3).reshape(n, cfg.q_size)
        return out
