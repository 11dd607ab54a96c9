"""ruff, with the project's rules (pyproject.toml [tool.ruff]), over the whole tree: clean, so make test and CI fail on
an unused import, an undefined name or a line over 120 columns; a planted unused import and a planted 121-column line
are caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def ruff(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_the_tree_is_ruff_clean() -> None:
    proc = ruff(".")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_a_planted_unused_import_fails(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("import os\n\n\ndef f() -> int:\n    return 1\n")
    proc = ruff("--config", str(REPO / "pyproject.toml"), str(planted), cwd=tmp_path)
    assert proc.returncode == 1 and "F401" in proc.stdout, proc.stdout + proc.stderr


def test_a_planted_121_column_line_fails(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("x = 1  # " + "a" * 112 + "\n")
    assert len(planted.read_text().splitlines()[0]) == 121
    proc = ruff("--config", str(REPO / "pyproject.toml"), str(planted), cwd=tmp_path)
    assert proc.returncode == 1 and "E501" in proc.stdout, proc.stdout + proc.stderr
