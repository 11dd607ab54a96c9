"""The planner with ``--kv-cache-dtype fp8``: the attention tables' fp8-KV rows, the engine's 8-bit block bytes, and
the KV capacity that follows (sim/kernel_tables.py, sim/assemble.py)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from serve.config import EngineConfig
from serve.model.kv_cache import kv_bytes_per_block
from sim.assemble import build_engine
from sim.clock import VirtualClock
from sim.kernel_tables import KernelTables, TableError, package_root
from sim.model_specs import load_model_config
from sim.step_model import BatchShape
from sim.target import table_target

FP8_LADDER = {"ladder": ["fp8"], "cost_aware": False}


def test_fp8_kv_rows_are_the_tables_and_differ_from_bf16():
    h200 = KernelTables("h200_sxm")
    heads = (64, 8, 128)  # CodeLlama-34B
    path = next((package_root() / "data" / "h200_sxm" / "attention"
                 / "trtllm").glob("*/generation_attention_perf.parquet"))
    rows = {r["kv_cache_dtype"]: r["latency"] / 1e3 for r in pq.read_table(path).to_pylist()
            if (r["batch_size"], r["step"], r["num_heads"], r["num_key_value_heads"], r["head_dim"], r["window_size"],
                r["attn_dtype"]) == (32, 2047, *heads, 0, "bfloat16")}
    assert set(rows) == {"bfloat16", "fp8"}
    assert h200.generation_attention_s(heads, 32, 2048, "fp8") == pytest.approx(rows["fp8"], rel=1e-12)
    assert h200.generation_attention_s(heads, 32, 2048) == pytest.approx(rows["bfloat16"], rel=1e-12)
    assert rows["fp8"] < rows["bfloat16"]  # reading half the bytes at 2k context
    with pytest.raises(TableError, match="int8 KV"):
        h200.generation_attention_s(heads, 32, 2048, "int8")


def test_a_plan_with_fp8_kv_has_the_engines_8bit_blocks_and_reads_the_fp8_rows():
    target = table_target("h200_sxm", "codellama-34b", 16, 0.0)
    cfg = load_model_config("codellama-34b")
    plans = {kv: build_engine(EngineConfig(morph_mode="default", device_memory="0.9", kv_cache_dtype=kv,
                                           policy_overrides=FP8_LADDER), target, VirtualClock())
             for kv in ("auto", "fp8")}
    assert plans["fp8"].ledger.slot_bytes == kv_bytes_per_block(cfg, 16, plans["fp8"].dtype, "fp8")
    assert plans["auto"].ledger.slot_bytes == kv_bytes_per_block(cfg, 16, plans["auto"].dtype)
    ratio = plans["fp8"].pool.base_blocks / plans["auto"].pool.base_blocks
    assert 1.85 < ratio < 1.95  # bf16 -> fp8 codes + fp32 scales per token-head: 1.88x per block
    assert plans["fp8"].pool.cache_root != plans["auto"].pool.cache_root
    batch = BatchShape(decode_kv_lens=[2048] * 32, sampled=32)
    steps = {kv: e.executor.step_model.step_s(batch, ["full"] * cfg.num_layers) for kv, e in plans.items()}
    assert steps["fp8"] < steps["auto"]
    with pytest.raises(TableError, match="no int8-KV rows"):
        build_engine(EngineConfig(morph_mode="default", device_memory="0.9", kv_cache_dtype="int8",
                                  policy_overrides=FP8_LADDER), target, VirtualClock())
