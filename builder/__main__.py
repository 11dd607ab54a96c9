"""``python -m builder``: build an engine directory (see serve/model/engine_dir.py for its layout).

Exit status: 0 built or already up to date; 2 bad input (one-line message on stderr); 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys

from builder import defaults, levels
from builder.errors import BuildError
from serve.config_flags import add_engine_flags

PRECISIONS = defaults.PRECISIONS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors also exit 2, but print usage first
        self.exit(2, f"error: {message}\n")


def _precisions(value: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in value.split(",") if p.strip())
    unknown = [p for p in names if p not in PRECISIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown precision {', '.join(unknown) or '(none given)'}; choose from {', '.join(PRECISIONS)}")
    return names


def _levels(value: str) -> tuple[str, ...] | None:
    try:
        return levels.parse_levels(value)
    except levels.LevelSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="python -m builder", description=(
        "Build an engine directory: full-precision weights, per-layer int8 / int4-AWQ / fp8 variants "
        "(nvidia-modelopt), the MorphServe layer-importance swap order (LIS), a manifest, and modelopt unified "
        "Hugging Face checkpoints of the full model and of each morph level (hf/full, hf/levels/<level>: what "
        "TensorRT-LLM's PyTorch backend, vLLM, SGLang and this engine load, nothing to compile). Idempotent and "
        "atomic."))
    add_engine_flags(p, ("model",), defaults={"model": defaults.MODEL}, help_overrides={
        "model": "the model to build from: embedded model name, a .gguf file or a Hugging Face directory"})
    p.add_argument("--output", default=None, help="engine directory to write (default: engines/<model name>)")
    p.add_argument("--precisions", type=_precisions, default=PRECISIONS,
                   help="comma-separated variants to build, from int8,int4,fp8 (default: int8,int4,fp8)")
    p.add_argument("--group-size", type=int, default=None,
                   help="int4 group size (default: 128 if it divides every in_features, else 64; SmolLM2: 64)")
    p.add_argument("--calib-text", default=None,
                   help="UTF-8 calibration text file (default: the built-in public-domain corpus, "
                        "builder/calibration_corpus.py)")
    p.add_argument("--calib-tokens", type=_positive, default=defaults.CALIB_TOKENS,
                   help=f"calibration tokens for modelopt, in sequences of {defaults.SEQ_LEN} (default: %(default)s)")
    p.add_argument("--profile-tokens", type=_positive, default=defaults.PROFILE_TOKENS,
                   help="first N calibration tokens used for the layer-importance profile, whose cost grows "
                        "with N x layers^3 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="torch seed (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="rebuild even if the engine directory is up to date")
    p.add_argument("--no-hf-export", dest="hf_export", action="store_false",
                   help="skip the unified Hugging Face checkpoints (hf/full and the morph levels)")
    p.add_argument("--legacy-trtllm", action="store_true",
                   help="LEGACY, for old deployments: also write TensorRT-LLM legacy checkpoints (trtllm/: per "
                        "precision, full precision, per level) with their trtllm-build commands; upstream deprecated "
                        "trtllm-build and modelopt's legacy export (removed in modelopt 0.49)")
    p.add_argument("--levels", type=_levels, default=None, metavar="SPEC",
                   help="morph levels to export as unified Hugging Face checkpoints: comma-separated "
                        "PRECISION@PERCENT[+PRECISION@PERCENT] (first PERCENT of the LIS swap order at PRECISION, "
                        "int8 or int4), 'default' (the ladders of policy/modes.py: "
                        f"{','.join(levels.default_levels())}) or 'none' (default: default)")
    p.add_argument("--no-levels", dest="levels", action="store_const", const=(),
                   help="skip the morph-level checkpoints (same as --levels none)")
    p.add_argument("--kv-block-size", type=_positive, default=defaults.KV_BLOCK_SIZE,
                   help="tokens per KV block for the levels' kv_blocks_freed (default: %(default)s, the serving "
                        "default)")
    p.add_argument("--quiet", action="store_true", help="no progress bars, warnings-only logs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from serve.logging_setup import configure_logging

    configure_logging("warning" if args.quiet else "info")
    from builder.build import BuildOptions, build_engine

    opts = BuildOptions(model=args.model, output=args.output, precisions=args.precisions, group_size=args.group_size,
                        calib_text=args.calib_text, calib_tokens=args.calib_tokens,
                        profile_tokens=args.profile_tokens, seed=args.seed, force=args.force,
                        hf_export=args.hf_export, legacy_trtllm=args.legacy_trtllm,
                        levels=args.levels, kv_block_size=args.kv_block_size, progress=not args.quiet)
    try:
        outcome = build_engine(opts)
    except BuildError as exc:
        print("error: " + " ".join(str(exc).split()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the previous engine directory (if any) is unchanged", file=sys.stderr)
        return 130
    for line in outcome.messages:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
