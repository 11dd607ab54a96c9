"""Morph policy overrides and the memory budget as a Triton operator sets them: ``python -m serve.triton
--policy KEY=VALUE`` and config.pbtxt's ``policy`` JSON reach the engine's controller, a bad key or value is
refused before anything starts, and ``device_memory="auto"`` (config.pbtxt's default) sizes the budget by
its rule (serve/engine/memory_budget.py: the memory knobs resolved once into a MemoryBudget)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from serve.config import AUTO_CUDA_FRACTION, EngineConfig, check_device_memory, parse_size
from serve.engine.engine import LLMEngine
from serve.engine.memory_budget import memory_budget
from serve.memory.budget import MemoryBudget
from serve.morph.runtime import MorphRuntime
from serve.triton.__main__ import build_parser, check_params, main, params_from_args
from serve.triton.model_params import engine_config_kwargs
from serve.triton.repository import DEFAULT_MODEL_REPOSITORY, fill_config_parameters, read_config_parameters
from tests.morph_support import morph

CONFIG = DEFAULT_MODEL_REPOSITORY / "morphserve" / "config.pbtxt"
REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--param", "num_kv_blocks=64", "--param", "max_model_len=256", "--param", "block_size=16"]


def engine_from_cli(argv: list[str], loaded) -> LLMEngine:
    """The parameter path of a served model: CLI flags -> the rendered config.pbtxt -> its parameters as
    Triton hands them to model.py -> engine_config_kwargs -> EngineConfig -> the engine (on ``loaded``)."""
    params = params_from_args(build_parser().parse_args(argv))
    check_params(params, DEFAULT_MODEL_REPOSITORY, "morphserve")
    rendered = read_config_parameters(fill_config_parameters(CONFIG.read_text(), params))
    kwargs, ignored = engine_config_kwargs(rendered, EngineConfig, REPO_ROOT)
    assert not ignored
    return LLMEngine(EngineConfig(**kwargs), loaded=loaded)


@pytest.mark.parametrize("argv, kv_low", [
    (["--policy", "kv_high=0.7"], 0.6),
    (["--param", 'policy={"kv_high": 0.7}'], 0.6),
    (["--param", 'policy={"kv_high": 0.9, "kv_low": 0.3}', "--policy", "kv_high=0.7"], 0.3),  # --policy merges over it
], ids=["flag", "config-json", "merged"])
def test_policy_reaches_the_engine_controller(tiny, argv: list[str], kv_low: float) -> None:
    engine = engine_from_cli(["--morph-mode", "default", *SMALL, *argv], tiny)
    assert engine.resource_manager(MorphRuntime) is not None
    config = morph(engine).controller.config
    assert (config.mode, config.kv_high, config.kv_low) == ("default", 0.7, kv_low)


def test_policy_flag_fills_config_pbtxt_and_the_written_repository(tmp_path: Path) -> None:
    params = params_from_args(build_parser().parse_args(["--policy", "kv_high=0.8", "--policy", "ladder=int8,int4"]))
    assert json.loads(params["policy"]) == {"kv_high": 0.8, "ladder": "int8,int4"}
    assert main(["--write-repository", str(tmp_path / "repo"), "--morph-mode", "accuracy",
                 "--policy", "kv_high=0.8", "--policy", "ladder=int8,int4"]) == 0
    written = read_config_parameters((tmp_path / "repo" / "morphserve" / "config.pbtxt").read_text())
    assert json.loads(written["policy"]) == {"kv_high": 0.8, "ladder": "int8,int4"}
    kwargs, _ = engine_config_kwargs(written, EngineConfig, REPO_ROOT)
    assert kwargs["policy_overrides"] == {"kv_high": 0.8, "ladder": "int8,int4"}
    EngineConfig(**kwargs)


@pytest.mark.parametrize("argv, named", [
    (["--policy", "kv_hgh=0.7"], "kv_hgh"),
    (["--policy", "kv_high=high"], "kv_high"),
    (["--policy", "kv_high=0.5"], "kv_high"),          # below the preset's kv_low
    (["--policy", "persist_iters=1.5"], "persist_iters"),
    (["--policy", "ladder=int3"], "int3"),
    (["--param", 'policy={"kv_hgh": 0.7}'], "kv_hgh"),
    (["--param", "policy=kv_high=0.7"], "policy"),      # not JSON
    (["--param", "policy=[0.7]"], "policy"),            # JSON, not an object
    (["--device-memory", "1.5"], "device_memory"),
    (["--device-memory", "lots"], "lots"),
])
def test_bad_policy_or_budget_fails_the_cli_before_any_start(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             argv: list[str], named: str) -> None:
    out = tmp_path / "repo"
    assert main(["--write-repository", str(out), *argv]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists(), "nothing is written for a refused configuration"
    assert main(argv + ["--ready-timeout", "1"]) == 2, "the server is never started"
    assert named in capsys.readouterr().err


def test_bad_policy_in_config_pbtxt_fails_the_model_load_naming_it() -> None:
    """What model.py's initialize() runs on the parameters Triton hands it (a deployment that edited its
    config.pbtxt by hand, bypassing the CLI): the ValueError names the key; initialize() turns it into the
    TritonModelException that fails the load."""
    params = read_config_parameters(fill_config_parameters(CONFIG.read_text(), {"policy": '{"kv_hgh": 0.7}'}))
    kwargs, _ = engine_config_kwargs(params, EngineConfig, REPO_ROOT)
    with pytest.raises(ValueError, match="kv_hgh"):
        EngineConfig(**kwargs)
    model_py = (DEFAULT_MODEL_REPOSITORY / "morphserve" / "1" / "model.py").read_text()
    assert "raise pb_utils.TritonModelException(f\"invalid model parameter: {exc}\")" in model_py


# ------------------------------------------------------------------------------------------------ budget


def test_config_pbtxt_defaults_to_the_auto_budget() -> None:
    assert read_config_parameters(CONFIG.read_text())["device_memory"] == "auto"
    assert EngineConfig().device_memory is None, "library and bench defaults keep the fixed 1GiB KV pool"


def test_auto_budget_on_cpu_holds_one_full_context_request(tiny) -> None:
    engine = LLMEngine(EngineConfig(device_memory="auto", max_model_len=200, block_size=16,
                                    morph_mode="default"), loaded=tiny)
    blocks = math.ceil(200 / 16)
    assert engine.pool.num_blocks == blocks
    ledger = engine.ledger.as_dict()
    assert ledger["kv"] == blocks * engine.ledger.slot_bytes
    assert ledger["budget"] == ledger["used"] + ledger["reserve"], "weights + staging + KV + reserve, nothing idle"
    assert engine.reachable_blocks > blocks, "the default mode can grow the pool by quantizing layers"
    # the model's own context length when max_model_len is not set
    engine = LLMEngine(EngineConfig(device_memory="auto", block_size=16), loaded=tiny)
    assert engine.pool.num_blocks == math.ceil(tiny.config.max_position_embeddings / 16)


def test_one_context_length_rule_for_the_engine_and_the_budget(tiny) -> None:
    """``EngineConfig.context_length``: max_model_len capped at the model's context, the model's when unset; the
    engine's assembly serves it (the planner's: tests/sim) and the auto budget sizes its one request by it."""
    assert EngineConfig(max_model_len=1000).context_length(8192) == 1000
    assert EngineConfig(max_model_len=1000).context_length(512) == 512
    assert EngineConfig().context_length(512) == 512
    for configured in (100, 100000, None):
        engine = LLMEngine(EngineConfig(max_model_len=configured, num_kv_blocks=8), loaded=tiny)
        try:
            want = min(configured or 512, 512)
            assert engine.max_model_len == EngineConfig(max_model_len=configured).context_length(512) == want
        finally:
            engine.shutdown()
    assert budget(EngineConfig(device_memory="auto", max_model_len=100000), "cpu", 512).kv_blocks == 512 // 16


def budget(config: EngineConfig, kind: str, max_positions: int) -> MemoryBudget:
    """The config's budget on a ``kind`` device of 80 GiB."""
    return memory_budget(config, kind, max_positions, lambda text: int(float(text) * 80 * 2**30) if "." in text
                         else parse_size(text))


def test_auto_budget_rule() -> None:
    auto = EngineConfig(device_memory="auto", max_model_len=1000, block_size=16)
    assert budget(auto, "cpu", 8192).kv_blocks == 63 and budget(auto, "cpu", 8192).budget_bytes is None
    assert budget(auto, "cpu", 512).kv_blocks == 32, "capped by the model's context"
    assert budget(auto, "cuda", 8192).budget_bytes == int(AUTO_CUDA_FRACTION * 80 * 2**30)
    assert budget(auto, "cuda", 8192).kv_blocks is None
    fixed = EngineConfig(device_memory="auto", num_kv_blocks=7)
    assert budget(fixed, "cpu", 8192) == budget(fixed, "cuda", 8192) == budget(EngineConfig(num_kv_blocks=7), "cpu",
                                                                               8192)
    assert budget(fixed, "cpu", 8192).kv_blocks == 7 and budget(fixed, "cpu", 8192).budget_bytes is None
    sized = EngineConfig(device_memory="auto", kv_cache_memory="64MiB")
    assert budget(sized, "cpu", 8192) == budget(EngineConfig(kv_cache_memory="64MiB"), "cpu", 8192)
    assert budget(sized, "cpu", 8192).kv_bytes == 64 * 2**20
    explicit = EngineConfig(device_memory="600MiB", memory_reserve="32MiB")
    assert budget(explicit, "cpu", 8192) == MemoryBudget(budget_bytes=600 * 2**20, kv_blocks=None, kv_bytes=2**30,
                                                         reserve_bytes=32 * 2**20, device_memory="600MiB")
    for good in (None, "auto", "600MiB", "0.9", "1"):
        check_device_memory(good)
    for bad in ("1.5", "0", "lots"):
        with pytest.raises(ValueError):
            EngineConfig(device_memory=bad)


def test_a_kv_pool_the_user_sized_is_kept_even_at_the_default_size() -> None:
    """"Set by the user" is kept explicitly (kv_cache_memory None = unset), not guessed by comparing with the
    default: kv_cache_memory="1GiB" given with device_memory="auto" keeps a 1 GiB pool, as any other size would."""
    given = budget(EngineConfig(device_memory="auto", kv_cache_memory="1GiB"), "cuda", 8192)
    assert given.budget_bytes is None and given.kv_bytes == 2**30
    unset = budget(EngineConfig(device_memory="auto"), "cuda", 8192)
    assert unset.budget_bytes == int(AUTO_CUDA_FRACTION * 80 * 2**30)
    assert EngineConfig().kv_cache_memory is None and budget(EngineConfig(), "cpu", 8192).kv_bytes == 2**30
    assert budget(EngineConfig(memory_floor="0", morph_mode="default"), "cpu", 8192).releasable
    assert not budget(EngineConfig(morph_mode="default"), "cpu", 8192).releasable
