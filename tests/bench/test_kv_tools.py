"""Smoke tests of the 8-bit KV tools on the tiny model: what they report, never how fast."""

from __future__ import annotations

import json
from pathlib import Path


def test_kv_decode_reports_both_formats_per_batch_with_provenance(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    from bench import kv_decode

    out = tmp_path / "kv.json"
    assert kv_decode.main(["--model", str(tiny_dir), "--context", "40", "--batch", "1,2", "--tokens", "3",
                           "--repeats", "2", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"1", "2"} and all(len(v) == 2 for per in result["runs"].values()
                                                        for v in per.values())
    assert set(result["median"]["2"]) == {"auto", "int8"} and all(x > 0 for x in result["median"]["1"].values())
    assert result["command"].startswith("python -m bench.kv_decode") and result["cpu"]
    assert "int8 / auto" in capsys.readouterr().out


def test_kv_precision_reports_perplexity_agreement_and_capacity(tiny_dir: Path, tmp_path: Path) -> None:
    from bench import kv_precision

    out = tmp_path / "q.json"
    assert kv_precision.main(["--model", str(tiny_dir), "--device-memory", "64MiB", "--num-tokens", "96",
                              "--window", "48", "--probe-tokens", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["perplexity"]) == {"auto", "int8"}
    assert all(p > 1 for per in result["perplexity"].values() for p in per.values())
    # int8 blocks hold more tokens in the same budget: the whole point of the format
    assert result["capacity"]["int8"]["kv_tokens"] > result["capacity"]["auto"]["kv_tokens"]
    assert result["capacity"]["ratio"] > 1 and result["agreement"]
