"""Per-precision step cost of a decoder layer on this machine, into the engine directory: the second step of
``make build-engines`` (after ``python -m builder``).

  .venv/bin/python -m builder.step_costs --model engines/smollm2-135m [--force] [--repeats 7] [--threads 2]

Times one decoder layer's linears at full precision and at every quantized variant the engine holds, at
decode batch sizes 1 / 8 / 32 and prefill chunks of 128 / 512 tokens (serve/model/step_costs.py), prints
the table, and stores it in ``<engine dir>/step_costs.json`` and the per-machine cache under this machine's
key, where the cost-aware morph modes find it at start. An entry already there for this machine is reused
(printed) unless ``--force``. The layers are timed as an engine serves them (its layer bank: fused and packed as
the engine fuses and packs them), so this step starts one.

First, on an fp32 CPU engine, the row counts at which our CPU kernels hand over to oneDNN on this machine (the plain
and blocked fp32 linears, the int8 LM head: serve/model/crossovers.py), timed on the same engine's weights
(serve/model/crossover_measure.py) and stored the same way in ``kernel_crossovers.json``; every engine started on
this machine reads them (defaults where nothing was measured). The step costs are then timed under them, so each
token count is timed on the kernels a step of that size runs; the rest of the step is the LM head as a step runs
it (the int8 head blocks up to their crossover).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from policy import FULL
from policy.measurement import Verdict
from serve.config import EngineConfig
from serve.config_flags import add_engine_flags
from serve.model import crossover_measure, crossovers
from serve.model.crossovers import KernelCrossovers
from serve.model.embedded import DEFAULT_ENGINE_DIR
from serve.model.quantized_linear import REGISTRY
from serve.model.step_costs import COSTS_FILE, cache_path, lookup, machine_key, measure_trusted, store


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m builder.step_costs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p, ("model", "num_threads", "device"), aliases={"num_threads": ["--threads"]},
                     defaults={"model": DEFAULT_ENGINE_DIR, "num_threads": 2, "device": "cpu"},
                     help_overrides={"num_threads": "torch threads, as the server runs them"})
    p.add_argument("--precisions", default=None, help="quantized precisions (default: int8,int4; fp8 too on CUDA)")
    p.add_argument("--repeats", type=int, default=7, help="repetitions, fastest kept (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="measure even if this machine's entry exists")
    p.add_argument("--attempts", type=int, default=3,
                   help="measurements at most while the host is too busy to trust one (default: %(default)s)")
    p.add_argument("--pause", type=float, default=10.0,
                   help="seconds between attempts, for a busy neighbour to finish (default: %(default)s)")
    p.add_argument("--strict", action="store_true",
                   help="exit 3 when a table is not stored because the host stayed busy (default: a warning)")
    args = p.parse_args(argv)
    if args.attempts < 1 or args.pause < 0:
        p.error("--attempts must be >= 1 and --pause >= 0")
    from serve.engine.engine import LLMEngine  # noqa: PLC0415
    from serve.morph.runtime import MorphRuntime  # noqa: PLC0415
    from serve.morph.setup import cost_inputs  # noqa: PLC0415

    cuda = args.device.startswith("cuda") or args.device == "auto"
    precisions = args.precisions or ",".join(p for p, fmt in REGISTRY.items() if cuda or fmt.cpu_kernel)
    engine = LLMEngine(EngineConfig(model=args.model, morph_mode="default", morph_precisions=precisions,
                                    policy_overrides={"cost_aware": False}, num_threads=args.num_threads,
                                    device=args.device, num_kv_blocks=8))
    try:
        runtime = engine.resource_manager(MorphRuntime)
        assert runtime is not None
        layers, shape, head = cost_inputs(engine.model, runtime.bank)
        model = engine.model
        key = machine_key(model.device, model.dtype, shape)
        engine_dir = Path(args.model) if (Path(args.model) / "manifest.json").is_file() else None
        targets = ([engine_dir / COSTS_FILE] if engine_dir else []) + [cache_path()]
        # the crossovers first: the step costs are timed on the kernels a step of each size runs (our blocked
        # kernel or oneDNN, the int8 head or the fp32 one), which the crossovers choose
        found, crossovers_ok = measure_crossovers(model, engine_dir, args.force, args.repeats, args.attempts,
                                                  args.pause)
        costs = None if args.force else lookup(targets[0], key, list(layers))
        trusted = True
        if costs is not None:
            print(f"\nstep costs for this machine already in {targets[0]} (--force re-measures)")
        else:
            with crossovers.using(found):
                costs, verdict = measure_trusted(layers, shape, model.device, model.dtype, head=head,
                                                 repeats=args.repeats, attempts=args.attempts, pause_s=args.pause,
                                                 on_attempt=_report("step costs", args.attempts))
            trusted = verdict.trusted
        print(costs.table())
        if not trusted:
            print(f"\nNOT STORED: the step costs were measured while the host was busy ({costs.meta['verdict']}); "
                  "engines on this machine measure at start until a quiet `python -m builder.step_costs --force` "
                  "stores them")
            return 3 if args.strict else 0
        for path in targets:
            store(path, key, costs)
        quantized = [q for q in costs.precisions if q != FULL]
        slower = [q for q in quantized if all(costs.ratio(q, n) > 1 for n in costs.token_counts)]
        print(f"\nkey {key}\nstored in {', '.join(map(str, targets))}")
        if slower:
            print(f"slower than full precision at every size here: {', '.join(slower)} (the cost-aware modes "
                  "quantize them only when the KV they free pays for it)")
        if args.strict and not crossovers_ok:
            return 3
    finally:
        engine.shutdown()
    return 0


def _report(what: str, attempts: int):
    def report(attempt: int, verdict: Verdict) -> None:
        if not verdict.trusted:
            print(f"{what}, attempt {attempt} of {attempts}: the host was busy ({verdict.why()})", flush=True)
    return report


def measure_crossovers(model, engine_dir: Path | None, force: bool, repeats: int, attempts: int = 1,
                       pause_s: float = 0.0) -> tuple[KernelCrossovers, bool]:
    """This machine's kernel crossovers for the engine's model, measured (or reused) and, when measured on a quiet
    host, stored; printed. Returns them and whether they are stored (or were already)."""
    hit = None if force else crossover_measure.find_entry(model, engine_dir)
    if hit is not None:
        entry, found, path = hit
        print(f"\nkernel crossovers for this machine already in {path} (--force re-measures)")
    else:
        found, entry, verdict = crossover_measure.measure_trusted(model, repeats, attempts, pause_s,
                                                                  _report("kernel crossovers", attempts))
        if not verdict.trusted:
            print(f"kernel crossovers {found.values()} NOT STORED: measured while the host was busy "
                  f"({verdict.why()}); this build's step costs are timed under the defaults")
            return crossovers.DEFAULTS, False
    for name, table in entry["timings"].items():
        if isinstance(table, dict):
            print(f"\n{name}: rows {table['rows']}\n  ours   (us) {table['ours_us']}\n  theirs (us) "
                  f"{table['theirs_us']}")
    targets = crossover_measure.store(model, engine_dir, entry)
    print(f"kernel crossovers: {found.values()} ({found.source})\nstored in {', '.join(map(str, targets))}")
    return found, True


if __name__ == "__main__":
    sys.exit(main())
