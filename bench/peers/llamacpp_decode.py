"""Batch-1 greedy decode with llama-cpp-python on a GGUF file; run with its own venv.

  <llamacpp-venv>/bin/python bench/peers/llamacpp_decode.py --gguf FILE --prompt-ids 1,2,3 --new 128 --runs 3 --out
  R.json

Decode tok/s = (new - 1) / (time of the tokens after the first), the first token's time (prefill) excluded;
``Llama.generate`` does not stop on EOS by itself, so every run decodes exactly ``--new`` tokens (greedy).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gguf", required=True)
    p.add_argument("--prompt-ids", required=True)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from llama_cpp import Llama

    llm = Llama(model_path=args.gguf, n_threads=args.threads, n_ctx=2048, verbose=False, seed=0)
    prompt = [int(x) for x in args.prompt_ids.split(",")]
    runs = []
    for _ in range(args.runs + 1):  # the first run warms up
        llm.reset()
        n, t_first = 0, 0.0
        for _tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
            n += 1
            if n == 1:
                t_first = time.perf_counter()
            if n >= args.new:
                break
        runs.append((n - 1) / (time.perf_counter() - t_first))
    json.dump({"decode_tok_s": runs[1:]}, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
