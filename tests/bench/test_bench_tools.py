"""Smoke checks of the bench tools that run the engine in-process (docs/bench-tools.md): each tool's own command
line or entry function on the random 3-layer Llama (``tiny_dir``, serve/model/random_model.py with the SmolLM
tokenizer) and a few tokens, asserting what the tool reports, not how fast. Timing numbers are benchmarks' business."""

from __future__ import annotations

import json
import re
from pathlib import Path

from serve.model import kernels


def _rows(markdown: str) -> dict[str, list[str]]:
    """First cell -> the other cells of every markdown table row."""
    out = {}
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[cells[0]] = cells[1:]
    return out


def test_swap_cost_reports_bytes_freed_and_kv_blocks_gained_per_precision(tiny_dir: Path, capsys) -> None:
    from bench import swap_cost

    assert swap_cost.main(["--model", str(tiny_dir), "--layers", "2", "--threads", "1"]) == 0
    rows = _rows(capsys.readouterr().out)
    for precision in ("int8", "int4"):
        layer_mib, freed_mib, blocks, tokens = (float(x) for x in rows[precision][:4])
        assert 0 < layer_mib and freed_mib > 0 and blocks >= 1 and tokens == 16 * blocks
    assert float(rows["int4"][1]) > float(rows["int8"][1])  # int4 frees more than int8


def test_speculation_bench_reports_rates_acceptance_and_equal_outputs(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    from bench import speculation

    out = tmp_path / "s.json"
    assert speculation.main(["--model", str(tiny_dir), "--batches", "1,2", "--new", "4", "--repeats", "1",
                             "--cells", "int8:2", "--threads", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["batches"]["1"]) >= {"off", "auto", "int8:k2", "int8:k2 / off"}
    assert data["cells"]["int8:k2"]["drafted"] > 0 and data["compared"] == 2 * 3  # (1 + 2 prompts) x 2 configs
    assert data["flips"] == 0
    assert "| draft | drafted | accepted | acceptance |" in capsys.readouterr().out


def test_quant_decode_runs_each_mode_on_its_own_engine(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    from bench import quant_decode

    out = tmp_path / "q.json"
    assert quant_decode.main(["--model", str(tiny_dir), "--modes", "off,static-int4", "--batches", "1",
                              "--new-tokens", "3", "--repeats", "1", "--prefill-tokens", "16", "--threads", "1",
                              "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "# off: layer precisions ['full']" in text and "# static-int4: layer precisions ['int4']" in text
    result = json.loads(out.read_text())
    assert [r["metric"] for r in result["rows"]] == ["decode tok/s, batch 1", "prefill tok/s, 16-token prompt"]
    assert all(set(r["median"]) == {"off", "static-int4"} and r["vs_off"]["off"] == 1.0 for r in result["rows"])
    span = r"[0-9.]+ \[[0-9.]+-[0-9.]+\]"  # median [min-max] (workload.repeats.span), one run here
    assert re.search(rf"\| decode tok/s, batch 1 \| {span} \| {span}, [0-9.]+x \|", text)


def test_kernel_breakdown_times_kernels_from_outside_and_ab_alternates(tiny_dir: Path) -> None:
    """The profile hook sees the kernels each step calls (nothing of the runtime replaced); the A/B runs both sides."""
    from bench import kernel_breakdown as kb

    table = kb.breakdown("off", "batch-1", 1, str(tiny_dir))
    rows = _rows(table)
    timed = {name: int(cells[2]) for name, cells in rows.items() if name not in ("function",) and cells[2]}
    assert "rest (small torch ops, Python, scheduler)" in rows and sum(timed.values()) > 0
    if kernels.ops() is not None:  # our kernels: every decode step of 3 layers runs the fused norms
        assert timed["add_rms_norm_"] >= 2 * 3 * 127 and timed["paged_decode_attention"] >= 3 * 127
    ab = kb.ab("off", "batch-1", 1, "trim_last_layer", 2, str(tiny_dir))
    assert re.search(r"trim_last_layer on: [0-9.]+ \[[0-9.]+-[0-9.]+\] tok/s, 2 rounds", ab)
    assert re.search(r"trim_last_layer off: [0-9.]+ \[[0-9.]+-[0-9.]+\] tok/s, 2 rounds", ab)


def test_prefix_reuse_quality_serves_the_full_precision_prefix_after_a_swap(tiny_dir: Path, tmp_path: Path) -> None:
    from bench import prefix_reuse_quality as prq

    out = tmp_path / "p.json"
    assert prq.main(["--model", str(tiny_dir), "--layers", "1", "--prompts", "1", "--prefix-tokens", "16",
                     "--suffix-tokens", "2", "--max-tokens", "2", "--text-tokens", "4", "--threads", "1",
                     "--json", str(out)]) == 0
    k1 = json.loads(out.read_text())["by_layers"]["1"]
    assert k1["hit_tokens_per_prompt"] == 16  # preserve: the one cached block served across the swap
    assert len(k1["int4_layers"]) == 1
    for side in ("full_kv_served_to_int4", "int4_kv_served_to_full"):
        assert k1[side]["perplexity_exact"] > 1 and k1[side]["perplexity_preserve"] > 1
        assert set(k1[side]["agreement"]) >= {"preserve_vs_exact"}


def test_guided_cost_compares_guided_with_unguided_and_both_grammar_engines(tiny_dir: Path, tmp_path: Path) -> None:
    from bench import guided_cost

    out = tmp_path / "g.json"
    assert guided_cost.main(["--model", str(tiny_dir), "--rounds", "1", "--batches", "2", "--max-tokens", "6",
                             "--schemas", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["schemas"] == 2 and [t["batch"] for t in result["throughput"]] == [2]
    assert set(result["throughput"][0]["tok_s"]) == {"guided", "unguided"}
    assert set(result["engines"]) == {"xgrammar", "llguidance", "outputs_rejected_by_either"}
    assert result["xgrammar_compile_ms"]["median"] > 0


def test_engine_throughput_compares_every_row_with_transformers(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    from bench import engine_throughput

    out = tmp_path / "e.json"
    assert engine_throughput.main(["--threads", "1", "--quick", "--model", str(tiny_dir), "--prefill-tokens", "64",
                                   "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["metric"] for r in result["rows"]] == ["decode tok/s, batch 1", "decode tok/s, batch 8",
                                                    "decode tok/s, batch 32", "prefill tok/s, 64-token prompt",
                                                    "32 mixed requests, output tok/s"]
    assert all(r["ours"] > 0 and r["transformers"] > 0 for r in result["rows"])
    assert result["bandwidth"]["weight_bytes_per_token"] > 0 and "| decode tok/s, batch 1 |" in capsys.readouterr().out


def test_quant_kernels_times_every_available_kernel_per_row_count(capsys) -> None:
    from bench import quant_kernels

    assert quant_kernels.main(["--rows", "1", "--repeats", "1", "--threads", "1"]) == 0
    rows = _rows(capsys.readouterr().out)
    names = rows["rows"]
    assert {"fp32", "torch int8", "torch int4"} <= set(names) and len(rows["1"]) == len(names)
    assert ("ours int4 q8" in names) is (kernels.ops() is not None)


def test_isa_kernels_times_every_usable_variant_on_every_row(capsys) -> None:
    """One column per ISA variant this machine executes, a row per kernel and shape, each variant's outputs checked
    equal to the others' before timing (a variant computing something else exits instead of timing it)."""
    from bench import isa_kernels
    from serve.model.kernels import isa

    assert isa_kernels.main(["--repeats", "1", "--calls", "1", "--threads", "1", "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    usable = [n for n in isa.VARIANTS if kernels.variant_ops(n) is not None]
    assert lines[1].split(" | ")[1:1 + len(usable)] == [f"{n} us" for n in usable]
    body = [line for line in lines[3:] if line.startswith("| ")]
    assert len(body) == 3 * 3 + 2 * 2  # three linears at three row counts, two KV formats at two shapes
    assert all(float(cell) > 0 for line in body for cell in line.strip("| ").split(" | ")[1:1 + len(usable)])


def test_llamacpp_flags_follow_the_probe_and_keep_amx_off(capsys) -> None:
    """bench.llamacpp_flags: AVX-512 + VNNI exactly where our AVX-512 variant's probe executed, AMX never, and
    no -march=native (GGML_NATIVE trusts cpuid)."""
    from bench import llamacpp_flags
    from serve.model.kernels import isa

    assert llamacpp_flags.main() == 0
    out = capsys.readouterr()
    flags = out.out.split()
    avx512 = kernels.variant_ops(isa.AVX512.name) is not None
    assert flags == llamacpp_flags.flags(avx512) and "-DGGML_NATIVE=OFF" in flags
    assert ("-DGGML_AVX512=ON" in flags) is avx512 and ("-DGGML_AVX512_VNNI=ON" in flags) is avx512
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert "AMX off" in out.err


def test_replay_serves_a_synthetic_workload_and_writes_the_replay_schema(tiny_dir: Path, tmp_path: Path) -> None:
    from bench import replay

    out = tmp_path / "r.json"
    assert replay.main(["--model", str(tiny_dir), "--mode", "off", "--num-requests", "3", "--input-len", "8",
                        "--output-len", "2", "--request-rate", "50", "--threads", "1", "--quiet", "--json",
                        str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["mode"], r["num_requests"], r["completed"], r["failed"]) == ("off", 3, 3, 0)
    assert r["ttft_s"]["p50"] is not None and r["morph"]["swaps"] == 0
    assert (r["quality_meter"]["samples"], r["quality_meter"]["seconds"]) == (0, 0)  # nothing quantized: no cost
    assert 0 <= r["host_load"]["other_share"] <= 1 and r["host_load"]["known"]  # what else ran beside it


def test_step_costs_in_loop_puts_the_table_beside_in_step_timings(tiny_dir: Path, tmp_path: Path) -> None:
    from bench import step_costs_in_loop

    out = tmp_path / "in_loop.json"
    assert step_costs_in_loop.main(["--model", str(tiny_dir), "--batches", "1,4", "--steps", "4", "--num-threads", "1",
                                    "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert {"full", "int8", "int4", "rest"} <= set(got["table"]) and len(got["served_layer0"]) == 5
    for batch in (1, 4):
        row = got[f"decode_{batch}"]
        assert row["steps"] > 0 and 0 < row["linears_ms"] <= row["forward_ms"] and row["table_layer_ms"] > 0
