"""Command line: generate one completion with the engine (no server).

  .venv/bin/python -m serve.generate --prompt "What is the capital of France?" --chat --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from serve.config import EMBEDDED_MODEL, EngineConfig
from serve.config_flags import add_engine_flags, engine_kwargs
from serve.engine.sampling_params import SamplingParams

ENGINE_FIELDS = ("model", "level", "device", "dtype", "num_threads", "kv_cache_dtype", "speculation",
                 "quality_meter")
"""The EngineConfig fields this command's line sets (serve/config_flags.py)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serve.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", required=True, help="prompt text (with --chat: the user message)")
    p.add_argument("--max-tokens", type=int, default=64, help="maximum new tokens (default: %(default)s)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    add_engine_flags(p, ENGINE_FIELDS, defaults={"model": EMBEDDED_MODEL, "device": "cpu"},
                     aliases={"num_threads": ["--threads"]})
    p.add_argument("--json", action="store_true", help='print {"text", "token_ids", timings} as JSON')
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from serve.engine.engine import LLMEngine  # after argparse so --help is instant

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(**engine_kwargs(args, ENGINE_FIELDS)))
        load_s = time.perf_counter() - t0
        prompt = engine.tokenizer.apply_chat_template([{"role": "user",
                                                        "content": args.prompt}]) if args.chat else args.prompt
        t1 = time.perf_counter()
        result = engine.generate([prompt], params)[0]
        total_s = time.perf_counter() - t1
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        n = len(result["token_ids"])
        ttft = result["ttft_s"]
        print(json.dumps({
            "text": result["text"], "token_ids": result["token_ids"], "finish_reason": result["finish_reason"],
            "num_prompt_tokens": result["num_prompt_tokens"],
            "timings": {"load_s": round(load_s, 3), "ttft_s": round(ttft, 4) if ttft else None,
                        "total_s": round(total_s, 4),
                        "decode_tok_s": round((n - 1) / (total_s - ttft), 2) if n > 1 and ttft else None},
        }))
    else:
        print(result["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
