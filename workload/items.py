"""Workloads for trace replay and benchmarks: trace options, arrivals, and real prompts of exact lengths.

Prompts are windows of real text tokenized by the model's tokenizer, so every request carries natural
text of exactly the requested number of tokens. Output lengths are forced (ignore_eos) so that runs in
different modes do the same work.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

from serve.model.tokenizer import Tokenizer
from workload.traces import TraceRequest, find_burst_window, load_trace, synthetic_gamma, transform

DEFAULT_TEXT = Path(__file__).with_name("data") / "botchan_excerpt.txt"


def default_text_path() -> Path:
    """The committed Botchan excerpt (workload/data/README.md): the same prompt text on every machine, whatever lies
    beside the clone (a default that switched to ../shared's whole book when present made two checkouts replay
    different prompts). ``--text`` picks another, e.g. ../shared/data/text/botchan.txt, the whole book."""
    return DEFAULT_TEXT


@dataclass(frozen=True)
class WorkItem:
    arrival_s: float
    prompt_ids: list[int]
    output_tokens: int
    tbt_slo_s: float | None = None   # None: the engine's default (EngineConfig.slo_tbt_s)
    priority: int | None = None      # tier; None: the engine's default (EngineConfig.default_priority)


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, text: str) -> None:
        self.ids = tokenizer.encode(text)
        if len(self.ids) < 16:
            raise ValueError("prompt text is too short (need at least 16 tokens)")

    def shared_blocks_prompt(self, block_ids: tuple[int, ...], block_tokens: int, max_tokens: int | None) -> list[int]:
        """A prompt of one ``block_tokens``-token window of text per trace block id: requests that share a block
        id share those tokens (each id picks its own window, the same in every request and run), so the
        trace's prefix sharing becomes real shared prefixes. Cut to ``max_tokens``."""
        out: list[int] = []
        for h in block_ids:
            out += self.prompt(block_tokens, random.Random(f"block-{h}"))
            if max_tokens is not None and len(out) >= max_tokens:
                return out[:max_tokens]
        return out

    def prompt(self, n: int, rng: random.Random) -> list[int]:
        """n tokens of contiguous text (wrapping around the corpus when n exceeds it)."""
        start = rng.randrange(len(self.ids))
        reps = (start + n) // len(self.ids) + 1
        return (self.ids * reps)[start:start + n]


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", type=Path, default=None,
                   help="Azure LLM inference CSV, Mooncake JSONL or BurstGPT CSV; omit for synthetic gamma arrivals")
    g.add_argument("--trace-format", default="auto", choices=["auto", "azure", "mooncake", "burstgpt"])
    g.add_argument("--window", default=None, metavar="START:END",
                   help="seconds of the trace to replay, e.g. 600:672; 'burst:72' picks the busiest 72 s")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply inter-arrival times (2 = half the request rate)")
    g.add_argument("--length-scale", type=float, default=1.0, help="multiply input and output lengths")
    g.add_argument("--max-input-tokens", type=int, default=None, help="cap on prompt tokens after scaling")
    g.add_argument("--max-output-tokens", type=int, default=None, help="cap on output tokens after scaling")
    g.add_argument("--prefix-block-tokens", type=int, default=None, metavar="N",
                   help="with a Mooncake trace: build each prompt from its hash_ids, N tokens of text per id, so "
                        "requests sharing ids share prefixes (the trace's blocks are 512 tokens; N scales them to "
                        "this machine). Prompt length = N x ids, capped by --max-input-tokens")
    g.add_argument("--max-requests", type=int, default=None, help="replay at most this many requests")
    g.add_argument("--fixed-lengths", action="store_true",
                   help="with --trace: arrivals from the trace, every request --input-len prompt and --output-len "
                        "output tokens (the MorphServe paper's setup: 512/256 for MHA models)")
    g.add_argument("--text", type=Path, default=None, help=f"prompt text (default: workload/data/{DEFAULT_TEXT.name}, "
                   "the first two chapters of Botchan, public domain; the whole book is "
                   "../shared/data/text/botchan.txt)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-requests", type=int, default=64, help="synthetic workload: number of requests")
    g.add_argument("--request-rate", type=float, default=2.0, help="synthetic workload: mean requests/s")
    g.add_argument("--burstiness", type=float, default=0.5, help="synthetic workload: gamma shape (<1 burstier)")
    g.add_argument("--input-len", type=int, default=256, help="synthetic workload: prompt tokens")
    g.add_argument("--output-len", type=int, default=32, help="synthetic workload: output tokens")


def add_slo_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("per-request service targets (README: SLO-aware scheduling)")
    g.add_argument("--tbt-slo", type=float, default=None, metavar="S",
                   help="every request's time-between-tokens target in seconds (default: the engine's slo_tbt_s)")
    g.add_argument("--tight-share", type=float, default=0.0, metavar="F",
                   help="share of the requests (chosen by --seed) that become tier 0 with --tight-tbt-slo")
    g.add_argument("--tight-tbt-slo", type=float, default=None, metavar="S",
                   help="TBT target of the tight share, in seconds (required when --tight-share > 0)")


def assign_targets(items: list[WorkItem], tbt_slo_s: float | None, tight_share: float,
                   tight_tbt_slo_s: float | None, seed: int) -> list[WorkItem]:
    """Every item gets ``tbt_slo_s``; round(share * n) of them, chosen by seed, become tier 0 with the tight
    target. Raises ValueError for targets <= 0, a share outside [0, 1], or a share without its target."""
    for name, v in (("--tbt-slo", tbt_slo_s), ("--tight-tbt-slo", tight_tbt_slo_s)):
        if v is not None and not 0 < v < float("inf"):
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {v}")
    if not 0.0 <= tight_share <= 1.0:
        raise ValueError(f"--tight-share must be in [0, 1], got {tight_share}")
    if tight_share > 0 and tight_tbt_slo_s is None:
        raise ValueError("--tight-share needs --tight-tbt-slo (the tight requests' TBT target)")
    tight = set(random.Random(f"tiers-{seed}").sample(range(len(items)), round(tight_share * len(items))))
    return [dataclasses.replace(w, tbt_slo_s=tight_tbt_slo_s, priority=0) if i in tight
            else dataclasses.replace(w, tbt_slo_s=tbt_slo_s) for i, w in enumerate(items)]


def trace_requests(args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    """The (transformed) arrivals and a description of how they were made."""
    if args.trace is None:
        reqs = synthetic_gamma(args.num_requests, args.request_rate, args.burstiness, args.input_len, args.output_len,
                               args.seed)
        desc = f"synthetic gamma: {args.num_requests} requests, {args.request_rate} req/s, burstiness {args.burstiness}"
    else:
        reqs = load_trace(args.trace, args.trace_format)
        desc = f"{args.trace.name}"
    window = None
    if args.window:
        if args.window.startswith("burst:"):
            window = find_burst_window(reqs, float(args.window.split(":", 1)[1]))
        else:
            try:
                a, b = (float(x) for x in args.window.split(":"))
            except ValueError:
                raise ValueError(f"--window must be START:END or burst:SECONDS, got {args.window!r}") from None
            window = (a, b)
        desc += f", window {window[0]:.1f}-{window[1]:.1f} s"
    reqs = transform(reqs, window=window, time_scale=args.time_scale, length_scale=args.length_scale,
                     max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens)
    if args.max_requests is not None:
        reqs = reqs[: args.max_requests]
    if getattr(args, "fixed_lengths", False) and args.trace is not None:
        reqs = [dataclasses.replace(r, input_tokens=args.input_len, output_tokens=args.output_len) for r in reqs]
        desc += f", fixed lengths {args.input_len}/{args.output_len}"
    desc += (f", time x{args.time_scale}, lengths x{args.length_scale}, caps in/out "
             f"{args.max_input_tokens}/{args.max_output_tokens}, {len(reqs)} requests")
    if not reqs:
        raise ValueError("the workload is empty (check --window and the trace)")
    return reqs, desc


def build_workload(args: argparse.Namespace, tokenizer: Tokenizer) -> tuple[list[WorkItem], str]:
    reqs, desc = trace_requests(args)
    text_path = args.text or default_text_path()
    builder = PromptBuilder(tokenizer, Path(text_path).read_text(encoding="utf-8"))
    rng = random.Random(args.seed)
    block_tokens = getattr(args, "prefix_block_tokens", None)
    if block_tokens is not None:
        if block_tokens <= 0:
            raise ValueError(f"--prefix-block-tokens must be positive, got {block_tokens}")
        if not any(r.block_ids for r in reqs):
            raise ValueError("--prefix-block-tokens needs a trace with hash_ids (Mooncake)")
        items = [WorkItem(r.arrival_s, builder.shared_blocks_prompt(r.block_ids, block_tokens, args.max_input_tokens),
                          r.output_tokens) for r in reqs]
        desc += f", prompts from hash_ids x {block_tokens} tokens"
    else:
        items = [WorkItem(r.arrival_s, builder.prompt(r.input_tokens, rng), r.output_tokens) for r in reqs]
    if hasattr(args, "tight_share"):  # tools that took add_slo_arguments
        items = assign_targets(items, args.tbt_slo, args.tight_share, args.tight_tbt_slo, args.seed)
        n_tight = sum(1 for w in items if w.priority == 0)
        if n_tight:
            desc += f", {n_tight} tier-0 requests (TBT {args.tight_tbt_slo} s)"
    return items, f"{desc}, prompts from {Path(text_path).name}"
