"""Self-speculative decoding in a plan (sim/speculation.py): the charged time is the draft's forwards a ladder step down
plus one verification, over the tokens it yields on average (hand-computed on a stub step model); the decision is the
server's controller's (drafts at batch 1, not at a large batch); a plan reports TPOT without and with it, and says
when it does not model it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from policy import FULL
from policy.speculation import SpeculationController
from serve.config import EngineConfig
from serve.engine.sampling_params import SamplingParams
from sim.__main__ import main as plan_main
from sim.assemble import build_engine, prompt_tokenizer
from sim.clock import VirtualClock
from sim.speculation import (
    ModelledSpeculation,
    SimSpeculation,
    charged_s,
    default_draft_precision,
    draft_precisions,
    draft_s,
    verify_s,
)
from sim.step_model import BatchShape
from sim.target import table_target
from tests.conftest import FIXTURES

TRACE = FIXTURES / "traces" / "azure_conv_burst.csv"


class StubSteps:
    """A step model simple enough to compute by hand: per row, each layer's cost and the head's by precision, plus
    1 us per token of context read and 1 ms per forward."""

    LAYER = {FULL: 1e-3, "int8": 0.5e-3, "int4": 0.25e-3}
    HEAD = {FULL: 2e-3, "int8": 1e-3}

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[str], str]] = []

    def step_s(self, batch: BatchShape, precisions: Sequence[str], head: str = FULL) -> float:
        self.calls.append((list(batch.decode_kv_lens), list(precisions), head))
        rows = len(batch.decode_kv_lens)
        return rows * (sum(self.LAYER[p] for p in precisions)
                       + self.HEAD[head]) + 1e-6 * sum(batch.decode_kv_lens) + 1e-3


def test_the_draft_serves_each_layer_one_ladder_step_down() -> None:
    assert draft_precisions([FULL, "int8", "int4", "fp8"], "int8") == ["int8", "int4", "int4", "fp8"]
    assert draft_precisions([FULL, "int8"], "int4") == ["int4", "int4"]
    assert draft_precisions([FULL, "fp8"], "fp8") == ["fp8", "fp8"]  # the 8-bit draft of tables without int8_wo
    assert default_draft_precision({FULL, "int8", "int4"}) == "int8" and default_draft_precision({FULL, "fp8"}) == "fp8"


def test_a_drafting_iteration_is_charged_draft_plus_verify_over_the_expected_tokens() -> None:
    """Two sequences at contexts 10 and 20 drafting 2 and 1 tokens, two full-precision layers, precision int8, a = 0.5:
    draft step 0: rows (10, 20), int8 layers and head: 2 x (0.5 + 0.5 + 1) ms + 30 us + 1 ms = 5.030 ms;
    draft step 1: row 11 only: 2 ms + 11 us + 1 ms = 3.011 ms;
    verify: rows 10, 11, 12, 20, 21 at full: 5 x (1 + 1 + 2) ms + 74 us + 1 ms = 21.074 ms;
    tokens on average: E(0.5, 2) + E(0.5, 1) = 1.75 + 1.5 = 3.25 for 2 sequences:
    charged = (8.041 + 21.074) ms x 2 / 3.25 = 17.916923 ms."""
    steps = StubSteps()
    draft = draft_s(steps, [10, 20], [2, 1], [FULL, FULL], "int8")
    assert draft == pytest.approx(8.041e-3)
    assert steps.calls == [([10, 20], ["int8", "int8"], "int8"), ([11], ["int8", "int8"], "int8")]
    verify = verify_s(steps, [10, 20], [2, 1], [FULL, FULL])
    assert verify == pytest.approx(21.074e-3)
    assert steps.calls[-1] == ([10, 11, 12, 20, 21], [FULL, FULL], FULL)
    assert charged_s(draft, verify, [2, 1], 0.5) == pytest.approx(17.916923e-3)
    # every draft accepted (a = 1): k + 1 tokens each; none (a = 0): the target's own token only
    assert charged_s(draft, verify, [2, 1], 1.0) == pytest.approx(29.115e-3 * 2 / 5)
    assert charged_s(draft, verify, [2, 1], 0.0) == pytest.approx(29.115e-3)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"acceptance": 1.5, "k": 3, "precision": "int8"}, "acceptance"),
    ({"acceptance": 0.9, "k": 0, "precision": "int8"}, "-k"),
    ({"acceptance": 0.9, "k": 3, "precision": "int2"}, "rung"),
])
def test_bad_assumptions_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ModelledSpeculation(**kwargs)


def _decode(target, batch: int, output: int = 24) -> SimSpeculation:
    """``batch`` requests of 64 prompt tokens through the planner's engine (auto, acceptance 0.9) to the end."""
    config = EngineConfig(device_memory="0.9", max_num_seqs=256, max_num_batched_tokens=8192, speculation="auto")
    engine = build_engine(config, target, VirtualClock(), ModelledSpeculation(0.9, 4, "int8"))
    prompt = prompt_tokenizer().encode("The capital of France is Paris. " * 9)[:64]
    for i in range(batch):
        engine.add_request(prompt, SamplingParams(max_tokens=output, ignore_eos=True), request_id=f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    spec = engine.resource_manager(SimSpeculation)
    assert isinstance(spec.controller, SpeculationController)  # the server's controller decides
    return spec


def test_the_servers_controller_drafts_at_batch_one_and_not_at_a_large_batch() -> None:
    target = table_target("a100_sxm", "llama-2-7b", 16, 0.001)
    one = _decode(target, 1).stats
    assert one.drafting_iterations > 0 and one.by_batch["1"][1] > 0
    large = _decode(target, 192).stats
    assert large.by_batch["192"][0] > 0 and large.by_batch["192"][1] == 0, large.by_batch
    # the predicted gain below the threshold, as the engine's auto says it; or, where the batch shrank into a batch
    # bucket never measured (corrections are per bucket), the plain step that measures it first
    assert "<" in large.last_decision or "no plain decode step measured yet" in large.last_decision


def _plan(tmp_path: Path, name: str, *extra: str) -> dict:
    args = ["--system", "a100_sxm", "--model", "llama-2-7b", "--trace", str(TRACE), "--window", "burst:72",
            "--time-scale", "4.75", "--fixed-lengths", "--input-len", "256", "--output-len", "48", "--mode", "off",
            "--max-requests", "24", "--json", str(tmp_path / name), *extra]
    assert plan_main(args) == 0
    return json.loads((tmp_path / name).read_text())


def test_a_plan_reports_tpot_without_and_with_speculation_and_says_when_it_does_not_model_it(
        tmp_path: Path, capsys) -> None:
    plain = _plan(tmp_path, "plain.json")
    assert plain["plan"]["speculation"]["modelled"] is False
    assert "--speculation-acceptance" in plain["plan"]["speculation"]["why"]
    assert "not modelled" in capsys.readouterr().err
    good = _plan(tmp_path, "good.json", "--speculation-acceptance", "0.9")["plan"]["speculation"]
    out = capsys.readouterr().out
    assert "| off | auto | 0.9 | 4 | int8 |" in out
    assert good["modelled"] and good["drafting_share_of_decode_iterations"] > 0
    assert good["tpot_ms"]["without"]["mean"] == pytest.approx(plain["tpot_s"]["mean"] * 1e3, abs=1e-3)
    assert good["tpot_ms"]["with"]["mean"] < good["tpot_ms"]["without"]["mean"]
    # drafting whose every token is rejected only adds the draft's forwards
    bad = _plan(tmp_path, "bad.json", "--speculation-acceptance", "0", "--speculation", "always")["plan"]["speculation"]
    assert bad["drafting_share_of_decode_iterations"] > 0.9
    assert bad["tpot_ms"]["with"]["mean"] > bad["tpot_ms"]["without"]["mean"]


def test_speculation_is_modelled_on_gpu_tables_only(capsys) -> None:
    assert plan_main(["--system", "local", "--speculation-acceptance", "0.9"]) == 2
    assert "GPU system's tables" in capsys.readouterr().err
    assert plan_main(["--system", "h200_sxm", "--speculation-acceptance", "0.9", "--speculation-rung", "int8",
                      "--trace", str(TRACE), "--mode", "off", "--max-requests", "2"]) == 2
    assert "has no GEMM rows" in capsys.readouterr().err
