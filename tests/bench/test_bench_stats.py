"""One percentile and one median-and-spread format for every bench tool (workload/latency.py, workload/repeats.py)."""

from __future__ import annotations

import ast
import random
import statistics
from pathlib import Path

import numpy as np
import pytest

from serve.morph.latency_window import percentile as runtime_percentile
from workload.latency import distribution, percentiles
from workload.repeats import cell, span

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def test_percentiles_are_numpys_linear_ones_not_statistics_quantiles() -> None:
    assert percentiles([1.0, 2.0, 3.0, 4.0], (50, 95)) == [2.5, pytest.approx(3.85)]
    assert statistics.quantiles([1.0, 2.0, 3.0, 4.0], n=100)[94] != pytest.approx(3.85)  # why one helper matters
    assert percentiles([]) is None
    assert distribution([1.0, 2.0, 3.0, 4.0]) == {"p50": 2.5, "p95": pytest.approx(3.85), "p99": pytest.approx(3.97),
                                                  "mean": 2.5}


def test_the_runtimes_window_percentile_is_the_same_method() -> None:
    """The morph runtime computes its TTFT / TBT percentiles without numpy (speed): the same numbers."""
    rng = random.Random(0)
    for n in (1, 2, 7, 300):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for pct in (50, 95, 99):
            assert runtime_percentile(values, pct) == pytest.approx(percentiles(values, (pct,))[0], rel=1e-12)
            assert percentiles(values, (pct,))[0] == pytest.approx(float(np.percentile(values, pct)), rel=1e-12)


def test_one_median_and_spread_format() -> None:
    assert span(2.0, 1.0, 3.0) == "2.0 [1.0-3.0]" and span(0.5, 0.25, 0.75, 0, "%") == "50% [25%-75%]"
    assert cell([3.0, 1.0, 2.0], 2) == "2.00 [1.00-3.00]" and cell([0.2, 0.4], 1, "%") == "30.0% [20.0%-40.0%]"
    assert cell([1.5]) == "1.5" and cell([]) == "n/a"


def _calls(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)):
            out.add(f"{node.func.value.id}.{node.func.attr}")
    return out


def test_no_bench_tool_computes_percentiles_its_own_way() -> None:
    """statistics.quantiles (exclusive method) and a second np.percentile would give reports other p95s."""
    own = {p.relative_to(REPO).as_posix(): _calls(p) & {"statistics.quantiles", "np.percentile", "numpy.percentile"}
           for room in (BENCH, REPO / "workload") for p in room.rglob("*.py") if "__pycache__" not in p.parts}
    assert {name: calls for name, calls in own.items() if calls} == {"workload/latency.py": {"np.percentile"}}
