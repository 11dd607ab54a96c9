"""Layer importance and the swap order, as in MorphServe (arXiv 2506.02006, Sec. 3.1 / Algorithm 1).

For decoder layer p on calibration tokens x (every cosine is per token, averaged over all tokens):

- LTS_p = cos(input of layer p, output of layer p) in the full-precision model;
- LRS_p = cos(full-precision output of layer p, quantized output of layer p), same input;
- MDS_p^(Q) = cos(f^(Q)(x), f^(Q u {p})(x)), f = the model's logits, Q = layers already quantized;
- LIS_p = 0.25 LTS_p + 0.25 LRS_p + 0.5 MDS_p^(Q).

Greedy: each round computes MDS for every layer not in Q, quantizes the one with the highest LIS (ties:
lowest index) and repeats until every layer is ranked. The order is the runtime swap order.

Two exact shortcuts keep MDS cheap on a CPU:

- Suffix reuse: one pass in the Q-state records the hidden state entering every layer; candidate p
  starts from the cached input of layer p and reruns only layers p..L-1. All candidates' suffixes run
  as one batch (a candidate joins the batch at its own, quantized, layer), so the GEMMs are large.
- Logit cosine through the Gram matrix: logits = W h (no lm_head bias in Llama), so
  <W a, W b> = a^T (W^T W) b. With G = W^T W computed once ([hidden, hidden], fp64), each token's
  logit cosine costs O(hidden^2) instead of O(vocab * hidden), with no approximation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from builder.forward import DenseLayer, DenseLlama
from serve.model.quantized_linear import QuantizedLinear

LIS_WEIGHTS: tuple[float, float, float] = (0.25, 0.25, 0.5)
"""(a1 for LTS, a2 for LRS, b for MDS), the paper's values."""

MdsFn = Callable[[frozenset[int], list[int]], dict[int, float]]


def token_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity over the last dim, averaged over every other position (tokens)."""
    a64, b64 = a.double().reshape(-1, a.shape[-1]), b.double().reshape(-1, b.shape[-1])
    return torch.nn.functional.cosine_similarity(a64, b64, dim=-1, eps=1e-12).mean().item()


def gram_token_cosine(a: torch.Tensor, b: torch.Tensor, gram: torch.Tensor) -> float:
    """:func:`token_cosine` of ``a @ W.T`` and ``b @ W.T`` given ``gram = W.T @ W`` (fp64)."""
    a64, b64 = a.double().reshape(-1, a.shape[-1]), b.double().reshape(-1, b.shape[-1])
    ga, gb = a64 @ gram, b64 @ gram
    dot = (ga * b64).sum(-1)
    norms = ((ga * a64).sum(-1).clamp_min(0) * (gb * b64).sum(-1).clamp_min(0)).sqrt()
    return (dot / norms.clamp_min(1e-24)).mean().item()


def lis_score(lts: float, lrs: float, mds: float, weights: tuple[float, float, float] = LIS_WEIGHTS) -> float:
    return weights[0] * lts + weights[1] * lrs + weights[2] * mds


@dataclass
class GreedyRound:
    round: int
    quantized_before: list[int]
    mds: dict[int, float]
    lis: dict[int, float]
    picked: int


@dataclass
class GreedyResult:
    order: list[int]
    rounds: list[GreedyRound] = field(default_factory=list)


def greedy_lis_order(
    lts: Sequence[float],
    lrs: Sequence[float],
    mds_fn: MdsFn,
    weights: tuple[float, float, float] = LIS_WEIGHTS,
    progress: Callable[[int], None] | None = None,
) -> GreedyResult:
    """Algorithm 1: ``mds_fn(Q, candidates) -> {p: MDS_p^(Q)}``; pick the highest LIS each round."""
    num_layers = len(lts)
    if len(lrs) != num_layers:
        raise ValueError(f"LTS has {num_layers} layers but LRS has {len(lrs)}")
    quantized: list[int] = []
    result = GreedyResult(order=quantized)
    while len(quantized) < num_layers:
        candidates = [p for p in range(num_layers) if p not in quantized]
        mds = mds_fn(frozenset(quantized), candidates)
        lis = {p: lis_score(lts[p], lrs[p], mds[p], weights) for p in candidates}
        picked = max(candidates, key=lambda p: (lis[p], -p))
        result.rounds.append(GreedyRound(len(result.rounds), sorted(quantized), mds, lis, picked))
        quantized.append(picked)
        if progress is not None:
            progress(len(candidates))
    return result


class SuffixMds:
    """Exact MDS for all candidates of a round with cached prefixes and one batched suffix pass."""

    def __init__(self, model: DenseLlama, quant_layers: Sequence[DenseLayer], input_ids: torch.Tensor) -> None:
        self.model = model
        self.quant_layers = list(quant_layers)
        self.h0 = model.embed(input_ids)
        w = model.lm_head_weight.double()
        self.gram = w.t() @ w

    def _layer(self, j: int, quantized: frozenset[int]) -> DenseLayer:
        return self.quant_layers[j] if j in quantized else self.model.full_layers[j]

    @torch.no_grad()
    def __call__(self, quantized: frozenset[int], candidates: list[int]) -> dict[int, float]:
        model = self.model
        num_layers = len(self.quant_layers)
        inputs: list[torch.Tensor] = []
        h = self.h0
        for j in range(num_layers):
            inputs.append(h)
            h = model.layer_forward(self._layer(j, quantized), h)
        reference = model.final_hidden(h)
        rows = self.h0.shape[0]
        members: list[int] = []
        batch: torch.Tensor | None = None
        for j in range(min(candidates), num_layers):
            if batch is not None:
                batch = model.layer_forward(self._layer(j, quantized), batch)
            if j in candidates:
                own = model.layer_forward(self.quant_layers[j], inputs[j])
                batch = own if batch is None else torch.cat([batch, own], dim=0)
                members.append(j)
        assert batch is not None
        finals = model.final_hidden(batch)
        return {
            p: gram_token_cosine(reference, finals[i * rows : (i + 1) * rows], self.gram)
            for i, p in enumerate(members)
        }


@dataclass
class LayerProfile:
    lts: list[float]
    lrs: list[float]
    greedy: GreedyResult
    seconds: float

    def to_json(self) -> dict:
        num_layers = len(self.lts)
        return {
            "layers": [{"layer": p, "lts": self.lts[p], "lrs": self.lrs[p]} for p in range(num_layers)],
            "rounds": [
                {
                    "round": r.round,
                    "quantized_before": r.quantized_before,
                    "candidates": [
                        {"layer": p, "lts": self.lts[p], "lrs": self.lrs[p], "mds": r.mds[p], "lis": r.lis[p]}
                        for p in sorted(r.mds)
                    ],
                    "picked": r.picked,
                    "picked_lis": r.lis[r.picked],
                }
                for r in self.greedy.rounds
            ],
            "order": list(self.greedy.order),
            "front_to_back": list(range(num_layers)),
            "back_to_front": list(range(num_layers - 1, -1, -1)),
            "profile_seconds": round(self.seconds, 3),
        }


@torch.no_grad()
def profile_layers(
    model: DenseLlama,
    variants: Mapping[int, Mapping[str, QuantizedLinear]],
    input_ids: torch.Tensor,
    show_progress: bool = True,
) -> LayerProfile:
    """LTS, LRS once, then the greedy MDS/LIS order; ``variants[i]`` is layer i's quantized linears."""
    start = time.perf_counter()
    num_layers = model.config.num_layers
    quant_layers = [model.quantized_layer(i, variants[i]) for i in range(num_layers)]
    lts: list[float] = []
    lrs: list[float] = []
    h = model.embed(input_ids)
    for i in range(num_layers):
        out = model.layer_forward(model.full_layers[i], h)
        lts.append(token_cosine(h, out))
        lrs.append(token_cosine(out, model.layer_forward(quant_layers[i], h)))
        h = out
    mds = SuffixMds(model, quant_layers, input_ids)
    total = num_layers * (num_layers + 1) // 2
    with tqdm(total=total, desc="layer importance (MDS)", unit="cand", disable=not show_progress) as bar:
        greedy = greedy_lis_order(lts, lrs, mds, progress=bar.update)
    return LayerProfile(lts, lrs, greedy, time.perf_counter() - start)
