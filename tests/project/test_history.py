"""History lives in git, not in the code: no Python source (tests included, fixtures aside) and no page of
docs/architecture.md names an issue by number or keeps a bracketed before-story. Dated benchmark reports
(docs/benchmarks/) are records and stay as they are."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ISSUE = re.compile(r"\b[Ii]ssues? " r"\d+|\bBefore " r"issue\b|\[" r"Before\b")
FIXTURES = "tests/fixtures/"


def history_in(path: Path, text: str) -> list[str]:
    """``path:line: text`` for every line of ``text`` that names an issue number or tells a before-story."""
    return [f"{path}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if ISSUE.search(line)]


def python_sources() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / p for p in out.split() if not p.startswith(FIXTURES)]


def test_no_issue_numbers_or_before_stories_in_code_or_the_architecture_doc() -> None:
    found = [hit for p in python_sources() if p.exists() for hit in history_in(p, p.read_text(encoding="utf-8"))]
    arch = REPO / "docs" / "architecture.md"
    found += history_in(arch, arch.read_text(encoding="utf-8"))
    assert not found, "\n".join(found)


def test_a_planted_issue_number_is_found() -> None:
    ref = "issue" + " 12"
    planted = f"def f() -> int:\n    return 1  # see {ref}\n"
    assert history_in(Path("planted.py"), planted) == [f"planted.py:2: return 1  # see {ref}"]
    assert history_in(Path("x.md"), "text [" + "Before: the old way]") and not history_in(Path("x.md"), "Before a step")
