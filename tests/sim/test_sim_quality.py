"""The planner states each served level's offline agreement from make quality's table (sim/quality_levels.py): a
configuration maps to its precision's row at the smallest tabled percent covering its share of quantized layers,
several precisions to the lowest agreement of theirs, and the plan's JSON and printout carry them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.__main__ import main as plan_main
from sim.quality_levels import QualityTableError, level_of, load_table, plan_quality
from tests.conftest import FIXTURES

TRACE = FIXTURES / "traces" / "azure_conv_burst.csv"
AGREEMENT = {("int8", 0): 1.0, ("int8", 25): 0.99, ("int8", 50): 0.97, ("int8", 75): 0.95, ("int8", 100): 0.93,
             ("int4", 0): 1.0, ("int4", 25): 0.9, ("int4", 50): 0.8, ("int4", 75): 0.7, ("int4", 100): 0.6}


def table(tmp_path: Path) -> Path:
    """A table as builder.evaluate writes it for a 4-layer engine (LIS rows, and 8-bit KV and front-to-back rows
    that do not apply to a plan)."""
    rows = [{"precision": p, "order": "lis", "fraction_pct": f, "num_quantized": f // 25, "kv_cache_dtype": "auto",
             "perplexity": 10 + (100 - 100 * a), "agreement": a} for (p, f), a in AGREEMENT.items()]
    rows += [{**r, "order": "front_to_back", "agreement": 0.1} for r in rows[:5]]
    rows += [{**r, "kv_cache_dtype": "int8", "agreement": 0.2} for r in rows[:5]]
    path = tmp_path / "quality_text.json"
    path.write_text(json.dumps({"engine_dir": "engines/tiny", "text": "held-out.txt", "rows": rows}))
    return path


def test_a_configuration_reads_the_row_covering_its_share(tmp_path: Path) -> None:
    rows = load_table(table(tmp_path))["rows"]
    assert level_of("ffff", rows) == ("full", {"fraction_pct": 0, "agreement": 1.0, "perplexity": 10.0})
    assert level_of("4fff", rows)[0] == "int4@25" and level_of("4fff", rows)[1]["agreement"] == 0.9
    name, row = level_of("4" * 3 + "f" * 7, rows)  # 30 % of layers: the 50 % row covers it, not the 25 % one
    assert (name, row["agreement"]) == ("int4@50", 0.8)
    name, row = level_of("84ff", rows)  # int8 and int4 at 50 %: the lower agreement of the two
    assert (name, row["agreement"]) == ("int4@50", 0.8)
    assert level_of("eeff", rows) == ("fp8@50", None)  # a precision the table lacks is stated as such


def test_the_plan_block_weights_the_agreement_by_tokens(tmp_path: Path) -> None:
    path = table(tmp_path)
    q = plan_quality(load_table(path), path, {"ffff": 100, "4fff": 300, "44ff": 0, "eeff": 100})
    assert [(e["level"], e["tokens"], e["share"], e["agreement"]) for e in q["levels"]] == [
        ("int4@25", 300, 0.6, 0.9), ("full", 100, 0.2, 1.0), ("fp8@50", 100, 0.2, None)]
    assert q["agreement"] == pytest.approx((100 * 1.0 + 300 * 0.9) / 400) and q["unstated_tokens"] == 100
    assert q["engine_dir"] == "engines/tiny"


def test_a_table_without_agreement_is_refused_by_name(tmp_path: Path) -> None:
    old = tmp_path / "quality_old.json"
    old.write_text(json.dumps({"rows": [{"precision": "int4", "order": "lis", "fraction_pct": 25, "perplexity": 9}]}))
    with pytest.raises(QualityTableError, match="perplexity only"):
        load_table(old)


def test_a_plan_states_the_agreement_of_each_level_it_served(tmp_path: Path, capsys) -> None:
    args = ["--system", "a100_sxm", "--model", "llama-2-7b", "--trace", str(TRACE), "--window", "burst:72",
            "--time-scale", "0.5", "--fixed-lengths", "--input-len", "512", "--output-len", "256",
            "--device-memory", "24GiB", "--mode", "default", "--max-requests", "150", "--quality-table",
            str(table(tmp_path)), "--json", str(tmp_path / "plan.json")]
    assert plan_main(args) == 0
    q = json.loads((tmp_path / "plan.json").read_text())["plan"]["quality"]
    served = {e["level"]: e for e in q["levels"]}
    assert "full" in served and any(name.startswith("int4@") for name in served)  # the default mode swapped layers
    for name, e in served.items():
        if name != "full":
            assert e["agreement"] == AGREEMENT[("int4", int(name.split("@")[1]))]
    assert sum(e["tokens"] for e in q["levels"]) > 0 and 0.6 <= q["agreement"] < 1.0
    out = capsys.readouterr().out
    assert "quality per level, offline" in out and "| default | int4@" in out
    assert plan_main([*args[:-4], "--quality-table", str(tmp_path / "missing.json")]) == 2
