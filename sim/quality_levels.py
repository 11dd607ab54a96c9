"""The offline quality table as a plan states it: per level the plan served, the table's top-1 agreement with full
precision (and perplexity), and each mode's agreement weighted by the tokens served at each level.

The table is ``make quality``'s (``builder/evaluate.py``: ``<engine-dir>/quality_<text stem>.json``): rows of a
precision, a swap order, a percent of layers quantized, a KV format, their perplexity and agreement on held-out text.
A level is a precision at a percent of layers in the swap order (``int4@25``, the builder's names); the morph
runtime quantizes in the swap order, so the table's ``lis`` rows at full-precision KV are the ones that apply. A
configuration the plan served maps to the row of its precision at the smallest tabled percent that covers its
share of quantized layers (more layers quantized reads lower, so the stated agreement does not flatter it); with
layers at several precisions, the lowest agreement of theirs. The table measures the engine directory it was built
for: for another model the levels are matched by share of layers, and the plan names the table's engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy.precisions import CODE_PRECISION, FULL

SWAP_ORDER = "lis"


class QualityTableError(ValueError):
    """The table cannot be read or holds no agreement."""


def load_table(path: Path) -> dict[str, Any]:
    """``builder.evaluate``'s JSON; QualityTableError names what is missing (a table written before it held
    agreement: run ``make quality`` again)."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise QualityTableError(f"quality table {path}: {exc}") from None
    rows = table.get("rows") if isinstance(table, dict) else None
    if not isinstance(rows, list) or not rows:
        raise QualityTableError(f"quality table {path} has no rows (write it with make quality)")
    if not any(isinstance(r, dict) and "agreement" in r for r in rows):
        raise QualityTableError(f"quality table {path} holds perplexity only, no agreement: run make quality again")
    return table


def find_table(model: str | None) -> Path | None:
    """The table ``make quality`` wrote into the engine directory ``model``, when there is exactly one."""
    if not model or not Path(model).is_dir():
        return None
    found = sorted(Path(model).glob("quality_*.json"))
    return found[0] if len(found) == 1 else None


def _row(rows: list[dict], precision: str, share_pct: float) -> dict | None:
    candidates = [r for r in rows if r.get("precision") == precision and r.get("order", SWAP_ORDER) == SWAP_ORDER
                  and r.get("kv_cache_dtype", "auto") == "auto" and r.get("agreement") is not None
                  and r["fraction_pct"] >= share_pct - 1e-9]
    return min(candidates, key=lambda r: r["fraction_pct"], default=None)


def level_of(signature: str, rows: list[dict]) -> tuple[str, dict | None]:
    """A configuration signature -> (its level's name, the table row stated for it; None when the table has none)."""
    quantized = [CODE_PRECISION[c] for c in signature if CODE_PRECISION[c] != FULL]
    if not quantized:
        return FULL, {"fraction_pct": 0, "agreement": 1.0, "perplexity": _full_perplexity(rows)}
    share = 100 * len(quantized) / len(signature)
    matched = [(p, _row(rows, p, share)) for p in sorted(set(quantized))]
    if any(row is None for _, row in matched):
        precision = next(p for p, row in matched if row is None)
        return f"{precision}@{share:.0f}", None
    precision, row = min(matched, key=lambda pr: pr[1]["agreement"])  # type: ignore[index]
    return f"{precision}@{row['fraction_pct']:g}", row


def _full_perplexity(rows: list[dict]) -> float | None:
    return next((r["perplexity"] for r in rows
                 if r.get("num_quantized") == 0 and r.get("kv_cache_dtype", "auto") == "auto"), None)


def plan_quality(table: Mapping[str, Any], path: Path, tokens_by_config: Mapping[str, int]) -> dict[str, Any]:
    """The plan's ``quality`` block: per level served, its tokens, their share, the offline agreement and perplexity;
    the agreement weighted by tokens (over the tokens of levels the table states)."""
    rows = list(table["rows"])
    levels: dict[str, dict[str, Any]] = {}
    for signature, tokens in tokens_by_config.items():
        if tokens <= 0:
            continue
        name, row = level_of(signature, rows)
        entry = levels.setdefault(name, {"level": name, "tokens": 0,
                                         "agreement": None if row is None else row["agreement"],
                                         "perplexity": None if row is None else row.get("perplexity")})
        entry["tokens"] += tokens
    total = sum(e["tokens"] for e in levels.values())
    for e in levels.values():
        e["share"] = round(e["tokens"] / total, 4) if total else 0.0
    stated = [e for e in levels.values() if e["agreement"] is not None]
    weight = sum(e["tokens"] for e in stated)
    return {"table": str(path), "engine_dir": table.get("engine_dir"), "text": table.get("text"),
            "levels": sorted(levels.values(), key=lambda e: -e["tokens"]),
            "agreement": round(sum(e["agreement"] * e["tokens"] for e in stated) / weight, 4) if weight else None,
            "unstated_tokens": total - weight}


def quality_table(results: Mapping[str, dict]) -> str:
    """Per mode and level: the share of its tokens and the offline agreement (the last run of each mode)."""
    lines = ["| mode | level | share of tokens | offline agreement | offline perplexity | mode's agreement |",
             "|---|---|---:|---:|---:|---:|"]
    for spec, r in results.items():
        q = r.get("plan", {}).get("quality")
        if not q:
            continue
        for e in q["levels"]:
            agreement = "not in the table" if e["agreement"] is None else f"{e['agreement']:.3f}"
            ppl = "" if e["perplexity"] is None else f"{e['perplexity']:.2f}"
            mode = "" if q["agreement"] is None else f"{q['agreement']:.3f}"
            lines.append(f"| {spec} | {e['level']} | {e['share']:.1%} | {agreement} | {ppl} | {mode} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""
