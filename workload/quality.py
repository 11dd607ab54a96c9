"""Quality of the configurations a server ran: perplexity per layer-precision signature, and probe agreement.

(a) Perplexity. One engine (the same model or engine directory the server loads, morph_mode "default" so
its layer bank holds the int8 and int4 variants of every layer) evaluates held-out text through
``engine.model.forward`` for any configuration signature (one character per decoder layer, as
``MorphRuntime.config_signature()`` writes it: f = full, 8 = int8, 4 = int4, e = fp8). The requested
variant of each layer is installed for the evaluation (``bank.detached(i, p)`` +
``bank.install``) and full precision is put back afterwards; the KV pool is not touched. Text: the
first ``num_tokens`` tokens (default 2048) of workload/data/botchan_excerpt.txt (the first chapters of
../shared/data/text/botchan.txt, so the same tokens) or the text given, cut into non-overlapping ``window``-token
windows (default 512); neither is used for calibration (builder/calibration_corpus.py). Results are memoized per
signature.

Perplexity = exp(mean negative log-likelihood over every predicted token of every window). A mode's
perplexity weights each configuration's mean NLL by the tokens the server generated in it, then
exponentiates (the token-weighted geometric mean of the configurations' perplexities).

(b) Probe agreement. Greedy outputs for a fixed set of probe prompts, computed offline by an engine with
morph_mode off, are the reference for the same prompts sent to the server during a run.
``match_rates`` compares the two texts after re-tokenizing both with the model's tokenizer (the server
streams text, not token ids; re-tokenizing both sides makes equal texts give equal tokens), and reports
(1) the prefix match: tokens equal up to the first mismatch, over the reference length, and (2) the
position-wise match: positions with equal tokens, over the reference length.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from policy import FULL
from policy.precisions import CODE_PRECISION, PRECISION_CODE
from serve.morph.runtime import MorphRuntime
from workload.items import default_text_path

# A fixed probe set: short, varied prompts whose greedy continuations are sensitive to weight changes.
PROBE_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at 100 degrees Celsius because",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "In 1492, Christopher Columbus",
)


def weighted_perplexity(tokens_by_config: Mapping[str, int], nll_by_config: Mapping[str, float]) -> float | None:
    """exp(sum_c w_c * nll_c / sum_c w_c) with w_c the tokens served in configuration c (None if no tokens)."""
    total = sum(n for n in tokens_by_config.values() if n > 0)
    if total <= 0:
        return None
    mean_nll = sum(n * nll_by_config[c] for c, n in tokens_by_config.items() if n > 0) / total
    return math.exp(mean_nll)


def quality_loss_pct(ppl: float | None, ppl_full: float | None) -> float | None:
    """Relative perplexity increase over full precision, in percent (None when either is unknown)."""
    if ppl is None or ppl_full is None or ppl_full <= 0:
        return None
    return (ppl / ppl_full - 1.0) * 100.0


def match_rates(reference: Sequence[int], served: Sequence[int]) -> dict[str, int | float | None]:
    """Token agreement of ``served`` with ``reference`` (both token-id lists).

    prefix_match: equal tokens before the first mismatch; positional_match: equal tokens at the same
    position (over the reference's positions; missing served tokens count as mismatches). Rates are over
    the reference length (None when it is empty).
    """
    n = len(reference)
    prefix = 0
    for a, b in zip(reference, served):
        if a != b:
            break
        prefix += 1
    positional = sum(1 for a, b in zip(reference, served) if a == b)
    return {"reference_tokens": n, "served_tokens": len(served), "prefix_match": prefix,
            "positional_match": positional, "prefix_match_rate": prefix / n if n else None,
            "positional_match_rate": positional / n if n else None}


def aggregate_match(rows: Iterable[Mapping]) -> dict[str, float | int | None]:
    """Pool per-probe match counts (rows of match_rates plus "ok") into rates over all reference tokens.

    A probe the server failed counts as zero matching tokens over its reference length.
    """
    ref = prefix = pos = n = failed = 0
    for r in rows:
        n += 1
        ref += int(r.get("reference_tokens") or 0)
        if not r.get("ok", True):
            failed += 1
            continue
        prefix += int(r.get("prefix_match") or 0)
        pos += int(r.get("positional_match") or 0)
    return {"probes": n, "failed": failed, "reference_tokens": ref,
            "prefix_match_rate": prefix / ref if ref else None,
            "positional_match_rate": pos / ref if ref else None}


class QualityEvaluator:
    """Perplexity of configuration signatures with one engine (see the module docstring)."""

    def __init__(self, model: str, text_path: str | Path | None = None, num_tokens: int = 2048, window: int = 512,
                 num_threads: int | None = None, kv_cache_dtype: str = "auto") -> None:
        """``kv_cache_dtype``: the windows' K/V are stored (and read back) in this format (int8: the engine's 8-bit
        KV blocks, decode kernel aside)."""
        from serve.config import EngineConfig  # noqa: PLC0415 - heavy imports only when evaluating
        from serve.engine.engine import LLMEngine  # noqa: PLC0415

        if window < 2:
            raise ValueError(f"window must be >= 2 tokens, got {window}")
        self.model_name = model
        self.window = window
        blocks = math.ceil(window / 16) + 1
        self.engine = LLMEngine(EngineConfig(model=model, morph_mode="default", morph_precisions="int8,int4",
                                             num_kv_blocks=blocks,
                                             num_threads=num_threads))
        runtime = self.engine.resource_manager(MorphRuntime)
        if runtime is None:  # pragma: no cover - default mode always has a bank
            raise RuntimeError("the quality engine has no layer bank")
        self.bank = runtime.bank
        self.num_layers = len(self.bank.model.layers)
        self.text_path = Path(text_path) if text_path else default_text_path()
        ids = self.engine.tokenizer.encode(self.text_path.read_text(encoding="utf-8"))[:num_tokens]
        self.windows = [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) >= 2]
        if not self.windows:
            raise ValueError(f"{self.text_path} has fewer than 2 tokens")
        self.num_eval_tokens = sum(len(w) - 1 for w in self.windows)
        self._nll: dict[str, float] = {}
        from serve.model.kv_cache import PagedKVCache  # noqa: PLC0415

        m = self.engine.model
        self._kv = PagedKVCache.standalone(m.config, math.ceil(window / 16), 16, m.device, m.dtype, kv_cache_dtype)

    @property
    def precisions(self) -> set[str]:
        return self.bank.precisions

    def check_signature(self, signature: str) -> None:
        if len(signature) != self.num_layers:
            raise ValueError(f"signature {signature!r} has {len(signature)} layers, the model has {self.num_layers}")
        bad = sorted({c for c in signature if c != PRECISION_CODE[FULL]
                      and CODE_PRECISION.get(c) not in self.precisions})
        if bad:
            raise ValueError(f"signature {signature!r} uses precision codes {bad} that the layer bank lacks "
                             f"(has {sorted(self.precisions)})")

    def nll(self, signature: str) -> float:
        """Mean negative log-likelihood (nats/token) of the held-out text in configuration ``signature``."""
        if signature in self._nll:
            return self._nll[signature]
        self.check_signature(signature)
        with self.configuration(signature):
            total, count = 0.0, 0
            for w in self.windows:
                s, c = self._window_nll(w)
                total, count = total + s, count + c
        self._nll[signature] = total / count
        return self._nll[signature]

    @contextlib.contextmanager
    def configuration(self, signature: str) -> Iterator[None]:
        """Install the variants ``signature`` names (f = full stays) for the block; full precision after."""
        changed = []
        try:
            for i, code in enumerate(signature):
                if code != PRECISION_CODE[FULL]:
                    self.bank.install(i, self.bank.detached(i, CODE_PRECISION[code]))
                    changed.append(i)
            yield
        finally:
            for i in changed:
                self.bank.install(i, self.bank.full_views[i])

    def perplexity(self, signature: str) -> float:
        return math.exp(self.nll(signature))

    def forget(self) -> None:
        """Drop the memoized results: for a setting the signature does not name (e.g. MORPHSERVE_QACTIVATIONS)."""
        self._nll.clear()

    def _window_nll(self, ids: list[int]) -> tuple[float, int]:
        logits = self.forward(ids, 0)
        nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:], device=logits.device),
                                                reduction="sum")
        return float(nll), len(ids) - 1

    def forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Logits predicting ``ids[1:]`` for ``ids`` at positions ``start``.. (KV slot = position, so logical block
        b is block b), attending to the KV already written at slots below ``start`` (a cached prefix) and causally
        among themselves."""
        from serve.model.llama import ForwardBatch, PrefillChunk  # noqa: PLC0415

        m = self.engine.model
        dev = m.device
        n = len(ids)
        pos = torch.arange(start, start + n, device=dev)
        # None at start 0: a whole prompt, plain causal over its own K/V
        table = None if start == 0 else torch.arange(-(-(start + n) // self._kv.block_size), device=dev)
        batch = ForwardBatch(input_ids=torch.tensor(ids, device=dev), positions=pos, slot_mapping=pos, num_decodes=0,
                             prefills=[PrefillChunk(0, n, start, table)],
                             sample_indices=torch.arange(n - 1, device=dev))
        return m.forward(batch, self._kv)

    def shutdown(self) -> None:
        self.engine.shutdown()


def reference_outputs(model: str, prompts: Sequence[str], max_tokens: int,
                      num_threads: int | None = None) -> list[list[int]]:
    """Greedy token ids of each prompt from an engine with morph_mode off (the full-precision reference)."""
    from serve.config import EngineConfig  # noqa: PLC0415
    from serve.engine.engine import LLMEngine  # noqa: PLC0415
    from serve.engine.sampling_params import SamplingParams  # noqa: PLC0415

    engine = LLMEngine(EngineConfig(model=model, morph_mode="off", num_kv_blocks=max(64, 8 * len(prompts)),
                                    num_threads=num_threads))
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        # One prompt at a time: the reference does not depend on batch composition.
        return [engine.generate([p], params)[0]["token_ids"] for p in prompts]
    finally:
        engine.shutdown()
