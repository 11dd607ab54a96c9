"""``python -m builder.level_check``: serve each exported morph level with this engine and compare its greedy tokens
with the same level built in memory (the round trip docs/engines.md reports).

    python -m builder.level_check --engine-dir engines/smollm2-135m [--levels int4@25,int4@50] [--json FILE]

"The same level built in memory" (builder/hf_export.py ``exported_level``) is the level's modelopt model at the
checkpoint dtype, the object ``export_hf_checkpoint`` receives, as the export leaves it in memory (fused, folded,
packed), run by this engine: each quantized projection's format read off its modelopt module, never off a config
file. The check rebuilds it the way the build did: the engine directory's source and calibration tokens, modelopt's
calibration per precision, and it first checks that the rebuild reproduces the engine directory's runtime variants
exactly (else the recalibration on this machine is not the build's, and the comparison would mean nothing); it
exports that level again into a scratch directory, which leaves the model as the export holds it. Then, per level:

- ``served``: this engine started on the level's directory (``--engine-dir hf/levels/<level>``, morph mode off);
- ``in_memory``: the same engine on the in-memory level; the two must be equal token for token;
- ``variants``: the same engine on the level assembled from the engine directory's runtime variants (what the morph
  runtime swaps in at that configuration), for information: the export's fusion re-quantizes q/k/v and gate/up at
  int4, so it may differ, and the report says for how many prompts it does.

Exit status: 0 every level equal, 1 one differs or cannot be served, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from builder import hf_export
from builder import levels as lv
from builder.calibration import load_calibration
from builder.calibration_corpus import DEFAULT_CALIBRATION_NAME
from builder.errors import BuildError
from builder.variants import build_variants
from serve.model import crossovers
from serve.model import engine_dir as ed
from serve.model.hf_reference import hf_llama
from serve.model.layers import PROJECTIONS, projection_key
from serve.model.loader import LoadedModel, load_model
from serve.model.quantized_linear import quant_format
from serve.model.unified_checkpoint import UnifiedQuantization

PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "Question: What is 12 times 12?\nAnswer:",
)
MAX_TOKENS = 16


@dataclass
class LevelResult:
    level: str
    dir: str
    served: list[list[int]] | None
    in_memory: list[list[int]]
    variants: list[list[int]]
    error: str | None = None
    variants_same_prompts: int = field(init=False)

    def __post_init__(self) -> None:
        self.variants_same_prompts = sum(a == b for a, b in zip(self.variants, self.in_memory))

    @property
    def equal(self) -> bool:
        return self.error is None and self.served == self.in_memory


def greedy(loaded: LoadedModel | None, prompts: tuple[str, ...], max_tokens: int,
           model: str | None = None) -> list[list[int]]:
    """Greedy tokens of this engine (morph mode off, no speculation) on ``loaded`` or on the directory ``model``."""
    from serve.config import EngineConfig  # noqa: PLC0415 - the engine only when a check runs
    from serve.engine.engine import LLMEngine  # noqa: PLC0415
    from serve.engine.sampling_params import SamplingParams  # noqa: PLC0415

    config = EngineConfig(model=model or "unused", morph_mode="off", speculation="off", num_kv_blocks=128,
                          enable_prefix_caching=False)
    engine = LLMEngine(config, loaded=loaded)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        # one kernel choice for every engine compared: each takes this machine's measured crossovers from the
        # per-user cache when it starts, which other processes may rewrite in between, and the kernels on either side
        # of a crossover sum in different orders
        with crossovers.using(crossovers.DEFAULTS):
            return [r["token_ids"] for r in engine.generate(list(prompts), params)]
    finally:
        engine.shutdown()


def rebuild_models(engine: ed.EngineDir, precisions: set[str]) -> tuple[LoadedModel, torch.nn.Module, dict[str, Any]]:
    """The build's source model and its modelopt models per precision, recalibrated here as the build did; BuildError
    unless they reproduce the engine directory's runtime variants exactly."""
    params = engine.manifest["build"]["params"]
    calib = params["calibration"]
    source = load_model(engine.manifest["source"]["path"])
    text = None if calib["source"] == DEFAULT_CALIBRATION_NAME else calib["source"]
    data = load_calibration(source.tokenizer, text, calib["tokens"], calib["seq_len"])
    if data.sha256 != calib["sha256"]:
        raise BuildError(f"calibration text {calib['source']} changed since the build (sha256 differs)")
    torch.manual_seed(params["seed"])
    hf = hf_llama(source)
    models = {}
    for precision in sorted(precisions):
        result = build_variants(hf, precision, data.batches(), engine.manifest["int4"]["group_size"])
        if result.quantized_model is None:
            raise BuildError(f"{precision}: modelopt failed here ({result.fallback_reason})")
        for i, variant in result.layers.items():
            built = engine.layer_variant(i, precision)
            for proj in PROJECTIONS:
                same = all(torch.equal(a, b) for a, b in zip(variant[proj].tensors().values(),
                                                              built[proj].tensors().values()))
                if not same:
                    raise BuildError(f"recalibrating {precision} here does not reproduce layer {i} {proj} of "
                                     f"{engine.root}: not the build's calibration on this machine")
        models[precision] = result.quantized_model
    return source, hf, models


def variants_level(engine: ed.EngineDir, layer_precisions: dict[int, str]) -> LoadedModel:
    """The level as the morph runtime holds it: the engine directory's full weights, its runtime variants at the
    level's layers."""
    loaded = engine.loaded
    skip = {projection_key(i, p) + ".weight" for i in layer_precisions for p in PROJECTIONS}
    layers = {i: engine.layer_variant(i, p) for i, p in layer_precisions.items()}
    quant = UnifiedQuantization("runtime variants", {projection_key(i, q): quant_format(p).trtllm.quant_algo
                                                     for i, p in layer_precisions.items() for q in PROJECTIONS}, layers)
    return LoadedModel(loaded.config, {k: v for k, v in loaded.weights.items() if k not in skip}, loaded.tokenizer,
                       f"{engine.root} runtime variants", quantized=quant)


def check_levels(root: Path, names: list[str] | None = None, prompts: tuple[str, ...] = PROMPTS,
                 max_tokens: int = MAX_TOKENS, level_dirs: dict[str, Path] | None = None) -> list[LevelResult]:
    """Per exported level (``names``: default all), served vs in memory vs runtime variants. ``level_dirs``: serve
    these directories instead of the levels' own (a test plants a change in a copy)."""
    engine = ed.load_engine_dir(root)
    levels = engine.levels
    names = list(levels) if names is None else names
    unknown = [n for n in names if n not in levels]
    if unknown:
        raise BuildError(f"{root}: no exported level {', '.join(unknown)} (built: {', '.join(levels) or 'none'})")
    plans = {n: {int(k): v for k, v in levels[n]["layers"].items()} for n in names}
    source, hf, models = rebuild_models(engine, {p for plan in plans.values() for p in plan.values()})
    full = hf_export.unquantized_model(hf)
    results = []
    for name in names:
        plan = plans[name]
        if plan != lv.parse_level(name).layer_precisions(engine.swap_order):
            raise BuildError(f"{root}: level {name}'s layers in the manifest are not its plan over the swap order")
        model = hf_export.level_copy(full, models, plan, levels[name]["dtype"])
        with tempfile.TemporaryDirectory(prefix="level-check-") as scratch:  # the export packs the copy in memory
            hf_export.write_checkpoint(model, Path(scratch))
        reference = hf_export.exported_level(model, plan, source.config, source.tokenizer, name)
        del model
        in_memory = greedy(reference, prompts, max_tokens)
        directory = (level_dirs or {}).get(name, root / levels[name]["dir"])
        served, error = None, None
        try:
            served = greedy(None, prompts, max_tokens, model=str(directory))
        except ValueError as exc:  # the engine refused the directory (ModelLoadError, EngineDirError, a mode)
            error = f"{type(exc).__name__}: {exc}"
        results.append(LevelResult(name, str(directory), served, in_memory,
                                   greedy(variants_level(engine, plan), prompts, max_tokens), error))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m builder.level_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", required=True, help="engine directory built by make build-engines")
    p.add_argument("--levels", default=None, help="comma-separated level names (default: every exported level)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="greedy tokens per prompt (default: %(default)s)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    from serve.logging_setup import configure_logging  # noqa: PLC0415

    configure_logging("warning")
    try:
        names = None if args.levels is None else [lv.parse_level(n).name for n in args.levels.split(",") if n.strip()]
        results = check_levels(Path(args.engine_dir), names, max_tokens=args.max_tokens)
    except (BuildError, ed.EngineDirError, lv.LevelSpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for r in results:
        verdict = "EQUAL" if r.equal else f"DIFFERENT{' (' + r.error + ')' if r.error else ''}"
        print(f"{r.level:<18} served {r.dir}: {verdict} to the in-memory level on {len(r.in_memory)} prompts x "
              f"{args.max_tokens} tokens; runtime variants give the same tokens on {r.variants_same_prompts} of "
              f"{len(r.in_memory)}")
    if args.json:
        Path(args.json).write_text(json.dumps([{**asdict(r), "equal": r.equal} for r in results], indent=1) + "\n")
    return 0 if all(r.equal for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
