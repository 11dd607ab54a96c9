"""The planner with the KV-precision rung (``kv_rung=fp8``): the server's rung on a simulated mixed cache, its 8-bit
blocks' bytes from kv_format, and attention time over the 8-bit share of the KV from the tables' fp8-KV rows
(sim/assemble.py, sim/bank.py ``SimKV``, sim/step_model.py)."""

from __future__ import annotations

import pytest

from serve.config import EngineConfig
from serve.engine.kv_rung import KVPrecisionRung
from serve.engine.sampling_params import SamplingParams
from serve.model.kv_cache import kv_bytes_per_block
from sim.assemble import build_engine
from sim.clock import VirtualClock
from sim.kernel_tables import TableError
from sim.model_specs import load_model_config
from sim.step_model import BatchShape
from sim.target import table_target
from tests.morph_support import morph

LADDER = {"ladder": ["fp8"], "cost_aware": False, "queue_delay_high_s": 1e9,
          "ttft_slack_low_s": None, "ttft_slo_s": 1e9}
"""fp8 layers (the H200 tables' only quantized GEMM); swaps driven by KV pressure alone."""


@pytest.fixture(scope="module")
def h200():
    return table_target("h200_sxm", "codellama-34b", 16, 0.001)


def _engine(target, **policy):
    config = EngineConfig(morph_mode="default", device_memory="0.9", max_num_seqs=256, max_num_batched_tokens=8192,
                          policy_overrides={**LADDER, **policy})
    return build_engine(config, target, VirtualClock())


def test_the_rungs_8bit_blocks_are_the_engines_fp8_layout_and_attention_mixes_the_rows(h200):
    e = _engine(h200, kv_rung="fp8")
    rung = e.resource_manager(KVPrecisionRung)
    cfg = load_model_config("codellama-34b")
    assert [m.name for m in e.resources] == ["kv_precision", "morph"]
    assert rung.block_8bit_bytes == kv_bytes_per_block(cfg, 16, e.dtype, "fp8")
    assert rung.slot_bytes == kv_bytes_per_block(cfg, 16, e.dtype) == e.ledger.slot_bytes
    model = e.executor.step_model
    full, half, all8 = (model.attention_s(BatchShape(decode_kv_lens=[2048] * 32, decode_kv8=s)) for s in (0, 0.5, 1))
    tables = model.tables
    assert full == pytest.approx(tables.generation_attention_s((64, 8, 128), 32, 2048), rel=1e-12)
    assert all8 == pytest.approx(tables.generation_attention_s((64, 8, 128), 32, 2048, "fp8"), rel=1e-12)
    assert half == pytest.approx((full + all8) / 2, rel=1e-12) and all8 < full
    with pytest.raises(TableError, match="no int8-KV rows"):
        _engine(h200, kv_rung="int8")


def _burst(e, n: int = 100) -> dict:
    """Two waves of ``n`` 2048-token prompts (512 tokens out): the first fits in bf16 KV at 0.9 of an H200 and is
    prefilled into full-precision blocks, the second arrives when it is running and needs more KV than is left.
    Returns the swaps, the rung's conversions when the first swap happened, and the rung's totals."""
    rung, m = e.resource_manager(KVPrecisionRung), morph(e)
    at_first_swap = None
    for wave in range(2):
        for i in range(n * wave, n * (wave + 1)):
            e.add_request([(31 * i + j) % 30000 + 100 for j in range(2048)],
                          SamplingParams(max_tokens=512, ignore_eos=True))
        while e.has_unfinished_requests() and (wave == 1 or e.scheduler.waiting):
            e.step()
            if at_first_swap is None and (m.stats.swaps or m.pending):
                at_first_swap = rung.conversions_total if rung else 0
    return {"swaps": m.stats.swaps, "at_first_swap": at_first_swap, "preemptions": e.scheduler.num_preemptions,
            "converted": rung.conversions_total if rung else 0, "rewritten": rung.blocks_rewritten_total if rung else 0}


def test_where_bf16_runs_out_of_kv_the_rung_converts_before_any_swap_and_fewer_layers_are_swapped(h200):
    """The second wave finds the base pool mostly held by the first at full precision: the rung converts the free
    slots and then running blocks before any layer is swapped, and the plan swaps fewer layers than without it."""
    without, with_rung = _burst(_engine(h200)), _burst(_engine(h200, kv_rung="fp8"))
    assert without["swaps"] > 0, without
    assert with_rung["converted"] > 0 and with_rung["rewritten"] > 0, with_rung
    assert (with_rung["at_first_swap"] or 1) > 0, with_rung  # no swap, or the rung had converted before it
    assert with_rung["swaps"] < without["swaps"], (without, with_rung)
