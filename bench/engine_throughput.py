"""Engine throughput vs Hugging Face transformers `generate`, measured in one run on this machine.

  .venv/bin/python -m bench.engine_throughput [--threads 2] [--json results/bench_engine.json]

Rows: decode tok/s at batch 1/8/32 (time(N new tokens) - time(1 new token), so prefill is excluded on
both sides), prefill tok/s (one 512-token prompt), total throughput on 64 mixed-length requests
(continuous batching vs static batches of 16, counting only each request's own tokens), and batch-1 decode
against the memory-bandwidth bound (weight bytes read per token / the read rate of a GEMV, gemv_read_gbs).
Ratios are what to trust: this machine is noisy, so both sides run interleaved in the same process.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from serve.config import EMBEDDED_MODEL, EngineConfig
from serve.config_flags import add_engine_flags
from serve.engine.engine import LLMEngine
from serve.engine.sampling_params import SamplingParams
from serve.model.linear import linear


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gemv_read_gbs(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Read rate of a matrix-vector product (one token's row against an fp32 [N, 2048] matrix of nbytes):
    the access pattern of a batch-1 decode step; the fastest of torch's ``F.linear`` and the engine's own
    fp32 linear (``serve.model.linear.linear``), since a bound some GEMV beats is no bound (on the Zen 4 VM
    MKL's GEMV reads 18.6 GB/s and ours 24). A ``sum()`` probe streams much faster than any GEMV does on
    these VMs and so overstated the reachable bound."""
    k = 2048
    w = torch.randn(nbytes // 4 // k, k)
    x = torch.randn(1, k)
    rates = []
    for gemv in (torch.nn.functional.linear, linear):
        gemv(x, w)
        rates.append(nbytes / min(_timed(lambda gemv=gemv: gemv(x, w)) for _ in range(repeats)) / 1e9)
    return max(rates)


def emit(result: dict, markdown: str, json_path: Path | None) -> int:
    """Print the table; also write the results as JSON when asked."""
    print(markdown)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
    return 0


def decode_weight_bytes(engine: LLMEngine) -> int:
    """Bytes a decode step must read: every layer's weights plus the final norm and the LM head."""
    m = engine.model
    return sum(layer.nbytes for layer in m.layers) + m.norm.nbytes + m.head.nbytes


class HFRunner:
    def __init__(self, loaded) -> None:
        from serve.model.hf_reference import hf_llama

        self.model = hf_llama(loaded, for_generation=True)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])          # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens)


def ours_generate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int | list[int]) -> None:
    counts = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in counts])


def make_prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run(threads: int, quick: bool, model: str = EMBEDDED_MODEL, prefill_tokens: int = 512) -> dict:
    torch.set_num_threads(threads)
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=64, max_num_batched_tokens=512, num_threads=threads))
    from serve.model.loader import load_model
    hf = HFRunner(load_model(engine.config.model))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    new = 32 if quick else 64
    rows: list[dict] = []

    for batch in (1, 8, 32):
        prompts = make_prompts(rng, batch, 32, vocab)
        ours_generate(engine, prompts[:1], 2)  # warm-up
        res = {}
        for name, gen in (("ours", lambda p, n: ours_generate(engine, p, n)), ("transformers", hf.generate)):
            t_full = _timed(lambda: gen(prompts, new))
            t_one = _timed(lambda: gen(prompts, 1))
            res[name] = batch * (new - 1) / max(t_full - t_one, 1e-9)
        rows.append({"metric": f"decode tok/s, batch {batch}", "ours": res["ours"],
                     "transformers": res["transformers"]})

    prompt = make_prompts(rng, 1, prefill_tokens, vocab)
    res = {"ours": prefill_tokens / min(_timed(lambda: ours_generate(engine, prompt, 1)) for _ in range(2)),
           "transformers": prefill_tokens / min(_timed(lambda: hf.generate(prompt, 1)) for _ in range(2))}
    rows.append({"metric": f"prefill tok/s, {prefill_tokens}-token prompt", **res})

    n_req = 32 if quick else 64
    lens_in = [rng.randint(16, 256) for _ in range(n_req)]
    lens_out = [rng.randint(16, 128 if not quick else 48) for _ in range(n_req)]
    prompts = [make_prompts(rng, 1, n, vocab)[0] for n in lens_in]
    useful = sum(lens_out)
    t_ours = _timed(lambda: ours_generate(engine, prompts, lens_out))
    static = 16

    def hf_static() -> None:
        for i in range(0, n_req, static):
            hf.generate(prompts[i:i + static], max(lens_out[i:i + static]))
    t_hf = _timed(hf_static)
    rows.append({"metric": f"{n_req} mixed requests, output tok/s", "ours": useful / t_ours, "transformers": useful
                 / t_hf})

    bw = gemv_read_gbs()
    wbytes = decode_weight_bytes(engine)
    engine.shutdown()
    bound = bw * 1e9 / wbytes
    for r in rows:
        r["ratio"] = r["ours"] / r["transformers"]
    return {"threads": threads, "model": engine.model_config.name, "rows": rows,
            "bandwidth": {"read_gbs": bw, "weight_bytes_per_token": wbytes, "bound_tok_s": bound,
                          "batch1_decode_tok_s": rows[0]["ours"], "fraction_of_bound": rows[0]["ours"] / bound}}


def to_markdown(result: dict) -> str:
    lines = ["| metric | ours | transformers | ratio |", "|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['metric']} | {r['ours']:.1f} | {r['transformers']:.1f} | {r['ratio']:.2f}x |")
    b = result["bandwidth"]
    lines.append(f"\nBatch-1 decode vs the bandwidth bound: {b['batch1_decode_tok_s']:.1f} tok/s of "
                 f"{b['bound_tok_s']:.1f} tok/s ({b['fraction_of_bound']:.0%}); GEMV read rate {b['read_gbs']:.1f} "
                 "GB/s, "
                 f"{b['weight_bytes_per_token'] / 2**20:.0f} MiB of weights read per decode step.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch threads for both sides (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="fewer tokens and requests (a smoke run)")
    add_engine_flags(p, ("model",), defaults={"model": EMBEDDED_MODEL})
    p.add_argument("--prefill-tokens", type=int, default=512,
                   help="prompt length of the prefill row (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    result = run(args.threads, args.quick, args.model, args.prefill_tokens)
    return emit(result, to_markdown(result), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
