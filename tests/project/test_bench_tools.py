"""bench/ a newcomer can read: every tool with a command line has a row in docs/bench-tools.md (what it
answers, its command) and a smoke test that the row names and that really runs or imports the tool."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "bench-tools.md"
NO_SMOKE_TEST = {"bench.gpu_check": "it runs only on a CUDA host (make gpu-check), where it runs the CUDA tests"}
"""Tools whose row names no test of their own, each with its reason."""


def tools_with_a_command_line() -> set[str]:
    """bench modules (bench/triton/__main__.py as bench.triton) that define a top-level main()."""
    out = set()
    for path in (REPO_ROOT / "bench").rglob("*.py"):
        if "__pycache__" in path.parts or "peers" in path.parts:
            continue
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(path.read_text()).body):
            rel = path.relative_to(REPO_ROOT).with_suffix("")
            parts = list(rel.parts[:-1]) if rel.name == "__main__" else list(rel.parts)
            out.add(".".join(parts))
    return out


def documented_rows(text: str) -> dict[str, str]:
    """Tool -> its row's last cell (the smoke test) in docs/bench-tools.md's tables."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `(bench\.[a-z_.]+)` \|", line)
        if m:
            rows[m.group(1)] = line.rstrip(" |").rsplit("|", 1)[-1]
    return rows


def missing_smoke_tests(rows: dict[str, str], tools: set[str]) -> list[str]:
    """Tools with no row, a row naming no existing test file, or no named test that mentions the tool."""
    problems = []
    for tool in sorted(tools):
        if tool not in rows:
            problems.append(f"{tool}: no row in docs/bench-tools.md")
            continue
        tests = [REPO_ROOT / p for p in re.findall(r"tests/[\w/]+\.py", rows[tool])]
        if any(not t.is_file() for t in tests):
            problems.append(f"{tool}: names a test file that does not exist")
        module = tool.rsplit(".", 1)[-1]
        pattern = re.compile(rf"\b{re.escape(tool)}\b|from bench import .*\b{module}\b|from bench\.{module} import")
        if tool not in NO_SMOKE_TEST and not any(t.is_file() and pattern.search(t.read_text()) for t in tests):
            problems.append(f"{tool}: no test named in its row runs it")
    return problems


def test_every_bench_tool_is_documented_and_smoke_tested() -> None:
    tools = tools_with_a_command_line()
    assert {"bench.triton", "bench.kernel_breakdown", "bench.memory_yield_demo", "bench.dynamo_aiperf"} <= tools
    assert missing_smoke_tests(documented_rows(DOC.read_text()), tools) == []


def test_the_check_finds_an_undocumented_or_untested_tool() -> None:
    rows = {"bench.swap_cost": " `tests/bench/test_bench_tools.py` ",
            "bench.quant_decode": " `tests/bench/test_traces.py` ",
            "bench.peer": " `tests/no_such_test.py` "}
    assert missing_smoke_tests(rows, {"bench.swap_cost", "bench.quant_decode", "bench.peer", "bench.soak"}) == [
        "bench.peer: names a test file that does not exist", "bench.peer: no test named in its row runs it",
        "bench.quant_decode: no test named in its row runs it", "bench.soak: no row in docs/bench-tools.md"]
