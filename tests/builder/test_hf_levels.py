"""Morph levels as modelopt unified Hugging Face checkpoints (builder/hf_export.py) and this engine serving them back
(serve/model/unified_checkpoint.py): the tiny shared build (`built`, conftest.py) and, slow, the engine directory
`make build-engines` writes (engines/smollm2-135m, or MORPHSERVE_ENGINE_DIR; CI builds it first).

Each checkpoint's hf_quant_config.json is read twice, independently: by modelopt's own converter (it must give
config.json's quantization_config back, without a warning) and here, straight from the file (quantized_layers, or one
quant_algo with exclude_modules), and the modules and formats it quantizes must be the level's plan over the swap
order. The round trip (builder/level_check.py) serves each level's directory with this engine and compares its
greedy tokens with the same level built in memory: equal on every prompt.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path

import pytest

from builder import hf_export as hx
from builder import levels as lv
from builder.build import BuildOptions, build_engine
from builder.level_check import PROMPTS, check_levels, greedy
from serve.config import EngineConfig
from serve.model import engine_dir as ed
from serve.model.layers import PROJECTIONS, projection_key
from serve.model.loader import ModelLoadError, load_model
from tests.ci_skip_policy import skip_outside_ci
from tests.conftest import BUILD_FAST, BUILD_LEVELS, REPO_ROOT

REAL_ENGINE = Path(os.environ.get("MORPHSERVE_ENGINE_DIR", REPO_ROOT / "engines" / "smollm2-135m"))
QUANT_ALGO = {"int8": "W8A16", "int4": "W4A16_AWQ"}


def plan_of(engine: ed.EngineDir, name: str) -> dict[int, str]:
    return lv.parse_level(name).layer_precisions(engine.swap_order)


def hf_quant_config_formats(d: Path) -> dict[str, str]:
    """``{module: quant_algo}`` straight from hf_quant_config.json: MIXED_PRECISION's quantized_layers, or one
    quant_algo for every decoder projection its exclude_modules does not match."""
    quant = json.loads((d / "hf_quant_config.json").read_text())["quantization"]
    assert quant["kv_cache_quant_algo"] is None
    if quant["quant_algo"] == "MIXED_PRECISION":
        return {m: c["quant_algo"] for m, c in quant["quantized_layers"].items()}
    num_layers = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    modules = [projection_key(i, p) for i in range(num_layers) for p in PROJECTIONS]
    return {m: quant["quant_algo"] for m in modules
            if not any(fnmatch.fnmatchcase(m, e) for e in quant["exclude_modules"])}


def check_level_dir(engine: ed.EngineDir, name: str, rec: dict) -> None:
    plan = plan_of(engine, name)
    d = engine.root / rec["dir"]
    assert rec["status"] == "exported" and rec["dir"] == f"hf/levels/{lv.parse_level(name).dirname}", rec
    assert {int(k): v for k, v in rec["layers"].items()} == plan
    want = {projection_key(i, p): QUANT_ALGO[q] for i, q in plan.items() for p in PROJECTIONS}
    assert hf_quant_config_formats(d) == want, name
    assert hx.check_checkpoint(d, hx.level_modules(plan)) == rec["quant_algo"]  # converter vs our reading
    assert rec["quant_algo"] == ("MIXED_PRECISION" if len(set(plan.values())) > 1 else QUANT_ALGO[plan[min(plan)]])
    files = {Path(f["file"]).name for f in rec["files"]}
    assert files == {"config.json", "generation_config.json", "hf_quant_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"}, files
    assert rec["stored_bytes"] == hx.safetensors_tensor_bytes(d / "model.safetensors")


# ------------------------------------------------------------------------------------ the tiny build


def test_levels_are_unified_checkpoints_of_the_plan(built, tiny_dir) -> None:
    engine = ed.load_engine_dir(built.path, verify_checksums=True)  # every checkpoint file's sha256 too
    levels = built.manifest["levels"]
    assert list(levels["entries"]) == list(BUILD_LEVELS) and levels["skipped"] == []
    assert set(engine.levels) == set(BUILD_LEVELS)
    for name, rec in levels["entries"].items():
        check_level_dir(engine, name, rec)
        assert rec["bytes_freed"] == levels["baseline"]["stored_bytes"] - rec["stored_bytes"] > 0
        assert rec["kv_blocks_freed"] == rec["bytes_freed"] // levels["budget"]["kv_bytes_per_block"] > 0
    # one format plus full-precision layers: modelopt's quant_algo + exclude_modules; two formats: MIXED_PRECISION
    assert [levels["entries"][n]["quant_algo"] for n in BUILD_LEVELS] == ["W4A16_AWQ", "W8A16", "MIXED_PRECISION"]
    assert any(line.strip().startswith("int4@34: 1 layers, W4A16_AWQ") for line in built.messages)
    again = build_engine(BuildOptions(model=str(tiny_dir), output=str(built.path), levels=BUILD_LEVELS, **BUILD_FAST))
    assert again.skipped and again.manifest == built.manifest  # idempotent over the checkpoints too


def test_served_levels_give_the_in_memory_levels_tokens(built) -> None:
    """Every level's directory served by this engine: the in-memory level's greedy tokens on every prompt."""
    results = check_levels(built.path)
    assert [r.level for r in results] == list(BUILD_LEVELS)
    for r in results:
        assert r.error is None and len(r.in_memory) == len(PROMPTS), (r.level, r.error)
        assert r.served == r.in_memory, r.level
        assert len(r.variants) == len(PROMPTS)  # the runtime variants' tokens: reported, not asserted (fp16, fusion)


def _plant(level_dir: Path, module: str, algo: str) -> None:
    """Name ``algo`` as ``module``'s format in hf_quant_config.json and config.json's quantization_config as modelopt
    derives it (consistently, as a wrong exporter would)."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    cfg_path, q_path = level_dir / "config.json", level_dir / "hf_quant_config.json"
    cfg, qcfg = json.loads(cfg_path.read_text()), json.loads(q_path.read_text())
    qcfg["quantization"]["quantized_layers"][module]["quant_algo"] = algo
    cfg["quantization_config"] = convert_hf_quant_config_format(qcfg)
    cfg_path.write_text(json.dumps(cfg, indent=4))
    q_path.write_text(json.dumps(qcfg, indent=4))


def test_a_wrong_per_layer_format_fails_the_round_trip(built, tmp_path) -> None:
    name = "int4@34+int8@67"
    engine = ed.load_engine_dir(built.path)
    planted = tmp_path / "planted"
    shutil.copytree(built.path / engine.levels[name]["dir"], planted)
    plan = plan_of(engine, name)
    int4_layer = next(i for i, p in plan.items() if p == "int4")
    module = projection_key(int4_layer, "o_proj")
    _plant(planted, module, "W8A16")
    with pytest.raises(ValueError, match="quantized modules differ from the level"):
        hx.check_checkpoint(planted, hx.level_modules(plan))
    (result,) = check_levels(built.path, [name], level_dirs={name: planted})
    assert not result.equal and result.served is None
    assert f"{module} (W8A16)" in result.error and "must be int8" in result.error, result.error


def test_unknown_algorithm_and_disagreements_are_refused(built, tmp_path) -> None:
    engine = ed.load_engine_dir(built.path)
    source = built.path / engine.levels["int4@34+int8@67"]["dir"]
    plan = plan_of(engine, "int4@34+int8@67")
    module = projection_key(min(plan), "q_proj")
    cases = {"nvfp4": ("NVFP4", f"{module}: quant_algo 'NVFP4' is not a format this engine runs"),
             "dropped": (None, f"{module} hold weight scales the config does not quantize")}
    for case, (algo, message) in cases.items():
        d = tmp_path / case
        shutil.copytree(source, d)
        if algo is None:
            cfg = json.loads((d / "config.json").read_text())
            del cfg["quantization_config"]["quantized_layers"][module]
            (d / "config.json").write_text(json.dumps(cfg))
        else:
            _plant(d, module, algo)
        with pytest.raises(ModelLoadError) as err:
            load_model(str(d))
        assert message in str(err.value), (case, str(err.value))


def test_a_level_by_name_is_static(built) -> None:
    """``level`` picks a level of the engine directory; a static checkpoint serves with morph mode off only."""
    from serve.engine.engine import LLMEngine

    served = greedy(None, PROMPTS[:2], 6, model=str(built.path / "hf/levels/int4-34"))
    engine = LLMEngine(EngineConfig(model=str(built.path), level="int4@34", num_kv_blocks=64, speculation="off"))
    try:
        from serve.engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        assert [r["token_ids"] for r in engine.generate(list(PROMPTS[:2]), params)] == served
        assert [layer.precision for layer in engine.model.layers].count("int4") == 1
    finally:
        engine.shutdown()
    for kwargs, message in [({"level": "int4@34", "morph_mode": "default"}, "morph mode 'default' needs every layer"),
                            ({"level": "int4@34", "speculation": "always"}, "speculation always drafts"),
                            ({"level": "int4@99"}, "no exported morph level 'int4@99'; built: int4@34, int8@67")]:
        with pytest.raises(ValueError, match=message):
            LLMEngine(EngineConfig(model=str(built.path), num_kv_blocks=64, **kwargs))
    with pytest.raises(ValueError, match="is not one \\(no manifest.json\\)"):
        LLMEngine(EngineConfig(model=str(built.path / "hf/full"), level="int4@34", num_kv_blocks=64))


# ------------------------------------------------------------------- the real engine, when it was built


@pytest.mark.slow
def test_real_engine_levels_round_trip() -> None:
    """`make build-engines` output: hf/full and one unified checkpoint per default level, each the level's plan read
    by modelopt's converter; no legacy trtllm/; every level served gives the in-memory level's tokens on 6 prompts."""
    if not (REAL_ENGINE / ed.MANIFEST).is_file():
        skip_outside_ci(f"no engine directory at {REAL_ENGINE}: run `make build-engines` (or set "
                        "MORPHSERVE_ENGINE_DIR)")
    engine = ed.load_engine_dir(REAL_ENGINE)
    if engine.manifest["build"]["params"]["levels"]["names"] != list(lv.default_levels()):
        skip_outside_ci(f"{REAL_ENGINE} was not built with the default levels (LEVELS=...)")
    assert not (REAL_ENGINE / "trtllm").exists() and engine.manifest["trtllm"] == {"enabled": False}
    full = engine.manifest["hf"]["full"]
    assert full["status"] == "exported" and hx.check_checkpoint(REAL_ENGINE / full["dir"], {}) is None
    assert list(engine.levels) == list(lv.default_levels())
    for name, rec in engine.levels.items():
        check_level_dir(engine, name, rec)
    results = check_levels(REAL_ENGINE)
    for r in results:
        assert r.error is None and r.served == r.in_memory, (r.level, r.error)
