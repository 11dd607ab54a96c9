"""``make build-engines``' second step (builder/step_costs.py): this machine's per-precision step costs and kernel
crossovers measured on the layers an engine serves, stored beside the manifest and read back by an engine started on
that directory."""

from __future__ import annotations

import shutil

from builder import step_costs as cli
from policy.measurement import Verdict
from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.model import crossover_measure as cm
from serve.model import crossovers
from serve.model import step_costs as sc
from tests.morph_support import morph


def test_build_step_costs_into_the_engine_dir_and_the_engine_reads_them(built, tmp_path, monkeypatch, capsys) -> None:
    """``make build-engines``' second step: the table printed, step_costs.json and kernel_crossovers.json beside the
    manifest; an engine started on that directory takes its costs and crossovers from there (nothing measured,
    nothing cached)."""
    eng = tmp_path / "eng"
    shutil.copytree(built.path, eng)
    monkeypatch.setenv("MORPHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    quiet = lambda c: Verdict(True, ())  # noqa: E731 - the host's load is the verdict's input; not this test's subject
    monkeypatch.setattr(sc, "judge", quiet)
    monkeypatch.setattr(cm, "judge", quiet)
    assert cli.main(["--model", str(eng), "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| full |" in out and "| int4 |" in out and "| int8 |" in out
    assert (eng / sc.COSTS_FILE).is_file() and (eng / cm.CROSSOVERS_FILE).is_file()
    assert "fp32 plain: rows [1, 2, 4" in out and "kernel crossovers: {'fp32_kernel_max_rows'" in out
    measured = [line for line in out.splitlines() if line.startswith("kernel crossovers: ")][0]
    again = cli.main(["--model", str(eng)]) == 0 and capsys.readouterr().out
    assert ("step costs for this machine already in" in again
            and "kernel crossovers for this machine already in" in again)
    sc.cache_path().unlink()
    (sc.cache_dir() / cm.CROSSOVERS_FILE).unlink()
    e = LLMEngine(EngineConfig(model=str(eng), morph_mode="default", num_kv_blocks=8, max_model_len=64,
                               num_threads=2))  # the threads the builder measured with (part of the machine key)
    try:
        assert morph(e).controller.costs is not None and not sc.cache_path().exists()
        got = crossovers.current()
        assert str(got.values()) in measured and f"read from {eng / cm.CROSSOVERS_FILE}" in got.source
    finally:
        e.shutdown()
        crossovers.use(crossovers.DEFAULTS)


def test_step_costs_are_timed_under_the_measured_crossovers_with_the_head_a_step_runs(
        built, tmp_path, monkeypatch, capsys) -> None:
    """The crossovers are measured first and the step costs timed under them (a step of 8 tokens runs the kernel
    the crossovers pick for 8 rows, not the previous defaults'); the rest of the step is ``LlamaModel.logits`` (the
    int8 head blocks up to their crossover), not the fp32 head alone."""
    eng = tmp_path / "eng"
    shutil.copytree(built.path, eng)
    monkeypatch.setenv("MORPHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    chosen = crossovers.KernelCrossovers(fp32_kernel_max_rows=7, blocked_kernel_max_rows=5, int8_head_max_rows=3,
                                         source="measured (test)")
    monkeypatch.setattr(cm, "measure", lambda model, repeats=5: (chosen, {"measured": "now", "repeats": repeats}))
    quiet = lambda c: Verdict(True, ())  # noqa: E731 - the host's load is the verdict's input; not this test's subject
    monkeypatch.setattr(sc, "judge", quiet)
    monkeypatch.setattr(cm, "judge", quiet)
    seen = {}
    real = sc.measure

    def spy(layers, shape, device, dtype, head=None, repeats=7):
        seen["crossovers"], seen["head"] = crossovers.current(), head
        return real(layers, shape, device, dtype, head=head, repeats=1)

    monkeypatch.setattr(sc, "measure", spy)
    try:
        assert cli.main(["--model", str(eng), "--repeats", "1", "--force"]) == 0
    finally:
        crossovers.use(crossovers.DEFAULTS)
    assert seen["crossovers"].values() == chosen.values()
    assert getattr(seen["head"], "__func__", None) is type(seen["head"].__self__).logits
    assert crossovers.current() == crossovers.DEFAULTS  # the measurement's crossovers did not leak
