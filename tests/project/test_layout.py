"""The layout stays as docs/architecture.md draws it: every import of every module follows the allowed arrows.

Rooms and arrows (README "Layout"): policy is pure (stdlib only) and everyone may use it; serve.model is the
bottom of the runtime; serve.memory and serve.morph sit above it; serve.engine above those; serve.triton
starts a process and never imports the engine; builder works offline on serve.model; workload is what the planner
and the bench tools share (a workload from a trace, the replay, latency summaries); bench's tools use anything;
nothing in the runtime imports bench, workload or builder, and sim (the planner) imports no tool.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
OURS = ("serve", "policy", "builder", "bench", "workload", "sim")

# room -> rooms it may import (its own room is always allowed).
ALLOWED: dict[str, set[str]] = {
    "policy": set(),
    "serve": set(),  # the package itself (its __init__ sets OpenMP defaults, stdlib only)
    "serve.logging_setup": set(),
    "serve.metrics_catalogue": set(),  # the engine metrics' names, types and help (both front ends export them)
    "serve.error_kinds": set(),  # why a request was refused or ended early: the engine's and every front end's words
    "serve.request_values": set(),  # client text and numbers checked once, for every front end (stdlib only)
    "serve.operator_auth": set(),  # the operator key: HMAC-signed operator controls, for every operator surface
    "serve.resource_seam": set(),  # what a resource manager implements and reads of the scheduler (stdlib only)
    # per-request TTFT / ITL / finish accounting for every front end; reads RequestOutput by duck type (no engine)
    "serve.request_tracker": {"serve.metrics_catalogue", "serve.error_kinds"},
    "serve.config": {"serve.model", "policy"},  # serve.model.embedded: the embedded model's name (stdlib only)
    "serve.config_flags": {"serve.config", "policy"},  # EngineConfig fields as command-line flags (every CLI)
    "serve.model": {"serve.process", "policy"},  # serve.process.host_load: what else ran while it measured
    # process tuning: the C heap's free pages back to the OS, one OpenMP team per process (stdlib + torch)
    "serve.process": set(),
    # the memory and the morph lever read numbers, never the EngineConfig (serve/engine/memory_budget.py resolves it)
    "serve.memory": {"serve.logging_setup", "policy"},
    "serve.morph": {"serve.memory", "serve.model", "serve.process", "serve.logging_setup", "serve.resource_seam",
                    "policy"},
    "serve.guided": {"serve.model", "serve.logging_setup"},
    "serve.engine": {"serve.guided", "serve.morph", "serve.memory", "serve.model", "serve.process", "serve.config",
                     "serve.logging_setup", "serve.error_kinds", "serve.resource_seam", "policy"},
    "serve.triton": {"serve.config", "serve.config_flags", "serve.logging_setup", "serve.metrics_catalogue",
                     "serve.error_kinds", "serve.request_values", "serve.operator_auth", "policy"},
    "serve.dynamo": {"serve.engine", "serve.model", "serve.config", "serve.config_flags", "serve.logging_setup",
                     "serve.metrics_catalogue",
                     "serve.request_tracker", "serve.error_kinds", "serve.request_values", "serve.operator_auth",
                     "policy"},
    "serve.generate": {"serve.engine", "serve.config", "serve.config_flags", "serve.logging_setup", "policy"},
    "triton_models": {"serve.engine", "serve.triton", "serve.config", "serve.logging_setup", "serve.request_tracker",
                      "serve.error_kinds", "serve.operator_auth", "policy"},
    # builder.step_costs (make build-engines' second step) times the layers as an engine's layer bank serves them
    "builder": {"serve.model", "serve.logging_setup", "policy", "serve.engine", "serve.morph", "serve.config",
                "serve.config_flags"},
    # sim (the planner) runs the real engine loop, scheduler and morph runtime on a virtual clock; nothing imports it
    "sim": {"workload", "serve", "serve.engine", "serve.morph", "serve.memory", "serve.model", "serve.config",
            "serve.config_flags",
            "serve.logging_setup", "serve.resource_seam", "policy"},
    # what the planner and the tools share: workloads, the replay loop, latency summaries, repeats, plots, quality
    "workload": {"serve", "serve.engine", "serve.morph", "serve.model", "serve.config", "serve.config_flags",
                 "serve.process", "policy"},
    "bench": {"workload", "serve", "serve.engine", "serve.guided", "serve.morph", "serve.memory", "serve.model",
              "serve.triton", "serve.dynamo", "serve.config",
              "serve.config_flags", "serve.logging_setup", "serve.generate", "policy", "builder"},
}
# Third-party packages a room may not import (policy: anything outside the standard library).
FORBIDDEN_THIRD_PARTY = {"matplotlib": set(ALLOWED) - {"bench", "workload"}, "pyarrow": set(ALLOWED) - {"sim"}}


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] in ("policy", "builder", "bench", "workload", "sim", "triton_models"):
        return parts[0]
    return ".".join(parts[:2])


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO_ROOT).with_suffix("")
    if rel.parts[0] == "triton_models":
        return "triton_models." + "_".join(rel.parts[1:])
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, package: str) -> list[tuple[int, str]]:
    """Every module an ast.Import / ast.ImportFrom names, at any depth (lazy imports count too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
    return found


def source_files() -> list[Path]:
    files = [p for top in (*OURS, "triton_models") for p in (REPO_ROOT / top).rglob("*.py")]
    return sorted(p for p in files if "__pycache__" not in p.parts)


def violations_in(path: Path, room: str, package: str) -> list[str]:
    """The imports of ``path`` (a module of ``package`` in ``room``) that the table does not allow."""
    found = []
    for line, target in imports_of(path, package):
        top = target.split(".")[0]
        if top in OURS:
            other = room_of(target)
            if other != room and other not in ALLOWED[room]:
                found.append(f"{path.name}:{line}: {room} -> {other} ({target})")
        elif room == "policy" and top not in sys.stdlib_module_names and top != "__future__":
            found.append(f"{path.name}:{line}: policy imports {target} (stdlib only)")
        elif room in FORBIDDEN_THIRD_PARTY.get(top, set()):
            found.append(f"{path.name}:{line}: {room} imports {target}")
    return found


def test_every_import_follows_the_allowed_arrows() -> None:
    violations = []
    for path in source_files():
        name = module_name(path)
        room = room_of(name)
        assert room in ALLOWED, f"{path}: module in no room ({room}); add the room to ALLOWED and the README"
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        violations += [f"{path.parent.relative_to(REPO_ROOT)}/{v}" for v in violations_in(path, room, package)]
    assert not violations, "imports against the layout:\n" + "\n".join(violations)


@pytest.mark.parametrize("snippet, room, package, bad", [
    ("from serve.engine import LLMEngine\n", "serve.triton", "serve.triton", True),
    ("from serve.morph.runtime import MorphRuntime\n", "serve.dynamo", "serve.dynamo", True),
    ("from serve.engine import LLMEngine, SamplingParams\n", "serve.dynamo", "serve.dynamo", False),
    ("def f():\n    from builder.quantize import decoder_linears\n", "serve.morph", "serve.morph", True),
    ("import torch\n", "policy", "policy", True),
    ("import matplotlib.pyplot\n", "serve.engine", "serve.engine", True),
    ("from ..engine import scheduler\n", "serve.morph", "serve.morph", True),
    ("from serve.model.layers import PROJECTIONS\n", "builder", "builder", False),
    ("from .decision import MorphDecision\n", "policy", "policy", False),
])
def test_the_checker_catches_a_wrong_arrow(tmp_path: Path, snippet: str, room: str, package: str, bad: bool) -> None:
    """The rule must be able to fail: a planted import (lazy and relative ones too) is judged as the table says."""
    f = tmp_path / "planted.py"
    f.write_text(snippet)
    assert bool(violations_in(f, room, package)) is bad


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (``from pkg import name`` counts as pkg.name when that is a
    module); package __init__ files are left out, since a package importing its own modules is no circle."""
    paths = {module_name(p): p for p in source_files()}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        if path.name == "__init__.py":
            continue
        package = name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = {t for _, t in imports_of(path, package)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {t for t in targets if t in paths and t != name and paths[t].name != "__init__.py"}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that can reach itself again through imports, with one such path."""
    circles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    circles.append(path + [start])
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return circles


def test_no_module_imports_itself_in_a_circle() -> None:
    """Lazy (function-level) imports count: a circle hidden inside a function is still a circle."""
    assert import_circles(import_graph()) == []


def test_the_circle_check_finds_a_planted_circle() -> None:
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})[0] == ["a", "b", "c", "a"]
    assert import_circles({"a": {"b"}, "b": set()}) == []


MAX_LINES = 450
LONG_FILE_REASON = "(Over ~450 lines on purpose:"
"""A module may be longer only when its docstring says why, starting with these words."""


def long_files_without_reason(paths: list[Path]) -> list[str]:
    """Source files over MAX_LINES whose module docstring does not state a reason for it."""
    found = []
    for path in paths:
        text = path.read_text()
        n = text.count("\n")
        if n > MAX_LINES and LONG_FILE_REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            found.append(f"{path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}: {n} lines")
    return found


def test_no_file_over_450_lines_without_a_stated_reason() -> None:
    assert long_files_without_reason(source_files()) == []


def test_the_length_check_finds_a_long_file(tmp_path: Path) -> None:
    body = "x = 1\n" * (MAX_LINES + 1)
    plain, reasoned = tmp_path / "plain.py", tmp_path / "reasoned.py"
    plain.write_text(body)
    reasoned.write_text(f'"""Tables.\n\n{LONG_FILE_REASON} one table read as a whole.)\n"""\n' + body)
    assert long_files_without_reason([plain, reasoned]) == [f"{plain}: {MAX_LINES + 1} lines"]


TEST_ROOMS = {"policy", "model", "process", "memory", "morph", "engine", "triton", "dynamo", "builder", "bench", "sim",
              "project"}


def test_tests_live_in_the_room_of_what_they_test() -> None:
    """tests/<room>/test_*.py: a test file at the top or in an unknown folder is out of place."""
    tests = REPO_ROOT / "tests"
    misplaced = [str(p.relative_to(tests)) for p in tests.rglob("test_*.py")
                 if "__pycache__" not in p.parts
                 and (len(p.relative_to(tests).parts) != 2 or p.parent.name not in TEST_ROOMS)]
    assert misplaced == []
    assert all((tests / room / "__init__.py").is_file() for room in TEST_ROOMS)  # packages: no name shadows ours
