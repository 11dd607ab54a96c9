"""The documentation stays true to the code. Fast: no server, no model.

- README.md: at most 400 lines; every `make` target it names exists in the Makefile; every `--flag` it gives a
  `python -m X` command (or a make variable that carries flags, such as WORKER_ARGS) exists in X's argument
  parser; every repository path it names (and every path docs/README.md names) exists.
- docs/: every relative markdown link resolves; docs/benchmarks/README.md lists every JSON and markdown file
  in docs/benchmarks/.
- docs/configuration.md covers every EngineConfig field, PolicyConfig field, config.pbtxt parameter, argparse
  flag of the entry points (each in its own section), environment variable the code reads and Makefile
  variable.

Each check is a function that returns the problems it finds, so the tests at the bottom can plant a bad name and
see the check fail. ``python tests/project/test_docs.py flags MODULE`` prints a markdown table of MODULE's flags (the
source of the tables in docs/configuration.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
DOCS_INDEX = DOCS / "README.md"
CONFIG_DOC = DOCS / "configuration.md"
BENCH_DIR = DOCS / "benchmarks"
BENCH_INDEX = BENCH_DIR / "README.md"
MAX_README_LINES = 400

# The entry points docs/configuration.md documents flag by flag (one section each, headed `python -m X`).
ENTRY_POINTS = ("serve.triton", "serve.dynamo", "serve.dynamo.launch", "serve.dynamo.hosts", "bench.dynamo_faults",
                "bench.replay", "builder")
# Where a module's parser can be built without its heavy imports: serve.dynamo's __main__ imports Dynamo
# itself (only its own venv has it); its command line lives in serve/dynamo/cli.py, which does not.
PARSER_MODULES = {"serve.dynamo": "serve.dynamo.cli"}
# make variables that carry flags of one module (Makefile: WORKER_ARGS goes to every Dynamo worker, ...).
MAKE_ARG_VARS = {"WORKER_ARGS": "serve.dynamo", "BUILD_ARGS": "builder", "COSTS_ARGS": "builder.step_costs",
                 "BENCH_ARGS": "bench.triton", "AIPERF_ARGS": "bench.aiperf", "PEER_ARGS": "bench.peer",
                 "SERVER_PEER_ARGS": "bench.peer_servers", "SOAK_ARGS": "bench.soak",
                 "GPU_CHECK_ARGS": "bench.gpu_check",
                 "PLAN_ARGS": "sim", "HOSTS_ARGS": "serve.dynamo.hosts", "FAULTS_ARGS": "bench.dynamo_faults"}
# Top-level entries of the repository a path in the docs may start with (engines/, gpu-check/, ... are outputs).
TRACKED_ROOTS = {"serve", "policy", "builder", "bench", "sim", "tests", "docs", "triton_models", "Makefile",
                 "pyproject.toml", "README.md", ".github", ".ci"}
CODE_ROOTS = ("serve", "policy", "builder", "bench", "sim", "triton_models")


# ------------------------------------------------------------------------------------------------ extraction


def code_texts(markdown: str) -> list[str]:
    """The code in a markdown text: each fenced block (continuation lines joined) and each inline span."""
    out: list[str] = []
    rest: list[str] = []
    fence: list[str] | None = None
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            if fence is None:
                fence = []
            else:
                out.append(re.sub(r"\\\n\s*", " ", "\n".join(fence)))
                fence = None
            continue
        (fence if fence is not None else rest).append(line)
    prose = "\n".join(rest)
    out += [m.group(2) for m in re.finditer(r"(`+)(.+?)\1", prose, re.S)]
    return out


def makefile_targets(makefile: str) -> set[str]:
    targets = set()
    for line in makefile.splitlines():
        m = re.match(r"^([A-Za-z0-9_.$()/-][^:=\s]*(?:\s+[^:=\s]+)*)\s*:(?!=)", line)
        if m and not line.startswith(("\t", ".PHONY")):
            targets.update(m.group(1).split())
    return targets


def makefile_variables(makefile: str) -> set[str]:
    """Variables the Makefile defines (?=, :=, =) or reads ($(NAME)), upper case only."""
    names = set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*[?:]?=", makefile, re.M))
    names |= set(re.findall(r"\$\(([A-Z][A-Z0-9_]*)\)", makefile))
    return names


def make_targets_named(markdown: str) -> list[str]:
    """The target of every `make ...` command in the markdown's code (variable assignments skipped)."""
    found = []
    for code in code_texts(markdown):
        for m in re.finditer(r"(?:^|[\s;&|(])make((?:[ \t]+[^\s#;&|]+)*)", code, re.M):
            for token in m.group(1).split():
                if re.match(r"^[A-Z_][A-Z0-9_]*=", token):
                    continue
                if token.startswith("-"):
                    continue
                found.append(token)
                break
    return found


def check_make_targets(markdown: str, makefile: str) -> list[str]:
    targets = makefile_targets(makefile)
    return [f"make {t}: no such target in the Makefile" for t in make_targets_named(markdown) if t not in targets]


def flags_named(markdown: str) -> list[tuple[str, str]]:
    """(module, flag) for every --flag given to a `python -m MODULE` command, or inside a make variable that
    carries one module's flags (WORKER_ARGS="--morph-mode ..."), in the markdown's code."""
    found: list[tuple[str, str]] = []
    for code in code_texts(markdown):
        for line in code.splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line)  # shell comments
            try:
                tokens = shlex.split(line)
            except ValueError:
                tokens = line.split()
            module: str | None = None
            for i, token in enumerate(tokens):
                if token in ("|", ";", "&&", "||"):
                    module = None
                elif token == "-m" and i > 0 and tokens[i - 1].rsplit("/", 1)[-1].startswith("python") \
                        and i + 1 < len(tokens):
                    module = tokens[i + 1]
                elif "=" in token and token.split("=", 1)[0] in MAKE_ARG_VARS:
                    var, value = token.split("=", 1)
                    found += [(MAKE_ARG_VARS[var], f) for f in _flags(value.split())]
                elif token == "--" and module == "serve.dynamo.launch":
                    module = "serve.dynamo"  # after --: options for every worker
                elif token == "--":
                    module = None  # passed through to another program (tritonserver)
                elif module and re.match(r"^--[a-z][a-z0-9-]*", token):
                    found.append((module, token.split("=", 1)[0]))
    return found


def _flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if re.match(r"^--[a-z][a-z0-9-]*", t)]


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def _capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
    raise _Captured(self)


def module_parser(module: str) -> argparse.ArgumentParser:
    """The argument parser `python -m module` uses: build_parser() where the module has one, else the parser
    its main() / parse_args() builds (caught at its parse_args call, before anything runs)."""
    name = PARSER_MODULES.get(module, module)
    try:
        mod = importlib.import_module(name + ".__main__")
    except ModuleNotFoundError as exc:
        if exc.name != name + ".__main__":
            raise
        mod = importlib.import_module(name)
    if callable(getattr(mod, "build_parser", None)):
        return mod.build_parser()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", _capture), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", _capture), \
            mock.patch.object(sys, "argv", [name]):
        for fn_name in ("parse_args", "main"):
            fn = getattr(mod, fn_name, None)
            if not callable(fn):
                continue
            for call in (lambda: fn([]), lambda: fn()):
                try:
                    call()
                except _Captured as c:
                    return c.parser
                except TypeError:
                    continue
    raise LookupError(f"no argument parser found for python -m {module}")


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def check_flags(markdown: str) -> list[str]:
    problems = []
    cache: dict[str, set[str]] = {}
    for module, flag in flags_named(markdown):
        if module not in cache:
            try:
                cache[module] = parser_flags(module_parser(module))
            except (ImportError, LookupError) as exc:
                problems.append(f"python -m {module}: cannot read its parser ({exc})")
                cache[module] = set()
                continue
        if cache[module] and flag not in cache[module]:
            problems.append(f"python -m {module} has no flag {flag}")
    return problems


def paths_named(markdown: str) -> list[str]:
    """Repository paths in the markdown's code spans and blocks: tokens whose first segment is a tracked
    top-level entry (serve/..., docs/..., Makefile), without placeholders."""
    out = []
    for code in code_texts(markdown):
        for token in re.split(r"[\s\"'`(),;|]+", code):
            token = token.rstrip(".:").split("#", 1)[0]
            if not token or any(c in token for c in "<>*${}[]=~"):
                continue
            first = token.split("/", 1)[0]
            if first in TRACKED_ROOTS and (token in TRACKED_ROOTS or "/" in token):
                out.append(token.split(":", 1)[0])
    return out


def links_named(markdown: str) -> list[str]:
    """Relative markdown link targets (no scheme, no pure anchors), anchors stripped."""
    out = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", markdown):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def check_paths(doc: Path, text: str | None = None) -> list[str]:
    text = doc.read_text() if text is None else text
    problems = [f"{doc.name}: path {p} does not exist" for p in paths_named(text) if not (REPO / p).exists()]
    problems += [f"{doc.name}: link {p} does not resolve" for p in links_named(text) if not (doc.parent / p).exists()]
    return problems


def check_benchmark_index(index_text: str, bench_dir: Path) -> list[str]:
    listed = set(links_named(index_text)) | {m.group(1) for m in re.finditer(r"`([^`\s]+)`", index_text)}
    problems = []
    for f in sorted(bench_dir.rglob("*")):
        if f.suffix not in (".json", ".md") or f.name == "README.md":
            continue
        rel = f.relative_to(bench_dir).as_posix()
        if rel not in listed:
            problems.append(f"docs/benchmarks/README.md does not list {rel}")
    return problems


def sections(markdown: str) -> dict[str, str]:
    """heading line -> the text under it, up to the next heading of the same or a higher level."""
    lines = markdown.splitlines()
    heads = [(i, len(m.group(1))) for i, ln in enumerate(lines) if (m := re.match(r"^(#+)\s", ln))]
    out = {}
    for k, (i, level) in enumerate(heads):
        end = next((j for j, lv in heads[k + 1:] if lv <= level), len(lines))
        out[lines[i]] = "\n".join(lines[i + 1:end])
    return out


def check_config_doc_flags(doc: str, modules: tuple[str, ...] = ENTRY_POINTS) -> list[str]:
    problems = []
    secs = sections(doc)
    for module in modules:
        heading = next((h for h in secs if h.startswith("#") and f"`python -m {module}`" in h), None)
        if heading is None:
            problems.append(f"configuration.md has no section headed `python -m {module}`")
            continue
        body = secs[heading]
        for flag in sorted(parser_flags(module_parser(module)) - {"-h", "--help"}):
            if not re.search(rf"`{re.escape(flag)}(?![\w-])", body):
                problems.append(f"configuration.md, section {heading.strip('# ')}: flag {flag} missing")
    return problems


def names_missing(doc: str, names: set[str], what: str) -> list[str]:
    return [f"configuration.md: {what} {n} missing" for n in sorted(names) if not re.search(rf"`{re.escape(n)}\b", doc)]


def config_pbtxt_parameters() -> set[str]:
    from serve.triton.repository import read_config_parameters

    return {k for cfg in (REPO / "triton_models").glob("*/config.pbtxt") for k
            in read_config_parameters(cfg.read_text())}


def environment_variables() -> set[str]:
    """Names the code reads from the environment: quoted upper-case names on lines that touch os.environ,
    getenv or the launcher's _env_port, plus the OpenMP and oneDNN-cache defaults serve/__init__.py sets."""
    names: set[str] = set()
    for root in CODE_ROOTS:
        for py in (REPO / root).rglob("*.py"):
            for line in py.read_text().splitlines():
                if re.search(r"environ|getenv|_env_port\(", line) and not line.lstrip().startswith("#"):
                    names |= set(re.findall(r"""["']([A-Z][A-Z0-9_]*[A-Z0-9])["']""", line))
    import serve

    names |= set(serve.OMP_DEFAULTS) | set(serve.ONEDNN_CACHE_DEFAULTS)
    return names - {"PATH"}  # PATH: only prepended to while the kernels build


# ------------------------------------------------------------------------------------------------ the checks


def test_readme_is_at_most_400_lines() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}; move detail into docs/)"


def test_every_make_target_in_the_readme_exists() -> None:
    assert make_targets_named(README.read_text()), "the README names no make target: the extraction is broken"
    assert check_make_targets(README.read_text(), (REPO / "Makefile").read_text()) == []


def test_every_flag_in_the_readme_exists() -> None:
    assert len(flags_named(README.read_text())) > 5, "the README's commands carry no flags: the extraction is broken"
    assert check_flags(README.read_text()) == []


@pytest.mark.parametrize("doc", [README, DOCS_INDEX], ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_in_the_readme_and_the_docs_index_exists(doc: Path) -> None:
    assert paths_named(doc.read_text()) or links_named(doc.read_text())
    assert check_paths(doc) == []


def test_every_link_in_docs_resolves() -> None:
    problems = []
    for doc in sorted(DOCS.rglob("*.md")):
        problems += [f"{doc.relative_to(REPO)}: link {p} does not resolve"
                     for p in links_named(doc.read_text()) if not (doc.parent / p).exists()]
    assert problems == []


def test_the_benchmark_index_lists_every_json_and_markdown_file() -> None:
    assert list(BENCH_DIR.glob("*.json"))
    assert check_benchmark_index(BENCH_INDEX.read_text(), BENCH_DIR) == []


def test_configuration_covers_every_engine_config_field() -> None:
    from serve.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert names_missing(CONFIG_DOC.read_text(), fields, "EngineConfig field") == []


def test_configuration_covers_every_policy_field() -> None:
    from policy import PolicyConfig

    fields = {f.name for f in dataclasses.fields(PolicyConfig)}
    assert names_missing(CONFIG_DOC.read_text(), fields, "PolicyConfig field") == []


def test_configuration_covers_every_config_pbtxt_parameter() -> None:
    params = config_pbtxt_parameters()
    assert {"engine_dir", "morph_mode", "max_num_seqs"} <= params
    assert names_missing(CONFIG_DOC.read_text(), params, "config.pbtxt parameter") == []


def test_configuration_covers_every_flag_of_the_entry_points() -> None:
    assert check_config_doc_flags(CONFIG_DOC.read_text()) == []


def test_configuration_covers_every_environment_variable() -> None:
    names = environment_variables()
    assert {"MORPHSERVE_QACTIVATIONS", "OMP_WAIT_POLICY"} <= names
    assert names_missing(CONFIG_DOC.read_text(), names, "environment variable") == []


def test_configuration_covers_every_makefile_variable() -> None:
    names = makefile_variables((REPO / "Makefile").read_text())
    assert {"MODEL", "ENGINE_DIR", "TORCH"} <= names
    assert names_missing(CONFIG_DOC.read_text(), names, "Makefile variable") == []


# ------------------------------------------------------------------------------------------- the checks fail


def test_the_checks_catch_a_planted_error(tmp_path: Path) -> None:
    makefile = (REPO / "Makefile").read_text()
    assert check_make_targets("```\nmake serve\nmake serv-typo\n```", makefile) == [
        "make serv-typo: no such target in the Makefile"]
    assert check_make_targets("run `make HTTP_PORT=9000 serve`", makefile) == []
    assert check_flags("`.venv/bin/python -m serve.triton --engine-dir x --no-such-flag 1`") == [
        "python -m serve.triton has no flag --no-such-flag"]
    assert check_flags("```\n.venv-dynamo/bin/python -m serve.dynamo.launch --replicas 1 -- --model-card-dir d "
                       "--bogus\n```") == ["python -m serve.dynamo has no flag --bogus"]
    assert check_flags('`make serve-dynamo WORKER_ARGS="--morph-mode off --nope"`') == [
        "python -m serve.dynamo has no flag --nope"]
    doc = tmp_path / "README.md"
    doc.write_text("see `serve/no_such_module.py` and [the docs](docs/no_such.md)\n")
    assert check_paths(doc) == ["README.md: path serve/no_such_module.py does not exist",
                                "README.md: link docs/no_such.md does not resolve"]
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "run_a.json").write_text("{}")
    (bench / "run_b.json").write_text("{}")
    assert check_benchmark_index("- [run_a.json](run_a.json)\n",
                                 bench) == ["docs/benchmarks/README.md does not list run_b.json"]
    doc_text = "## `python -m serve.triton`\n\n| `--engine-dir` |\n"
    problems = check_config_doc_flags(doc_text, ("serve.triton",))
    assert "configuration.md, section `python -m serve.triton`: flag --http-port missing" in problems
    assert not any("--engine-dir" in p for p in problems)
    assert names_missing("`kv_high` and `kv_low`", {"kv_high", "kv_lowest"},
                         "x") == ["configuration.md: x kv_lowest missing"]


def test_every_entry_point_parser_is_found() -> None:
    for module in ENTRY_POINTS:
        assert "--help" in parser_flags(module_parser(module)) or "-h" in parser_flags(module_parser(module))


# ------------------------------------------------------------------------------------------------ generation


def flag_table(module: str) -> str:
    """A markdown table of `python -m module`'s flags: flag, default, meaning (from the parser's help)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in module_parser(module)._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = " / ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
        default = action.default
        if isinstance(default, Path) or (isinstance(default, str) and str(REPO) in default):
            default = str(default).replace(str(REPO), "<checkout>")
        shown = "" if default in (None, [], argparse.SUPPRESS) else f"`{default}`"
        meaning = (action.help or "").replace("%(default)s", str(action.default)).replace("|", "\\|")
        if action.choices:
            meaning += f" (one of {', '.join(map(str, action.choices))})"
        rows.append(f"| {name} | {shown} | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python tests/project/test_docs.py flags serve.triton
    sys.path.insert(0, str(REPO))
    if len(sys.argv) == 3 and sys.argv[1] == "flags":
        print(flag_table(sys.argv[2]))
    else:
        sys.exit("usage: python tests/project/test_docs.py flags MODULE")
