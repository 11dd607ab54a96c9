"""NVIDIA's measured TensorRT-LLM kernel timings (aiconfigurator-core's parquet tables), looked up with stated
interpolation.

The package ships per GPU ``systems/<system>.yaml`` (memory, bandwidths) and
``systems/data/<system>/{gemm,attention}/trtllm/<version>/*.parquet``. We read the tables with pyarrow and do
not import the package's SDK: its numpy>=2 pin conflicts with nvidia-pytriton's numpy<2, and we need per-layer,
per-precision GEMM and attention times, not its whole-step estimates.

Interpolation (every lookup returns the table's own value at a measured point):

* GEMM ``(m, n, k)``: piecewise linear in ``m`` between measured ``m`` (below the first: the first value;
  beyond the last: along the last segment), then bilinear in ``(n, k)`` between the bracketing measured
  ``n`` and ``k``; beyond the largest ``n`` or ``k`` the time scales in proportion (a GEMM that wide is
  bandwidth or compute bound, both linear in ``n`` and ``k``).
* Generation attention ``(batch, kv_len)``: bilinear in batch size and KV length (``step + 1``) the same way, over
  bf16 or fp8 KV (``kv_cache_dtype``).
* Context attention ``(batch, isl)``: bilinear in batch size and prompt length.
"""

from __future__ import annotations

import bisect
import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from policy import FULL
from serve.model.quantized_linear.registry import REGISTRY

GEMM_DTYPE = {FULL: "bfloat16", **{p: f.trtllm.gemm_dtype for p, f in REGISTRY.items()}}
"""Our layer precisions -> the GEMM table's dtypes (the format registry's: int8 / int4 AWQ weight-only, fp8)."""
KV_TABLE_DTYPE = {"auto": "bfloat16", "fp8": "fp8"}
"""Our ``kv_cache_dtype`` -> the attention tables' ``kv_cache_dtype`` (they have no int8-KV rows)."""


class TableError(ValueError):
    """A system, precision or shape the tables do not cover (never invented)."""


def package_root() -> Path:
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or spec.origin is None:
        raise TableError("aiconfigurator-core is not installed (make install puts 0.12.0 into .venv)")
    return Path(spec.origin).parent / "systems"


def list_systems() -> list[str]:
    """Systems with TensorRT-LLM GEMM and attention tables."""
    data = package_root() / "data"
    return sorted(p.name for p in data.iterdir()
                  if (p / "gemm" / "trtllm").is_dir() and (p / "attention" / "trtllm").is_dir())


@dataclass(frozen=True)
class SystemSpec:
    name: str
    device: str            # the GPU the tables were measured on
    version: str           # TensorRT-LLM version of the tables
    mem_capacity: int      # bytes
    mem_bw: float          # bytes/s (device memory)
    pcie_bw: float         # bytes/s host -> device, one direction
    sm_version: int


def _latest(folder: Path) -> Path:
    versions = sorted((p for p in folder.iterdir() if p.is_dir()),
                      key=lambda p: [int(x) if x.isdigit() else x for x in p.name.replace("rc", ".").split(".")])
    if not versions:
        raise TableError(f"no table versions under {folder}")
    return versions[-1]


def _column_dicts(path: Path, columns: Sequence[str]) -> dict[str, list]:
    import pyarrow.parquet as pq  # noqa: PLC0415 - only the planner needs it

    table = pq.read_table(path, columns=list(columns))
    return {c: table.column(c).to_pylist() for c in columns}


def _bracket(grid: Sequence[float], x: float) -> tuple[int, int, float]:
    """Indices (i, j) around x in the sorted grid and the weight of j; beyond the ends j == i or the last segment."""
    if len(grid) == 1 or x <= grid[0]:
        return 0, 0, 0.0
    j = bisect.bisect_left(grid, x)
    if j < len(grid) and grid[j] == x:
        return j, j, 0.0
    if j >= len(grid):
        i, j = len(grid) - 2, len(grid) - 1  # extrapolate along the last segment
    else:
        i = j - 1
    return i, j, (x - grid[i]) / (grid[j] - grid[i])


def _interp1(grid: Sequence[float], values: Sequence[float], x: float) -> float:
    i, j, w = _bracket(grid, x)
    return values[i] + (values[j] - values[i]) * w


class _Grid1:
    """A measured curve y(x), sorted."""

    def __init__(self, points: dict[float, float]) -> None:
        self.x = sorted(points)
        self.y = [points[k] for k in self.x]

    def __call__(self, x: float) -> float:
        return max(_interp1(self.x, self.y, x), 1e-9)


class KernelTables:
    """One system's GEMM and attention tables (times in seconds)."""

    def __init__(self, system: str) -> None:
        root = package_root()
        yaml_path = root / f"{system}.yaml"
        data = root / "data" / system
        if not yaml_path.is_file() or not (data / "gemm" / "trtllm").is_dir():
            raise TableError(f"no TensorRT-LLM tables for system {system!r}; systems with them: "
                             f"{', '.join(list_systems())}")
        spec = yaml.safe_load(yaml_path.read_text())
        gemm_dir = _latest(data / "gemm" / "trtllm")
        attn_dir = _latest(data / "attention" / "trtllm")
        g = _column_dicts(gemm_dir / "gemm_perf.parquet", ["gemm_dtype", "m", "n", "k", "latency", "device"])
        self._gemm: dict[tuple[str, int, int], dict[float, float]] = {}
        for d, m, n, k, lat in zip(g["gemm_dtype"], g["m"], g["n"], g["k"], g["latency"]):
            self._gemm.setdefault((d, n, k), {})[float(m)] = lat / 1e3
        self.gemm_dtypes = sorted({d for d, _, _ in self._gemm})
        self._n = {d: sorted({n for dd, n, _ in self._gemm if dd == d}) for d in self.gemm_dtypes}
        self._k = {d: sorted({k for dd, _, k in self._gemm if dd == d}) for d in self.gemm_dtypes}
        self._attn_dir = attn_dir
        self.spec = SystemSpec(name=system, device=g["device"][0], version=gemm_dir.name,
                               mem_capacity=int(spec["gpu"]["mem_capacity"]), mem_bw=float(spec["gpu"]["mem_bw"]),
                               pcie_bw=float(spec["node"]["pcie_bw"]), sm_version=int(spec["gpu"].get("sm_version", 0)))
        self._curves: dict[tuple[str, int, int], _Grid1] = {}

    # ---- GEMM ------------------------------------------------------------------------------------
    def gemm_dtype(self, precision: str) -> str:
        d = GEMM_DTYPE.get(precision)
        if d is None or d not in self.gemm_dtypes:
            usable = [p for p, dt in GEMM_DTYPE.items() if p != FULL and dt in self.gemm_dtypes]
            raise TableError(f"{self.spec.name}'s TensorRT-LLM {self.spec.version} GEMM table has no {d or precision} "
                             f"kernel for precision {precision!r} (it has {', '.join(self.gemm_dtypes)}); choose a "
                             f"ladder of the precisions it measured ({', '.join(usable)}), e.g. "
                             f"--mode default+ladder='[\"{usable[0] if usable else 'int4'}\"]'")
        return d

    def _curve(self, dtype: str, n: int, k: int) -> _Grid1:
        key = (dtype, n, k)
        if key not in self._curves:
            points = self._gemm.get(key)
            if points is None:
                raise TableError(f"{self.spec.name}: no {dtype} GEMM measured at n={n}, k={k}")
            self._curves[key] = _Grid1(points)
        return self._curves[key]

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one tables object per plan, kept for its length
    def gemm_s(self, precision: str, m: int, n: int, k: int) -> float:
        """Seconds of one ``[m, k] x [k, n]`` GEMM at ``precision``'s kernel."""
        dtype = self.gemm_dtype(precision)
        ns, ks = self._n[dtype], self._k[dtype]
        scale = (n / ns[-1] if n > ns[-1] else 1.0) * (k / ks[-1] if k > ks[-1] else 1.0)
        ni, nj, nw = _bracket(ns, min(n, ns[-1]))
        ki, kj, kw = _bracket(ks, min(k, ks[-1]))

        def at(a: int, b: int) -> float:
            return self._curve(dtype, ns[a], ks[b])(m)

        low = at(ni, ki) + (at(ni, kj) - at(ni, ki)) * kw
        high = at(nj, ki) + (at(nj, kj) - at(nj, ki)) * kw
        return max(low + (high - low) * nw, 1e-9) * scale

    # ---- attention -------------------------------------------------------------------------------
    @functools.cached_property
    def _generation(self) -> dict[tuple[str, int, int, int], dict[int, dict[float, float]]]:
        return self._attention("generation", "step", lambda s: s + 1)

    @functools.cached_property
    def _context(self) -> dict[tuple[str, int, int, int], dict[int, dict[float, float]]]:
        return self._attention("context", "isl", lambda s: s)

    def _attention(self, kind: str, length_col: str, length) -> dict:
        """bf16 attention over bf16 or fp8 KV (the tables' ``kv_cache_dtype`` column), no window."""
        cols = ["batch_size", length_col, "num_heads", "num_key_value_heads", "head_dim", "window_size",
                "attn_dtype", "kv_cache_dtype", "latency"]
        a = _column_dicts(self._attn_dir / f"{kind}_attention_perf.parquet", cols)
        out: dict[tuple[str, int, int, int], dict[int, dict[float, float]]] = {}
        for b, s, h, kvh, hd, win, ad, kd, lat in zip(*(a[c] for c in cols)):
            if win == 0 and ad == "bfloat16" and kd in ("bfloat16", "fp8"):
                out.setdefault((kd, h, kvh, hd), {}).setdefault(b, {})[float(length(s))] = lat / 1e3
        return out

    def _heads(self, table: dict, kind: str, heads: tuple[int, int, int],
               kv_cache_dtype: str = "auto") -> dict[int, dict[float, float]]:
        kd = KV_TABLE_DTYPE.get(kv_cache_dtype)
        if kd is None or (kd, *heads) not in table:
            raise TableError(f"{self.spec.name}: no {kind} attention measured for num_heads={heads[0]}, "
                             f"num_key_value_heads={heads[1]}, head_dim={heads[2]} ({kv_cache_dtype} KV, no window; "
                             f"the tables have bf16 and fp8 KV)")
        return table[(kd, *heads)]

    def _bilinear(self, per_batch: dict[int, dict[float, float]], batch: float, length: float) -> float:
        batches = sorted(per_batch)
        i, j, w = _bracket(batches, batch)

        def at(b: int) -> float:
            return _Grid1(per_batch[b])(length)

        return max(at(batches[i]) + (at(batches[j]) - at(batches[i])) * w, 1e-9)

    def generation_attention_s(self, heads: tuple[int, int, int], batch: int, kv_len: float,
                               kv_cache_dtype: str = "auto") -> float:
        """One layer's decode attention for ``batch`` sequences of ``kv_len`` cached tokens each (``kv_cache_dtype``
        auto: bf16 KV; fp8: the tables' fp8-KV rows)."""
        return self._bilinear(self._heads(self._generation, "generation", heads, kv_cache_dtype), batch, kv_len)

    def context_attention_s(self, heads: tuple[int, int, int], batch: int, isl: float,
                            kv_cache_dtype: str = "auto") -> float:
        """One layer's prefill attention for ``batch`` prompts of ``isl`` tokens each."""
        return self._bilinear(self._heads(self._context, "context", heads, kv_cache_dtype), batch, isl)
