"""Benchmark JSONs under docs/benchmarks hold only what their tool writes: context added by hand belongs in the
report beside them (or in a field the tool itself writes, as bench.soak's command, commit, CPU and time now are)."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

from bench import soak
from bench.provenance import provenance

BENCHMARKS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def returned_keys(func) -> set[str]:
    """The keys of the dict literal ``func`` returns last (what the tool puts in its JSON)."""
    returns = [n for n in ast.walk(ast.parse(inspect.getsource(func))) if isinstance(n, ast.Return)
               and isinstance(n.value, ast.Dict)]
    assert returns, f"{func.__name__} returns no dict literal"
    return {k.value for k in returns[-1].value.keys if isinstance(k, ast.Constant)}


def test_bench_soak_writes_its_provenance() -> None:
    fields = provenance("bench.soak", ["--duration-s", "5"], 0.0, 60.0)
    assert fields["command"] == "python -m bench.soak --duration-s 5"
    assert (fields["started_utc"], fields["ended_utc"]) == ("1970-01-01 00:00:00 UTC", "1970-01-01 00:01:00 UTC")
    assert fields["commit"] and fields["cpu"].endswith("cpus)")
    assert "provenance(" in inspect.getsource(soak.main)


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("soak_*.json")), ids=lambda p: p.name)
def test_soak_jsons_hold_only_what_bench_soak_writes(path: Path) -> None:
    written = returned_keys(soak.run) | set(provenance("bench.soak", [], 0.0, 0.0))
    extra = set(json.loads(path.read_text())) - written
    assert not extra, f"{path.name}: fields bench.soak does not write: {sorted(extra)} (say them in the report .md)"
