"""tests/ci_skip_policy.py, run as CI runs it: pytest in a subprocess with CI=true on planted test files. A skip
outside the allow-list fails the session (exit 1) with its reason in the summary; a cuda-marked skip, an xfail and
the same skips without CI=true do not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

PLANTED = {
    "plain_skip": "import pytest\n\ndef test_needs_a_file():\n    pytest.skip('no such file: data.csv')\n",
    "module_skip": "import pytest\npytest.skip('tritonserver unavailable', allow_module_level=True)\n\n"
                   "def test_never_runs():\n    pass\n",
    "importorskip": "import pytest\npytest.importorskip('no_such_module_for_the_ci_policy_test')\n\n"
                    "def test_never_runs():\n    pass\n",
    "cuda_skip": "import pytest\n\n@pytest.mark.cuda\n@pytest.mark.skipif(True, reason='needs a CUDA device')\n"
                 "def test_on_a_gpu():\n    pass\n\n@pytest.mark.cuda\ndef test_capability():\n"
                 "    pytest.skip('int4 needs sm80+')\n",
    "xfail": "import pytest\n\n@pytest.mark.xfail(reason='known')\ndef test_known():\n    assert False\n",
    "passes": "def test_ok():\n    assert True\n",
}


def run_planted(tmp_path: Path, names: list[str], ci: str | None) -> subprocess.CompletedProcess:
    for name in names:
        (tmp_path / f"test_{name}.py").write_text(PLANTED[name])
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: needs a CUDA device\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "tests.ci_skip_policy", "-p",
                           "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("planted", ["plain_skip", "module_skip", "importorskip"])
def test_a_skip_outside_the_allow_list_fails_under_ci(tmp_path: Path, planted: str) -> None:
    out = run_planted(tmp_path, [planted, "passes"], ci="true")
    assert out.returncode == 1, out.stdout + out.stderr
    summary = out.stdout.split("skips outside the CI allow-list")[1]
    assert f"test_{planted}.py" in summary and "allowed to skip: tests marked cuda" in summary


def test_cuda_skips_and_xfails_pass_under_ci(tmp_path: Path) -> None:
    out = run_planted(tmp_path, ["cuda_skip", "xfail", "passes"], ci="true")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 2 skipped, 1 xfailed" in out.stdout and "CI allow-list" not in out.stdout
    assert "needs a CUDA device" in out.stdout and "int4 needs sm80+" in out.stdout  # -rs: reasons printed


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_a_skip_stays_a_skip(tmp_path: Path, ci: str | None) -> None:
    out = run_planted(tmp_path, ["plain_skip", "passes"], ci=ci)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no such file: data.csv" in out.stdout and "CI allow-list" not in out.stdout


def test_a_failing_session_keeps_its_own_exit_code(tmp_path: Path) -> None:
    (tmp_path / "test_fails.py").write_text("def test_bad():\n    assert False\n")
    out = run_planted(tmp_path, ["plain_skip"], ci="true")
    assert out.returncode == 1 and "1 failed, 1 skipped" in out.stdout
