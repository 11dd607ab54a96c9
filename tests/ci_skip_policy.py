"""Skips under CI: a pytest plugin (loaded by tests/conftest.py) that fails the session on any skip outside a short
allow-list when ``CI=true`` (what .ci/run runs under), and names every such skip in the terminal summary.

A skipped test proves nothing, and on a fresh clone nothing should be missing: the data the tests read is committed
(tests/fixtures/), CI installs tritonserver, Dynamo and etcd (`make install`) and builds the default engine (`make
build-engines`). So under CI a skip means a broken install or a missing file, and it must fail the run. The one
exception is a class of machine CI never is: a test marked with a marker of ``CI_ALLOWED_SKIP_MARKERS`` may skip.
Expected failures (xfail) are not skips. Outside CI (a developer's laptop) skips stay skips; ``-rs`` (the Makefile's
test targets) prints their reasons either way.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

CI_ALLOWED_SKIP_MARKERS: dict[str, str] = {
    "cuda": "needs a CUDA device; CI machines have none (make gpu-check runs these on a GPU host)",
}
"""marker -> why a test carrying it may skip under CI. Keep it short: every entry is a claim CI does not check."""


def ci_enforced() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def skip_outside_ci(reason: str, *, allow_module_level: bool = False) -> NoReturn:
    """For what the project installs itself (tritonserver, Dynamo, etcd): skip on a developer's machine that lacks
    it, fail under CI (where its absence is a broken install) with the same reason, so the cause is printed, not a
    bare "skipped"."""
    if ci_enforced():
        pytest.fail(f"{reason} (CI=true: `make install` provides it, so this is a broken install)", pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)


class CISkipPolicy:
    """Collects the skips outside the allow-list during a session and fails it at the end."""

    def __init__(self) -> None:
        self.unexpected: list[str] = []

    def _note(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        keywords = getattr(report, "keywords", {})  # a CollectReport (module-level skip) has none: never allowed
        if any(marker in keywords for marker in CI_ALLOWED_SKIP_MARKERS):
            return
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        self.unexpected.append(f"{report.nodeid}: {reason}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._note(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._note(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unexpected and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.unexpected:
            terminalreporter.section("skips outside the CI allow-list (CI=true fails on them)", red=True)
            for line in self.unexpected:
                terminalreporter.write_line(line)
            allowed = ", ".join(f"{m} ({why})" for m, why in CI_ALLOWED_SKIP_MARKERS.items())
            terminalreporter.write_line(f"allowed to skip: tests marked {allowed}")


def pytest_configure(config: pytest.Config) -> None:
    if ci_enforced():
        config.pluginmanager.register(CISkipPolicy(), "ci_skip_policy_session")
