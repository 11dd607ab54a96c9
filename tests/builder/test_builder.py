"""python -m builder / serve.model.engine_dir on a tiny random Llama (3 layers, hidden 64) saved as an HF directory.

Round-trip tolerances (relative Frobenius error of a runtime linear loaded from the engine directory
against the builder's modelopt fake-quant QuantLinear on the same fp32 input), as in
tests/model/test_quantized_linear.py: int8 / int4 6e-3 (bf16 activations and scales in the aten kernels;
the integer codes are modelopt's exactly), fp8 1e-6 (dequantized fp32 path, bit-identical weights).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from builder.build import BuildOptions, build_engine
from builder.calibration import load_calibration
from builder.forward import DenseLlama
from builder.importance import (
    LIS_WEIGHTS,
    SuffixMds,
    gram_token_cosine,
    greedy_lis_order,
    lis_score,
    token_cosine,
)
from builder.quantize import decoder_linears
from builder.variants import build_variants
from policy.precisions import QUANTIZED_PRECISIONS as PRECISIONS
from serve.model import engine_dir as ed
from serve.model.hf_reference import hf_llama
from serve.model.layers import PROJECTIONS, projection_key
from serve.model.loader import load_model
from serve.model.rtn import quantize_int4_rtn
from tests.conftest import BUILD_FAST, BUILD_NUM_LAYERS, REPO_ROOT, hf_reference_model

OUTPUT_RTOL = {"int8": 6e-3, "int4": 6e-3, "fp8": 1e-6}
FAST = BUILD_FAST
NUM_LAYERS = BUILD_NUM_LAYERS
# tiny_model, tiny_dir and the shared build `built` are session fixtures in conftest.py


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------------- build + manifest


def test_manifest_contents_and_checksums(built, tiny_model) -> None:
    root, m = built.path, json.loads((built.path / ed.MANIFEST).read_text())
    assert not built.skipped and m == built.manifest
    assert m["format_version"] == ed.FORMAT_VERSION
    assert m["model"]["config"] == tiny_model.config.to_hf_dict()
    assert m["source"]["kind"] == "hf-directory" and len(m["source"]["sha256"]) == 64
    assert m["precisions"] == list(PRECISIONS)
    assert m["int4"]["group_size"] == 64 and "128 does not divide" in m["int4"]["reason"]
    assert sorted(m["swap_order"]) == list(range(NUM_LAYERS))
    assert m["front_to_back"] == [0, 1, 2] and m["back_to_front"] == [2, 1, 0]
    assert m["build"]["params"]["calibration"]["tokens"] == 64 and m["build"]["params"]["seed"] == 0
    assert set(m["versions"]) >= {"torch", "modelopt", "transformers", "project"}
    assert m["full"]["file"] == ed.FULL_WEIGHTS
    records = ed.manifest_files(m)
    assert {r["file"] for r in records} == {str(p.relative_to(root)) for p in root.rglob("*")
                                            if p.is_file()} - {ed.MANIFEST}
    for rec in records:
        assert (root / rec["file"]).stat().st_size == rec["bytes"], rec["file"]
        assert ed.sha256_file(root / rec["file"]) == rec["sha256"], rec["file"]
    engine = ed.load_engine_dir(root, verify_checksums=True)
    for i, layer in enumerate(m["layers"]):
        assert layer["layer"] == i and sorted(layer["variants"]) == sorted(PRECISIONS)
        for precision, rec in layer["variants"].items():
            assert rec["file"] == f"layers/layer_{i:03d}.{precision}.safetensors"
            assert rec["runtime_nbytes"] == sum(q.nbytes for q in engine.layer_variant(i, precision).values())
            assert rec["runtime_nbytes"] < layer["full_nbytes"]
    for quant in m["quantization"].values():
        assert quant["fallback_reason"] is None and quant["method"].startswith("modelopt")


def test_profile_json_follows_the_greedy_lis_rule(built) -> None:
    profile = json.loads((built.path / ed.PROFILE).read_text())
    assert profile["metric_precision"] == "int4" and profile["profile_seconds"] >= 0
    assert len(profile["rounds"]) == NUM_LAYERS
    quantized: list[int] = []
    for r, rnd in enumerate(profile["rounds"]):
        assert rnd["quantized_before"] == sorted(quantized)
        cands = rnd["candidates"]
        assert sorted(c["layer"] for c in cands) == sorted(set(range(NUM_LAYERS)) - set(quantized))
        for c in cands:
            assert c["lis"] == pytest.approx(0.25 * c["lts"] + 0.25 * c["lrs"] + 0.5 * c["mds"], abs=1e-12)
            assert -1 <= c["mds"] <= 1 + 1e-9 and -1 <= c["lrs"] <= 1 + 1e-9
        assert rnd["picked"] == max(cands, key=lambda c: (c["lis"], -c["layer"]))["layer"]
        quantized.append(rnd["picked"])
    assert profile["order"] == quantized == built.manifest["swap_order"]


def test_default_build_writes_unified_checkpoints_and_no_legacy_trtllm(built) -> None:
    """The default build: hf/full (and the levels, tests/builder/test_hf_levels.py); no trtllm/, no trtllm-build
    commands (the legacy export is opt-in, --legacy-trtllm)."""
    assert built.manifest["trtllm"] == {"enabled": False}
    assert not (built.path / "trtllm").exists() and not list(built.path.rglob("build_commands.sh"))
    full = built.manifest["hf"]["full"]
    assert built.manifest["hf"]["enabled"] and full["status"] == "exported" and full["dir"] == "hf/full"
    d = built.path / full["dir"]
    cfg = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in cfg and not (d / "hf_quant_config.json").exists()
    assert cfg["num_hidden_layers"] == NUM_LAYERS and cfg["architectures"] == ["LlamaForCausalLM"]
    assert {f["file"] for f in full["files"]} >= {f"hf/full/{n}" for n in ("config.json", "model.safetensors",
                                                                          "tokenizer.json", "tokenizer_config.json")}
    assert not any("TensorRT-LLM" in line for line in built.messages)


def test_int4_variants_keep_their_awq_scale_when_modelopt_updates_its_own(tiny_model) -> None:
    """modelopt's exports re-smooth fused projections by writing a new pre_quant_scale into the quantizer's buffer in
    place; a runtime variant must keep the scale its codes were made with (the layer profile runs on the variants
    after the exports)."""
    from builder.variants import build_variants
    from serve.model.hf_reference import hf_llama

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 250, (1, 32), generator=g) for _ in range(2)]
    result = build_variants(hf_llama(tiny_model), "int4", batches, 32)
    variant = result.layers[0]["k_proj"]
    before = variant.pre_quant_scale.clone()
    quantizer = result.quantized_model.model.layers[0].self_attn.k_proj.input_quantizer
    quantizer.pre_quant_scale = quantizer.pre_quant_scale * 2  # modelopt's setter copies into its buffer
    assert torch.equal(variant.pre_quant_scale, before)


def test_load_engine_dir_round_trip(built, tiny_dir, tiny_model) -> None:
    engine = ed.load_engine_dir(built.path, verify_checksums=True)
    assert engine.config == load_model(str(tiny_dir)).config  # named after the source directory
    assert dataclasses.replace(engine.config, name="tiny") == tiny_model.config
    assert engine.swap_order == built.manifest["swap_order"] and engine.precisions == list(PRECISIONS)
    assert engine.loaded.weights.keys() == tiny_model.weights.keys()
    assert all(torch.equal(engine.loaded.weights[k], v) for k, v in tiny_model.weights.items())
    text = "Hello, world! 12345 <|im_start|>user"
    assert engine.loaded.tokenizer.encode(text) == tiny_model.tokenizer.encode(text)
    assert engine.loaded.tokenizer.eos_token_ids == tiny_model.tokenizer.eos_token_ids


@pytest.mark.parametrize("precision", PRECISIONS)
def test_variants_match_modelopt_fake_quant(built, tiny_dir, precision: str, monkeypatch) -> None:
    """Every stored variant, loaded back, against the builder's own modelopt run on the same calibration."""
    monkeypatch.setenv("MORPHSERVE_QACTIVATIONS", "fp32")  # the weights vs modelopt's, not the activation rounding
    loaded = load_model(str(tiny_dir))
    calib = load_calibration(loaded.tokenizer, None, FAST["calib_tokens"])
    reference = build_variants(hf_llama(loaded), precision, calib.batches(), group_size=64)
    assert reference.fallback_reason is None
    modules = decoder_linears(reference.quantized_model)
    engine = ed.load_engine_dir(built.path)
    gen = torch.Generator().manual_seed(7)
    for i in range(NUM_LAYERS):
        variant = engine.layer_variant(i, precision)
        for proj in PROJECTIONS:
            module, runtime = modules[projection_key(i, proj)], variant[proj]
            assert torch.equal(runtime.dequantize(), reference.layers[i][proj].dequantize()), (i, proj)
            x = torch.randn(5, module.in_features, generator=gen)
            with torch.no_grad():
                expected = module(x)
            assert _rel(runtime(x), expected) < OUTPUT_RTOL[precision], (i, proj)


# ------------------------------------------------------------------------------ forward and LIS math


def test_dense_forward_matches_transformers(tiny_model) -> None:
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_reference_model(tiny_model)(input_ids=ids).logits
    got = DenseLlama(tiny_model.config, tiny_model.weights).forward(ids)
    assert (got - expected).abs().max().item() < 1e-4


def test_token_cosine_and_lis_on_hand_made_vectors() -> None:
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 4.0]])
    b = torch.tensor([[1.0, 1.0], [0.0, 2.0], [-3.0, -4.0]])
    assert token_cosine(a, b) == pytest.approx((2**-0.5 + 1.0 - 1.0) / 3, abs=1e-12)
    assert LIS_WEIGHTS == (0.25, 0.25, 0.5)
    assert lis_score(1.0, 0.5, 0.2) == pytest.approx(0.25 + 0.125 + 0.1)


def test_gram_cosine_equals_logit_cosine() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 16, generator=gen, dtype=torch.float64)
    a, b = torch.randn(2, 7, 16, generator=gen, dtype=torch.float64), torch.randn(2, 7, 16, generator=gen,
                                                                                  dtype=torch.float64)
    assert gram_token_cosine(a, b, w.t() @ w) == pytest.approx(token_cosine(a @ w.t(), b @ w.t()), abs=1e-12)


def test_greedy_picks_highest_lis_and_recomputes_mds_each_round() -> None:
    lts, lrs = [0.9, 0.5, 0.7], [0.8, 0.9, 0.6]
    mds_table = {  # MDS depends on the quantized set Q, as it does for a real model
        frozenset(): {0: 0.10, 1: 0.90, 2: 0.97},
        frozenset({2}): {0: 0.99, 1: 0.20},
        frozenset({0, 2}): {1: 0.50},
    }
    calls = []

    def mds_fn(q, cands):
        calls.append((q, list(cands)))
        return mds_table[q]

    result = greedy_lis_order(lts, lrs, mds_fn)
    # round 0: LIS = [0.475, 0.80, 0.81] -> 2; round 1 (Q = {2}): [0.92, 0.45] -> 0 although layer 1 led on MDS before
    r0 = result.rounds[0].lis
    assert r0[0] == pytest.approx(0.25 * 0.9 + 0.25 * 0.8 + 0.5 * 0.10)
    assert r0[1] == pytest.approx(0.25 * 0.5 + 0.25 * 0.9 + 0.5 * 0.90)
    assert r0[2] == pytest.approx(0.25 * 0.7 + 0.25 * 0.6 + 0.5 * 0.97)
    assert result.order == [2, 0, 1]
    assert [c[0] for c in calls] == [frozenset(), frozenset({2}), frozenset({0, 2})]
    assert [c[1] for c in calls] == [[0, 1, 2], [0, 1], [1]]
    tie = greedy_lis_order([0.5, 0.5], [0.5, 0.5], lambda q, c: {p: 0.5 for p in c})
    assert tie.order == [0, 1]  # ties go to the lowest index


def test_suffix_mds_equals_brute_force(tiny_model) -> None:
    model = DenseLlama(tiny_model.config, tiny_model.weights)
    quant = [model.quantized_layer(i, {p: quantize_int4_rtn(tiny_model.weights[projection_key(i, p) + ".weight"], 32)
                                       for p in PROJECTIONS}) for i in range(NUM_LAYERS)]
    ids = torch.randint(0, 1000, (1, 20), generator=torch.Generator().manual_seed(5))
    mds = SuffixMds(model, quant, ids)

    def logits(qset):
        return model.forward(ids, [quant[i] if i in qset else model.full_layers[i] for i in range(NUM_LAYERS)])

    for qset in (frozenset(), frozenset({1}), frozenset({0, 2})):
        cands = [p for p in range(NUM_LAYERS) if p not in qset]
        got = mds(qset, cands)
        ref = logits(qset)
        for p in cands:
            assert got[p] == pytest.approx(token_cosine(ref, logits(qset | {p})), abs=1e-6), (qset, p)


# ------------------------------------------------------------------------- idempotency, atomicity


def test_second_build_is_a_noop_and_force_rebuilds(tiny_dir, tmp_path) -> None:
    opts = dict(model=str(tiny_dir), output=str(tmp_path / "e"), hf_export=False, **FAST)
    first = build_engine(BuildOptions(**opts))
    manifest_path = first.path / ed.MANIFEST
    stamp = manifest_path.stat().st_mtime_ns
    again = build_engine(BuildOptions(**opts))
    assert again.skipped and "up to date" in again.messages[0]
    assert manifest_path.stat().st_mtime_ns == stamp
    changed = build_engine(BuildOptions(**{**opts, "seed": 1}))  # different parameters -> rebuilt
    assert not changed.skipped and changed.manifest["build"]["params"]["seed"] == 1
    forced = build_engine(BuildOptions(**{**opts, "seed": 1, "force": True}))
    assert not forced.skipped and (first.path / ed.MANIFEST).stat().st_mtime_ns != stamp
    ed.load_engine_dir(first.path, verify_checksums=True)
    assert not list(tmp_path.glob(".e.*")), "no staging or old directories left behind"


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): ed.sha256_file(p) for p in root.rglob("*") if p.is_file()}


def test_failed_build_leaves_old_engine_dir_intact(tiny_dir, tmp_path, monkeypatch) -> None:
    opts = dict(model=str(tiny_dir), output=str(tmp_path / "e"), hf_export=False, **FAST)
    first = build_engine(BuildOptions(**opts))
    before = _snapshot(first.path)

    def crash(*args, **kwargs):
        raise RuntimeError("simulated failure in the profile step")

    monkeypatch.setattr("builder.importance.profile_layers", crash)
    with pytest.raises(RuntimeError, match="simulated failure"):
        build_engine(BuildOptions(**opts, force=True))
    assert _snapshot(first.path) == before
    assert not list(tmp_path.glob(".e.*"))
    ed.load_engine_dir(first.path, verify_checksums=True)


def test_killed_build_leaves_old_engine_dir_intact(tiny_dir, tmp_path) -> None:
    """SIGKILL in the middle of a build (after the layer files, before the manifest)."""
    out = tmp_path / "e"
    first = build_engine(BuildOptions(model=str(tiny_dir), output=str(out), hf_export=False, **FAST))
    before = _snapshot(first.path)
    script = (
        "import os, signal, builder.importance as imp\n"
        "from builder.build import BuildOptions, build_engine\n"
        "imp.profile_layers = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"build_engine(BuildOptions(model={str(tiny_dir)!r}, output={str(out)!r}, hf_export=False, force=True, "
        "calib_tokens=64, profile_tokens=32, progress=False))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert _snapshot(first.path) == before
    leftovers = list(tmp_path.glob(".e.staging-*"))
    assert len(leftovers) == 1 and not (leftovers[0] / ed.MANIFEST).exists()
    assert list(leftovers[0].glob("layers/*.safetensors")), "the kill happened mid-build"
    with pytest.raises(ed.EngineDirError, match="not found"):
        ed.load_engine_dir(leftovers[0])
    assert ed.clean_stale_builds(out) == leftovers and not leftovers[0].exists()
    ed.load_engine_dir(out, verify_checksums=True)


def test_engine_dir_errors(built, tmp_path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(built.path, root, ignore=shutil.ignore_patterns("hf"))
    manifest = json.loads((root / ed.MANIFEST).read_text())
    manifest["hf"]["full"] = None
    manifest["levels"]["entries"] = {}
    ed.write_json(root / ed.MANIFEST, manifest)
    ed.load_engine_dir(root, verify_checksums=True)
    with pytest.raises(ed.EngineDirError, match="manifest.json not found"):
        ed.load_engine_dir(tmp_path)
    ed.write_json(root / ed.MANIFEST, {**manifest, "format_version": 99})
    with pytest.raises(ed.EngineDirError, match="format_version 99 is not supported"):
        ed.load_engine_dir(root)
    ed.write_json(root / ed.MANIFEST, manifest)
    layer_file = root / manifest["layers"][1]["variants"]["int4"]["file"]
    data = bytearray(layer_file.read_bytes())
    data[-1] ^= 0xFF
    layer_file.write_bytes(bytes(data))
    ed.load_engine_dir(root)  # sizes match: only the checksum can tell
    with pytest.raises(ed.EngineDirError, match="checksum mismatch"):
        ed.load_engine_dir(root, verify_checksums=True)
    layer_file.unlink()
    with pytest.raises(ed.EngineDirError, match="layer_001.int4.safetensors but the file is missing"):
        ed.load_engine_dir(root)
    with pytest.raises(ed.EngineDirError, match="refusing to commit"):
        ed.commit_staging(tmp_path / "empty", root)


# ---------------------------------------------------------------------------------------- CLI


def test_cli_help_and_bad_input(tiny_dir, tmp_path) -> None:
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(256))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    base = ["--calib-tokens", "64", "--profile-tokens", "32", "--quiet", "--no-hf-export"]
    cases = {
        "missing model": (["--model", str(tmp_path / "nope.gguf")], "does not exist"),
        "corrupt model": (["--model", str(corrupt)], "not a readable GGUF"),
        "group size": (["--model", str(tiny_dir), "--group-size", "128"], "group size 128 does not divide"),
        "unknown precision": (["--model", str(tiny_dir), "--precisions", "int8,int3"], "unknown precision int3"),
        "bad level": (["--model", str(tiny_dir), "--levels", "int4@50,fp8@25"], "not a ladder precision"),
        "level percentages": (["--model", str(tiny_dir), "--levels", "int4@50+int8@25"], "must increase"),
        "level not built": (["--model", str(tiny_dir), "--precisions", "int4", "--levels", "int8@50"],
                            "needs the int8 variants"),
        "unwritable output": (["--model", str(tiny_dir), "--output", str(blocker / "engine")], "is not writable"),
    }
    procs = {}
    for name, (args, _) in cases.items():
        output = [] if "--output" in args else ["--output", str(tmp_path / name)]
        procs[name] = subprocess.Popen([sys.executable, "-m", "builder", *args, *output, *base], cwd=REPO_ROOT,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    help_out = subprocess.run([sys.executable, "-m", "builder", "--help"], cwd=REPO_ROOT, capture_output=True,
                              text=True)
    assert help_out.returncode == 0
    for flag in ("--model", "--output", "--precisions", "--group-size", "--calib-text", "--calib-tokens", "--seed",
                 "--force", "--no-hf-export", "--legacy-trtllm", "--levels", "--no-levels", "--kv-block-size",
                 "--quiet"):
        assert flag in help_out.stdout
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        lines = stderr.strip().splitlines()
        assert proc.returncode == 2, (name, stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, (name, stderr)
        assert cases[name][1] in lines[0], (name, lines[0])
        assert not (tmp_path / name).exists(), name


def test_cli_defaults_match_the_builder() -> None:
    import builder.__main__ as cli

    assert cli.PRECISIONS == PRECISIONS
    args = cli.parse_args([])
    opts = BuildOptions()
    assert (args.model, args.precisions, args.calib_tokens, args.profile_tokens, args.group_size, args.hf_export,
            args.legacy_trtllm, args.levels, args.kv_block_size) == (
        opts.model, opts.precisions, opts.calib_tokens, opts.profile_tokens, opts.group_size, opts.hf_export,
        opts.legacy_trtllm, opts.levels, opts.kv_block_size)
    assert opts.hf_export and not opts.legacy_trtllm  # the legacy TensorRT-LLM checkpoints are opt-in
    assert cli.parse_args(["--no-levels"]).levels == () == cli.parse_args(["--levels", "none"]).levels
    assert cli.parse_args(["--levels", "default"]).levels is None
    assert cli.parse_args(["--levels", "int4@50, int8@25,int4@50"]).levels == ("int4@50", "int8@25")
