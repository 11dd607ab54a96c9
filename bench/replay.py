"""Offline trace replay through the engine (no server): latency, SLO and morphing behaviour in one JSON.

  .venv/bin/python -m bench.replay --trace ../shared/data/traces/AzureLLMInferenceTrace_conv.csv \\
      --window burst:72 --time-scale 4 --length-scale 0.25 --mode default --device-memory 600MiB --json out.json

``--mode`` may be given several times and ``--repeat N`` runs each mode N times, interleaved, each figure the
median with its spread. The loop itself is workload/replay.py, which the planner shares.
"""

from __future__ import annotations

import sys

from workload.replay import ENGINE_FIELDS, build_parser, run_cli, run_once

__all__ = ["ENGINE_FIELDS", "build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser().parse_args(argv), run_once)


if __name__ == "__main__":
    sys.exit(main())
