"""Legacy morph-level TensorRT-LLM checkpoints (builder/levels.py, builder/trtllm_export.py; only with
``--legacy-trtllm``), checked without TensorRT-LLM.

TensorRT-LLM cannot be installed here, so each exported checkpoint is read back (config.json, quant_cfg.json,
rank0.safetensors) and checked against TensorRT-LLM's documented checkpoint format
(docs/source/architecture/checkpoint.md: config fields, `transformer.layers.N.attention.qkv/dense`,
`mlp.fc/gate/proj`, `weights_scaling_factor`, `prequant_scaling_factor`, weights as (out, in)) and its
MIXED_PRECISION reader (PretrainedConfig.from_json_file reads `quant_cfg.json` next to config.json into a
strict LayerQuantConfig {quant_algo, kv_cache_quant_algo, quantized_layers: {module: QuantConfig}};
quantize() quantizes exactly the modules named there): exactly the level's layers are quantized, tensor
names, shapes and dtypes are what the format says, and the weights are the engine directory's:
full-precision tensors equal the full weights in fp16, int8 and int4 codes equal the runtime variants'
codes (scales equal after the runtime's bf16 rounding), and the fused int4 qkv equals modelopt's
re-smoothing of the q/k/v variants (one averaged pre_quant_scale for the fused GEMM).

The shared tiny legacy build (`legacy_built`, conftest.py) exports three levels. The default build writes unified
Hugging Face checkpoints instead (tests/builder/test_hf_levels.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from builder import defaults
from builder import levels as lv
from builder.build import BuildOptions, build_engine, requested_params, resolve_levels
from builder.errors import BuildError
from builder.hf_export import source_dtype
from policy.modes import MODES
from serve.config import EngineConfig
from serve.model import engine_dir as ed
from serve.model.kv_cache import kv_bytes_per_block
from tests.conftest import BUILD_FAST, BUILD_LEVELS, BUILD_NUM_LAYERS

# TensorRT-LLM llama module -> the Hugging Face projections it holds (concatenated along the output dim).
MODULE_PROJS = {"attention.qkv": ("q_proj", "k_proj", "v_proj"), "attention.dense": ("o_proj",),
                "mlp.fc": ("gate_proj",), "mlp.gate": ("up_proj",), "mlp.proj": ("down_proj",)}
QUANT_ALGO = {"int8": "W8A16", "int4": "W4A16_AWQ"}
DOCUMENTED_QUANT_FIELDS = {"quant_algo", "kv_cache_quant_algo", "group_size", "has_zero_point", "pre_quant_scale",
                           "exclude_modules"}
LAYER_QUANT_CONFIG_FIELDS = {"quant_algo", "kv_cache_quant_algo", "quantized_layers"}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# ------------------------------------------------------------------------------- reading a checkpoint


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """modelopt's TensorRT-LLM int4: int8 [N/2, K], rows 2j (low nibble) and 2j+1 (high), signed -> [N, K]."""
    low, high = (packed << 4) >> 4, packed >> 4
    return torch.stack([low, high], dim=1).reshape(-1, packed.shape[1]).to(torch.int32)


def read_checkpoint(d: Path) -> tuple[dict, dict[str, dict], dict[str, torch.Tensor]]:
    """config.json, the per-module quantization ({module: QuantConfig dict}) and the rank-0 tensors."""
    cfg = json.loads((d / "config.json").read_text())
    quant = cfg["quantization"]
    modules = {f"transformer.layers.{i}.{m}" for i in range(cfg["num_hidden_layers"]) for m in MODULE_PROJS}
    if quant["quant_algo"] == "MIXED_PRECISION":
        assert set(quant) == {"quant_algo", "kv_cache_quant_algo"}, quant
        qcfg = json.loads((d / "quant_cfg.json").read_text())
        assert set(qcfg) == LAYER_QUANT_CONFIG_FIELDS and qcfg["quant_algo"] == "MIXED_PRECISION", qcfg.keys()
        per_module = qcfg["quantized_layers"]
        assert set(per_module) <= modules, sorted(set(per_module) - modules)
    else:  # one format for every module not matched by exclude_modules (TensorRT-LLM's QuantConfig)
        assert set(quant) <= DOCUMENTED_QUANT_FIELDS, quant
        if (d / "quant_cfg.json").exists():  # modelopt 0.47 writes an empty one for an unquantized model
            assert (quant["quant_algo"] is None
                    and json.loads((d / "quant_cfg.json").read_text())["quantized_layers"] == {})
        excluded = quant.get("exclude_modules") or []
        layer_cfg = {k: v for k, v in quant.items() if k not in ("exclude_modules", "kv_cache_quant_algo")}
        per_module = {m: layer_cfg for m in sorted(modules)
                      if quant["quant_algo"] and not any(m == e or m.startswith(e.rstrip("*")) for e in excluded)}
    for layer_cfg in per_module.values():
        assert set(layer_cfg) <= DOCUMENTED_QUANT_FIELDS - {"exclude_modules", "kv_cache_quant_algo"}, layer_cfg
    return cfg, per_module, load_file(str(d / "rank0.safetensors"))


def expected_layout(config, layer_precisions: dict[int, str], dtype: torch.dtype, group: int) -> dict[str, tuple]:
    """Tensor name -> (dtype, shape) of a llama checkpoint as the format and modelopt 0.47 write it."""
    h, v = config.hidden_size, config.vocab_size
    shapes = {"attention.qkv": (config.q_size + 2 * config.kv_size, h), "attention.dense": (h, config.q_size),
              "mlp.fc": (config.intermediate_size, h), "mlp.gate": (config.intermediate_size, h),
              "mlp.proj": (h, config.intermediate_size)}
    out = {"transformer.vocab_embedding.weight": (dtype, (v, h)), "lm_head.weight": (dtype, (v, h)),
           "transformer.ln_f.weight": (dtype, (h,))}
    for i in range(config.num_layers):
        p = f"transformer.layers.{i}."
        out[p + "input_layernorm.weight"] = out[p + "post_layernorm.weight"] = (dtype, (h,))
        for module, (n, k) in shapes.items():
            precision = layer_precisions.get(i, "full")
            if precision == "full":
                out[f"{p}{module}.weight"] = (dtype, (n, k))
            elif precision == "int8":  # W8A16: int8 (out, in) + fp32 per-channel scale
                out[f"{p}{module}.weight"] = (torch.int8, (n, k))
                out[f"{p}{module}.weights_scaling_factor"] = (torch.float32, (n,))
            else:  # W4A16_AWQ: two int4 per int8 along out, fp32 group scales, per-input AWQ scale
                out[f"{p}{module}.weight"] = (torch.int8, (n // 2, k))
                out[f"{p}{module}.weights_scaling_factor"] = (torch.float32, (n, k // group))
                out[f"{p}{module}.prequant_scaling_factor"] = (dtype, (k,))
    return out


def check_format(d: Path, engine: ed.EngineDir, layer_precisions: dict[int, str], dtype: str) -> dict:
    cfg, per_module, tensors = read_checkpoint(d)
    config, group = engine.config, engine.manifest["int4"]["group_size"]
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["dtype"] == dtype
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["intermediate_size"]) == (
        config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.vocab_size,
        config.intermediate_size)
    assert cfg["mapping"]["world_size"] == 1 and cfg["rotary_base"] == config.rope_theta
    want = {f"transformer.layers.{i}.{m}": QUANT_ALGO[p] for i, p in layer_precisions.items() for m in MODULE_PROJS}
    assert {m: c["quant_algo"] for m, c in per_module.items()} == want
    for module, layer_cfg in per_module.items():
        if layer_cfg["quant_algo"] == "W4A16_AWQ":
            got = (layer_cfg["group_size"], layer_cfg["has_zero_point"], layer_cfg["pre_quant_scale"])
            assert got == (group, False, True)
    layout = expected_layout(config, layer_precisions, DTYPES[dtype], group)
    assert set(tensors) == set(layout), (sorted(set(tensors) - set(layout))[:5], sorted(set(layout) - set(tensors))[:5])
    for name, (dt, shape) in layout.items():
        assert (tensors[name].dtype, tuple(tensors[name].shape)) == (dt, shape), name
    return tensors


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _codes_match(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Integer codes equal, allowing a rare off-by-one where w / (amax / q) and w * (q / amax) round apart."""
    diff = (got.to(torch.int32) - want.to(torch.int32)).abs()
    assert diff.max().item() <= 1 and diff.count_nonzero().item() <= max(1, diff.numel() // 10_000), (
        what, diff.count_nonzero().item(), diff.numel())


def check_weights(tensors: dict[str, torch.Tensor], engine: ed.EngineDir, layer_precisions: dict[int, str],
                  dtype: str) -> None:
    """Every tensor against the engine directory (full weights, runtime variants)."""
    dt, w, group = DTYPES[dtype], engine.loaded.weights, engine.manifest["int4"]["group_size"]
    embed = w["model.embed_tokens.weight"]
    assert torch.equal(tensors["transformer.vocab_embedding.weight"], embed.to(dt))
    assert torch.equal(tensors["lm_head.weight"], w.get("lm_head.weight", embed).to(dt))
    assert torch.equal(tensors["transformer.ln_f.weight"], w["model.norm.weight"].to(dt))
    for i in range(engine.config.num_layers):
        p, hf = f"transformer.layers.{i}.", f"model.layers.{i}."
        assert torch.equal(tensors[p + "input_layernorm.weight"], w[hf + "input_layernorm.weight"].to(dt))
        assert torch.equal(tensors[p + "post_layernorm.weight"], w[hf + "post_attention_layernorm.weight"].to(dt))
        precision = layer_precisions.get(i)
        variant = engine.layer_variant(i, precision) if precision else None
        for module, projs in MODULE_PROJS.items():
            name = f"{p}{module}."
            full = torch.cat([w[f"{hf}{'self_attn' if module.startswith('attention') else 'mlp'}.{q}.weight"] for q
                              in projs])
            if precision is None:
                assert torch.equal(tensors[name + "weight"], full.to(dt)), name
                continue
            ops = [variant[q] for q in projs]
            scale = tensors[name + "weights_scaling_factor"]
            if precision == "int8":
                codes = tensors[name + "weight"]
                _codes_match(codes, torch.cat([op.weight for op in ops]), name)
                assert torch.equal(scale.to(torch.bfloat16), torch.cat([op.scales for op in ops])), name
                deq, ref = codes.float() * scale[:, None], torch.cat([op.dequantize() for op in ops])
                assert _rel(deq, ref) < 5e-3, name
                continue
            codes, pqs = unpack_int4(tensors[name + "weight"]), tensors[name + "prequant_scaling_factor"]
            deq = codes.float() * scale.repeat_interleave(group, dim=1) * pqs.float()[None, :]
            if len(ops) == 1:  # o / gate / up / down: the runtime variant itself
                runtime_scales, zeros = ops[0].scales_and_zeros()
                _codes_match(codes + 8, ops[0].codes(), name)
                assert torch.equal(scale.to(torch.bfloat16).float(), runtime_scales) and not zeros.any(), name
                assert torch.equal(pqs, ops[0].pre_quant_scale.to(dt)), name
                assert _rel(deq, ops[0].dequantize_folded()) < 5e-3, name
            else:  # fused qkv: modelopt averages q/k/v's pre_quant_scale and re-quantizes with it
                avg = torch.stack([op.pre_quant_scale for op in ops]).mean(dim=0)
                assert torch.equal(pqs, avg.to(dt)), name
                smoothed = full / avg[None, :]
                n, k = smoothed.shape
                amax = smoothed.reshape(n, k // group, group).abs().amax(dim=2)
                assert ((scale - amax / 7).abs() <= 1e-6 * scale.abs()).all(), name
                want = torch.clamp((smoothed.reshape(n, k // group, group) * (7 / amax)[..., None]).round(), -8, 7)
                _codes_match(codes, want.reshape(n, k), name)
                runtime = torch.cat([op.dequantize_folded() for op in ops])
                assert _rel(deq, full) < 1.5 * _rel(runtime, full) + 1e-3, name  # as close to the full weights


# ----------------------------------------------------------------------------------- level definitions


def test_default_levels_are_the_ladders_of_the_modes() -> None:
    assert lv.default_levels() == ("int8@25", "int4@25", "int4@50", "int4@75")
    for mode in MODES.values():
        if mode.strategy == "dynamic":
            cap = f"{mode.max_quantized_fraction * 100:g}"
            assert f"{mode.ladder[0]}@{cap}" in lv.default_levels(), mode.mode
            assert all(f"{step}@{cap}" in lv.default_levels() for step in mode.ladder[1:]), mode.mode


def test_level_precisions_are_the_ladders_precisions_a_level_checkpoint_can_hold() -> None:
    """The modes' ladders (policy/modes.py) name what a level may use, the format registry what a level checkpoint
    can hold (fp8's modelopt export re-derives fused scales) and how its modules' quant_algo reads; a checkpoint's
    bytes are the registry's TensorRT-LLM tensors with fp32 scaling factors."""
    from builder.trtllm_export import QUANT_ALGO_PRECISION
    from serve.model.quantized_linear import REGISTRY

    in_ladders = tuple(p for p in REGISTRY if any(p in m.ladder for m in MODES.values()))
    assert lv.LEVEL_PRECISIONS == in_ladders == ("int8", "int4")
    assert all(REGISTRY[p].trtllm.level for p in lv.LEVEL_PRECISIONS) and not REGISTRY["fp8"].trtllm.level
    assert QUANT_ALGO_PRECISION == {"W8A16": "int8", "W4A16_AWQ": "int4"}
    assert lv.linear_bytes(576, 1536, "int4", 2, 64) == 576 * 1536 // 2 + 4 * 576 * (1536 // 64) + 2 * 1536
    assert lv.linear_bytes(576, 1536, "int8", 2, 64) == 576 * 1536 + 4 * 576
    with pytest.raises(ValueError, match="no TensorRT-LLM level byte accounting for 'fp8'"):
        lv.linear_bytes(576, 1536, "fp8", 2, 64)


def test_parse_levels() -> None:
    assert lv.parse_levels("default") is None and lv.parse_levels("none") == ()
    assert lv.parse_levels(" int4@50 ,int8@25.0, int4@12.5+int8@25") == ("int4@50", "int8@25", "int4@12.5+int8@25")
    assert lv.parse_level("int4@12.5+int8@25").dirname == "int4-12.5_int8-25"
    for bad, msg in [("int4", "PRECISION@PERCENT"), ("fp8@50", "not a ladder precision"), ("int4@0", "outside"),
                     ("int4@101", "outside"), ("int4@50+int8@50", "must increase"),
                     ("int4@10+int4@20", "two segments")]:
        with pytest.raises(lv.LevelSpecError, match=msg):
            lv.parse_levels(bad)


def test_layers_and_reaching_modes_follow_the_controller() -> None:
    order = list(range(29, -1, -1))  # 30 layers, swap order 29, 28, ...
    assert lv.parse_level("int4@25").layer_precisions(order) == {i: "int4" for i in range(29, 22, -1)}  # floor(7.5)
    mixed = lv.parse_level("int4@12+int8@25").layer_precisions(order)
    assert mixed == {29: "int4", 28: "int4", 27: "int4", 26: "int8", 25: "int8", 24: "int8", 23: "int8"}

    def modes(name: str) -> list[str]:
        return lv.reaching_modes(lv.parse_level(name).layer_precisions(order), order)

    assert modes("int4@25") == ["accuracy", "default", "performance"]  # accuracy: its cap, all moved to int4
    assert modes("int4@12") == ["default", "performance"]             # accuracy holds int4 only at its cap
    assert modes("int8@25") == modes("int8@12") == modes("int4@12+int8@25") == ["accuracy"]
    assert modes("int8@12+int4@25") == []                             # the milder ladder step sits ahead in swap order
    assert modes("int4@50") == ["default", "performance"] and modes("int4@75") == ["performance"]
    assert modes("int4@100") == ["static-int4"] and modes("int8@100") == ["static-int8"] and modes("int4@90") == []
    assert lv.reaching_modes({0: "int4"}, order) == []                # not a prefix of the swap order


def test_resolve_levels_and_block_size_default() -> None:
    assert defaults.KV_BLOCK_SIZE == EngineConfig().block_size
    assert resolve_levels(BuildOptions()) == (lv.default_levels(), [])
    names, left = resolve_levels(BuildOptions(precisions=("int4", "fp8")))
    assert names == ("int4@25", "int4@50", "int4@75") and [x["level"] for x in left] == ["int8@25"]
    assert resolve_levels(BuildOptions(levels=())) == ((), [])
    names, left = resolve_levels(BuildOptions(hf_export=False, levels=("int4@50",)))
    assert names == () and "--no-hf-export" in left[0]["reason"]
    assert resolve_levels(BuildOptions(hf_export=False, legacy_trtllm=True, levels=("int4@50",))) == (("int4@50",), [])
    with pytest.raises(BuildError, match="needs the int8 variants"):
        resolve_levels(BuildOptions(precisions=("int4",), levels=("int4@10+int8@20",)))


def test_source_dtype(tmp_path, tiny_dir, smollm) -> None:
    from serve.model.loader import load_model, save_hf_directory

    assert smollm.source_tensor_types == ("F32", "Q4_1", "Q8_0")
    assert source_dtype(Path(smollm.source), smollm.source_tensor_types) == (
        "float16", "no bf16 in the source (tensor types F32, Q4_1, Q8_0): float16")
    assert source_dtype(tiny_dir, load_model(str(tiny_dir)).source_tensor_types)[0] == "float16"  # F32, no dtype
    bf = save_hf_directory(load_model(str(tiny_dir)), tmp_path / "bf")
    state = load_file(str(bf / "model.safetensors"))
    from safetensors.torch import save_file

    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(bf / "model.safetensors"))
    assert load_model(str(bf)).source_tensor_types == ("BF16",)
    assert source_dtype(bf, ("BF16",)) == ("bfloat16", "the source stores BF16 tensors (BF16)")
    cfg = json.loads((bf / "config.json").read_text())
    (bf / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float16"}))
    assert source_dtype(bf, ("BF16",)) == ("float16", "config.json declares float16")
    (bf / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    assert source_dtype(bf, ("F32",))[0] == "bfloat16"


# --------------------------------------------------------------------------- the tiny build's checkpoints


def _levels(built) -> dict:
    return built.manifest["trtllm"]["levels"]


def test_manifest_levels_section(legacy_built) -> None:
    m, root = legacy_built.manifest, legacy_built.path
    levels, order = m["trtllm"]["levels"], m["swap_order"]
    cfg = ed.load_engine_dir(root).config
    assert levels["enabled"] and list(levels["entries"]) == list(BUILD_LEVELS) and levels["skipped"] == []
    assert m["build"]["params"]["levels"] == {"names": list(BUILD_LEVELS), "kv_block_size": 16}
    assert m["levels"]["entries"] == {} and not (root / "hf").exists()  # --no-hf-export
    budget = levels["budget"]
    assert (budget["kv_block_size"], budget["kv_dtype"]) == (16, "float16")
    assert budget["kv_bytes_per_block"] == kv_bytes_per_block(cfg, 16, torch.float16) == 2 * 3 * 16 * 32 * 2
    full = m["trtllm"]["full"]
    assert full["status"] == "exported" and full["dir"] == "trtllm/fp16" and full["quant_algo"] is None
    assert "float16" in full["dtype_reason"] and levels["baseline"]["dir"] == "trtllm/fp16"
    assert levels["baseline"]["weight_bytes"] == levels["baseline"]["expected_weight_bytes"] == full["weight_bytes"]
    expected_segments = {  # 34 % of 3 layers = 1 layer, 67 % = 2 (floor)
        "int4@34": [{"precision": "int4", "percent": 34, "layers": order[:1]}],
        "int8@67": [{"precision": "int8", "percent": 67, "layers": order[:2]}],
        "int4@34+int8@67": [{"precision": "int4", "percent": 34, "layers": order[:1]},
                            {"precision": "int8", "percent": 67, "layers": order[1:2]}],
    }
    for name, rec in levels["entries"].items():
        assert rec["segments"] == expected_segments[name]
        assert rec["layers"] == {str(l): s["precision"] for s in expected_segments[name] for l in s["layers"]}
        assert rec["num_quantized"] == len(rec["layers"])
        assert rec["status"] == "exported" and rec["quant_algo"] == "MIXED_PRECISION" and rec["engine_built"] is False
        assert rec["dir"] == f"trtllm/levels/{lv.parse_level(name).dirname}"
        measured = sum(t.numel() * t.element_size() for t
                       in load_file(str(root / rec["dir"] / "rank0.safetensors")).values())
        assert rec["weight_bytes"] == rec["expected_weight_bytes"] == measured
        assert rec["bytes_freed"] == full["weight_bytes"] - rec["weight_bytes"] > 0
        assert rec["kv_blocks_freed"] == rec["bytes_freed"] // budget["kv_bytes_per_block"] > 0
        assert {f["file"].rsplit("/", 1)[1] for f in rec["files"]} == {
            "config.json", "quant_cfg.json", "rank0.safetensors", "build_commands.sh"}
        script = (root / rec["dir"] / "build_commands.sh").read_text()
        assert "trtllm-build --checkpoint_dir . --output_dir engine" in script and "SKIPPED" in script
        assert f"morph level {name}" in script
    # one quantized format + full-precision layers is rewritten to MIXED_PRECISION; two formats are modelopt's own
    assert "mixed_precision" in levels["entries"]["int8@67"]["config_patched"]
    assert "mixed_precision" not in levels["entries"]["int4@34+int8@67"]["config_patched"]
    # int4 frees more than int8 per layer; the mixed level sits between the two
    freed = {n: r["bytes_freed"] for n, r in levels["entries"].items()}
    assert freed["int8@67"] < freed["int4@34+int8@67"] < 2 * freed["int4@34"]
    assert ed.load_engine_dir(root, verify_checksums=True).levels == {}  # the engine serves unified checkpoints only
    assert any(line.strip().startswith("level int4@34: checkpoint exported") for line in legacy_built.messages)
    assert any("NO engine was built" in line for line in legacy_built.messages)


def test_levels_are_build_parameters(legacy_built, tiny_dir) -> None:
    """Same levels: a no-op over the level files too; other levels or block size: different parameters."""
    opts = BuildOptions(model=str(tiny_dir), output=str(legacy_built.path), levels=BUILD_LEVELS, hf_export=False,
                        legacy_trtllm=True, **BUILD_FAST)
    again = build_engine(opts)
    assert again.skipped and again.manifest == legacy_built.manifest
    params = requested_params(opts)
    assert requested_params(BuildOptions(**{**opts.__dict__, "levels": ("int4@34",)})) != params
    assert requested_params(BuildOptions(**{**opts.__dict__, "kv_block_size": 32})) != params
    assert requested_params(BuildOptions(**{**opts.__dict__, "levels": ("int4@34.0", *BUILD_LEVELS)})) == params


@pytest.mark.parametrize("which", ["fp16", "int8", "int4", *BUILD_LEVELS])
def test_checkpoint_format_and_weights(legacy_built, which: str) -> None:
    """The full-precision, whole-model and level checkpoints against the format and the engine directory."""
    built = legacy_built
    engine = ed.load_engine_dir(built.path)
    n = BUILD_NUM_LAYERS
    if which == "fp16":
        rel, layer_precisions = "trtllm/fp16", {}
    elif which in ("int8", "int4"):
        rel, layer_precisions = f"trtllm/{which}", {i: which for i in range(n)}
    else:
        rec = _levels(built)["entries"][which]
        rel, layer_precisions = rec["dir"], {int(k): v for k, v in rec["layers"].items()}
    tensors = check_format(built.path / rel, engine, layer_precisions, "float16")
    check_weights(tensors, engine, layer_precisions, "float16")
    groups = engine.manifest["int4"]["group_size"]
    expected = lv.checkpoint_weight_bytes(engine.config, layer_precisions, 2, groups)
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == expected


def test_level_export_failure_is_recorded(tmp_path, tiny_model) -> None:
    """A level whose precision has no modelopt model (RTN fallback) is recorded as failed, nothing written."""
    from builder.trtllm_export import export_levels

    out = export_levels(tmp_path, torch.nn.Module(), {"int4": None}, ["int4@34", "int4@10"], [2, 1, 0],
                        tiny_model.config, "float16", 64, 16, None, [])
    rec = out["entries"]["int4@34"]
    assert rec["status"] == "failed" and "RTN fallback" in rec["error"] and rec["files"] == []
    assert out["skipped"] == [{"level": "int4@10", "reason": "int4@10 covers 0 of 3 layers"}]
    assert not (tmp_path / "trtllm").exists()
