"""Offline vLLM (CPU build) on the workloads bench.peer hands over; run with vLLM's own venv.

  <vllm-venv>/bin/python bench/peers/vllm_offline.py --model HF_DIR --workloads W.json --out R.json --runs 3

W.json: {"name": {"prompts": [[token ids]...], "max_tokens": [n...]}}. Prints nothing the caller parses;
writes {"startup_s": ..., "name": {"cold": [output tok/s per run], "warm": [...]}}. fp32, greedy, ignore_eos,
every output length forced (min_tokens = max_tokens), prompts as token ids, so both engines do exactly the
same work. vLLM's prefix caching stays on (its default); a cold run calls ``reset_prefix_cache()`` first,
the --warm-runs after them do not (the prompts were seen in the run before).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--workloads", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warm-runs", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM, SamplingParams, TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_model_len=args.max_model_len, seed=0)
    result: dict = {"startup_s": time.perf_counter() - t0}
    workloads = json.load(open(args.workloads))
    for name, w in workloads.items():
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in w["prompts"]]
        params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0) for n in w["max_tokens"]]
        llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
        runs: dict[str, list[float]] = {"cold": [], "warm": []}
        for i in range(args.runs + args.warm_runs):
            kind = "cold" if i < args.runs else "warm"
            if kind == "cold" and not llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache")
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
            runs[kind].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
        result[name] = runs
        print(name, {k: [round(r, 1) for r in v] for k, v in runs.items()}, flush=True)
    json.dump(result, open(args.out, "w"), indent=2)


if __name__ == "__main__":  # vLLM's CPU workers re-import the main module
    main()
