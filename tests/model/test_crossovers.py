"""Kernel crossovers (serve/model/crossovers.py, crossover_measure.py): the rule that turns timings into a row
limit, the measurement on a model's own weights, and the engine applying this machine's entry at start (defaults
where nothing was measured)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from serve.config import EngineConfig
from serve.engine.engine import LLMEngine
from serve.model import crossover_measure as cm
from serve.model import crossovers, kernels
from serve.model.crossovers import DEFAULTS, KernelCrossovers
from serve.model.llama import LlamaModel
from tests.conftest import make_tiny_model

needs_ops = pytest.mark.skipif(kernels.ops() is None, reason=f"CPU kernels unavailable: {kernels.describe()}")


@pytest.mark.parametrize(("ours", "theirs", "limit"), [
    ({1: 1.0, 2: 2.0, 4: 3.0, 8: 5.0}, {1: 2.0, 2: 2.0, 4: 2.5, 8: 4.0}, 1),   # a tie (2 rows) goes to the library
    ({1: 1.0, 2: 2.0, 4: 3.0}, {1: 2.0, 2: 3.0, 4: 4.0}, 4),                  # never slower: the largest measured
    ({1: 3.0, 2: 3.0, 4: 3.0}, {1: 2.0, 2: 2.0, 4: 2.0}, 0),                  # slower everywhere: never ours
    ({4: 1.0, 1: 1.0, 2: 1.0, 8: 3.0}, {1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0}, 4),  # read in row order, not dict order
    # one noisy point (ours 1.3x slower at 4 rows) does not end the range where ours wins by 2x on either side
    ({1: 1.0, 2: 1.0, 4: 2.6, 8: 1.0, 16: 1.0, 32: 3.0}, {1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 2.0, 32: 2.0}, 16),
])
def test_the_limit_comes_closest_to_the_faster_kernel_at_every_row_count(ours, theirs, limit) -> None:
    assert cm.best_split(ours, theirs) == limit


def test_crossovers_validate_and_using_restores() -> None:
    with pytest.raises(ValueError, match="fp32_kernel_max_rows must be an integer >= 0"):
        KernelCrossovers(-1, 2, 8)
    with pytest.raises(ValueError, match="int8_head_max_rows"):
        KernelCrossovers(1, 2, True)
    before = crossovers.current()
    with crossovers.using(blocked_kernel_max_rows=7) as inside:
        assert crossovers.current() is inside and inside.blocked_kernel_max_rows == 7
        assert inside.fp32_kernel_max_rows == before.fp32_kernel_max_rows
    assert crossovers.current() is before


@pytest.fixture
def tiny_model(smollm) -> LlamaModel:
    loaded = make_tiny_model(seed=3, tokenizer=smollm.tokenizer, num_layers=2)
    return LlamaModel(loaded.config, loaded.weights, torch.device("cpu"), torch.float32, max_positions=64)


@needs_ops
def test_measure_times_both_sides_on_the_models_weights(tiny_model: LlamaModel) -> None:
    found, timings = cm.measure(tiny_model, repeats=1)
    assert found.fp32_kernel_max_rows in (0, *cm.PLAIN_ROWS)
    assert timings["fp32 plain"]["rows"] == list(cm.PLAIN_ROWS)
    plain = timings["fp32 plain"]
    assert found.fp32_kernel_max_rows == cm.best_split(dict(zip(plain["rows"], plain["ours_us"])),
                                                        dict(zip(plain["rows"], plain["theirs_us"])))
    if any(layer.qkv.layout is not None for layer in tiny_model.layers):  # blocked where oneDNN packs this shape
        assert found.blocked_kernel_max_rows in (0, *cm.BLOCKED_ROWS) and "fp32 blocked" in timings
    # a random head is not int8 blocks: that choice keeps its default, and the source says so
    assert tiny_model.int8_head is None and "int8 head" not in timings
    assert found.int8_head_max_rows == DEFAULTS.int8_head_max_rows and "default: int8_head_max_rows" in found.source


def test_an_engine_applies_this_machines_entry_else_the_defaults(tmp_path, monkeypatch) -> None:
    """An engine on the tiny model reads the entry stored under this machine's key (the cache here) and makes it
    current; with no entry, or on another machine's key, it uses the defaults."""
    monkeypatch.setenv("MORPHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    config = EngineConfig(model="smollm2-135m", morph_mode="off", num_kv_blocks=8, max_model_len=64, num_threads=1)
    try:
        e = LLMEngine(config)
        model = e.model
        e.shutdown()
        assert crossovers.current() == DEFAULTS
        measured = KernelCrossovers(5, 0, 3, source="measured here")
        cm.store(model, None, cm.entry_for(model, measured, {}))
        e = LLMEngine(config)
        e.shutdown()
        got = crossovers.current()
        assert (got.values(), "read from" in got.source) == (measured.values(), True)
        # the same file under another machine's key is not this machine's
        other = dataclasses.replace(measured, fp32_kernel_max_rows=64)
        monkeypatch.setattr(cm, "key_for", lambda m: {**cm.machine_key(m.device, m.dtype, cm.model_shape(m)),
                                                       "device": "another CPU"})
        cm.store(model, None, cm.entry_for(model, other, {}))
        monkeypatch.undo()
        monkeypatch.setenv("MORPHSERVE_CACHE_DIR", str(tmp_path / "cache"))
        e = LLMEngine(config)
        e.shutdown()
        assert crossovers.current().values() == measured.values()
        (tmp_path / "cache" / cm.CROSSOVERS_FILE).unlink()
        e = LLMEngine(config)
        e.shutdown()
        assert crossovers.current() == DEFAULTS
    finally:
        crossovers.use(DEFAULTS)
