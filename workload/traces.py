"""Workload traces: readers for public LLM-serving traces, transforms, and synthetic arrivals.

Every reader returns ``TraceRequest`` objects sorted by arrival, with arrivals in seconds relative to
the trace's first (earliest) request, so that ``arrival_s == 0`` is always the first request whatever
the source's clock (wall-clock dates for Azure, milliseconds for Mooncake, seconds for BurstGPT).

Supported formats (``fmt``):

- ``"azure"``: Azure LLM inference trace 2023 (Splitwise), CSV with ``TIMESTAMP`` (e.g.
  ``2023-11-16 18:15:46.6805900``, 7-digit fractional seconds), ``ContextTokens``, ``GeneratedTokens``.
- ``"mooncake"``: Mooncake JSONL, one object per line with ``timestamp`` (ms), ``input_length``,
  ``output_length``; other keys (``hash_ids``...) are ignored.
- ``"burstgpt"``: BurstGPT CSV with ``Timestamp`` (s), ``Model``, ``Request tokens``,
  ``Response tokens``, ``Total tokens``, ``Log Type``; rows with ``Response tokens == 0`` are failed
  requests in BurstGPT and are skipped.
"""

from __future__ import annotations

import bisect
import csv
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np

FORMATS = ("azure", "mooncake", "burstgpt")

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")

LengthSpec = int | tuple[int, int]


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload: when it arrives and how many tokens go in and come out."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    # Mooncake's hash_ids: ids of the request's prompt blocks (512 tokens each in the trace); equal ids in two
    # requests mean a shared prefix block. Empty for traces without them.
    block_ids: tuple[int, ...] = ()


# --------------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------------

def load_trace(path: str | Path, fmt: str = "auto") -> list[TraceRequest]:
    """Read a trace file; ``fmt`` is one of ``"auto"``, ``"azure"``, ``"mooncake"``, ``"burstgpt"``.

    ``"auto"`` picks Mooncake for ``.jsonl``/``.json`` files and otherwise looks at the CSV header.
    Raises ValueError for an unknown format, missing columns, an empty file, unparsable values or
    negative token counts (messages name the file and line).
    """
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    readers = {"azure": _read_azure, "mooncake": _read_mooncake, "burstgpt": _read_burstgpt}
    if fmt not in readers:
        raise ValueError(f"unknown trace format {fmt!r}; expected 'auto' or one of {FORMATS}")
    raw = readers[fmt](path)
    if not raw:
        raise ValueError(f"{path}: trace has no requests")
    return _rebase_and_sort(raw)


def detect_format(path: str | Path) -> str:
    """Guess a trace's format from its extension and, for CSV, its header row."""
    path = Path(path)
    if path.suffix.lower() in (".jsonl", ".json"):
        return "mooncake"
    header = _csv_header(path)
    if set(AZURE_COLUMNS) <= set(header):
        return "azure"
    if set(BURSTGPT_COLUMNS) <= set(header):
        return "burstgpt"
    raise ValueError(
        f"{path}: cannot detect trace format from header {header}; expected Azure columns "
        f"{list(AZURE_COLUMNS)} or BurstGPT columns {list(BURSTGPT_COLUMNS)}, or a .jsonl Mooncake "
        "file; pass fmt= explicitly"
    )


def _csv_header(path: Path) -> list[str]:
    with path.open(newline="", encoding="utf-8-sig") as f:
        for row in csv.reader(f):
            if any(cell.strip() for cell in row):
                return [cell.strip() for cell in row]
    raise ValueError(f"{path}: empty file")


def _csv_rows(path: Path, required: Sequence[str]) -> Iterable[tuple[int, dict[str, str]]]:
    """Yield (line number, row) for each non-blank data row, after checking the header."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            raise ValueError(f"{path}: empty file")
        fields = [name.strip() for name in reader.fieldnames]
        missing = [c for c in required if c not in fields]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; found {fields}")
        reader.fieldnames = fields
        for row in reader:
            if all((v or "").strip() == "" for v in row.values() if isinstance(v, str)):
                continue
            yield reader.line_num, row


def _read_azure(path: Path) -> list[tuple[float, int, int]]:
    parsed: list[tuple[int, float, int, int]] = []
    for line, row in _csv_rows(path, AZURE_COLUMNS):
        where = f"{path}:{line}"
        whole, frac = _parse_timestamp(row["TIMESTAMP"], where)
        parsed.append((whole, frac, _parse_count(row["ContextTokens"], "ContextTokens", where),
                       _parse_count(row["GeneratedTokens"], "GeneratedTokens", where)))
    if not parsed:
        return []
    # Subtract whole epoch seconds as integers before going to float: epoch seconds (~1.7e9) as a
    # float would only keep ~0.2 us, eating the trace's 100 ns resolution.
    base = min(whole for whole, _, _, _ in parsed)
    return [(float(whole - base) + frac, i, o) for whole, frac, i, o in parsed]


def _read_burstgpt(path: Path) -> list[tuple[float, int, int]]:
    rows: list[tuple[float, int, int]] = []
    for line, row in _csv_rows(path, BURSTGPT_COLUMNS):
        where = f"{path}:{line}"
        t = _parse_float(row["Timestamp"], "Timestamp", where)
        inp = _parse_count(row["Request tokens"], "Request tokens", where)
        out = _parse_count(row["Response tokens"], "Response tokens", where)
        if out == 0:  # BurstGPT logs failed requests with a zero-length response
            continue
        rows.append((t, inp, out))
    return rows


def _read_mooncake(path: Path) -> list[tuple[float, int, int, tuple[int, ...]]]:
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            missing = [k for k in MOONCAKE_KEYS if k not in obj]
            if missing:
                raise ValueError(f"{where}: missing keys {missing}; found {sorted(obj)}")
            t_ms = _parse_float(obj["timestamp"], "timestamp", where)
            ids = obj.get("hash_ids") or []
            if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
                raise ValueError(f"{where}: hash_ids must be a list of integers")
            rows.append((t_ms / 1000.0, _parse_count(obj["input_length"], "input_length", where),
                         _parse_count(obj["output_length"], "output_length", where), tuple(ids)))
    return rows


def _rebase_and_sort(raw: Sequence[tuple]) -> list[TraceRequest]:
    # Stable sort keeps file order among equal timestamps (Mooncake has many).
    raw = sorted(raw, key=lambda r: r[0])
    t0 = raw[0][0]
    return [TraceRequest(t - t0, i, o, *rest) for t, i, o, *rest in raw]


_TS_RE = re.compile(
    r"^\s*(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?\s*$"
)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _parse_timestamp(text: str, where: str) -> tuple[int, float]:
    """(whole seconds since the epoch, fraction of a second) for an Azure-style timestamp.

    Parsed by hand because the trace has 7 fractional digits (100 ns), more than ``datetime``
    keeps; the two parts stay separate so the caller can subtract whole seconds exactly.
    Timestamps without an offset are taken as UTC.
    """
    m = _TS_RE.match(text or "")
    if m is None:
        raise ValueError(f"{where}: cannot parse timestamp {text!r} (expected 'YYYY-MM-DD HH:MM:SS.fff')")
    year, month, day, hour, minute, sec = (int(g) for g in m.groups()[:6])
    frac = float("0." + m.group(7)) if m.group(7) else 0.0
    tz = _parse_offset(m.group(8))
    try:
        dt = datetime(year, month, day, hour, minute, sec, tzinfo=tz)
    except ValueError as e:
        raise ValueError(f"{where}: invalid timestamp {text!r} ({e})") from None
    return (dt - _EPOCH) // timedelta(seconds=1), frac


def _parse_offset(text: str | None) -> timezone:
    if text is None or text == "Z":
        return timezone.utc
    sign = -1 if text[0] == "-" else 1
    digits = text[1:].replace(":", "")
    return timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))


def _parse_float(value: object, name: str, where: str) -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name} is not a number: {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{where}: {name} is not finite: {value!r}")
    return x


def _parse_count(value: object, name: str, where: str) -> int:
    x = _parse_float(value, name, where)
    if x != int(x):
        raise ValueError(f"{where}: {name} is not an integer: {value!r}")
    if x < 0:
        raise ValueError(f"{where}: {name} is negative: {value!r}")
    return int(x)


# --------------------------------------------------------------------------------------------------
# Transforms
# --------------------------------------------------------------------------------------------------

def transform(
    requests: Sequence[TraceRequest],
    window: tuple[float, float] | None = None,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    min_tokens: int = 1,
) -> list[TraceRequest]:
    """Cut, stretch and resize a trace (returns a new list sorted by arrival).

    - ``window=(start_s, end_s)`` keeps requests with ``start_s <= arrival_s < end_s`` and re-bases
      arrivals so that the window start is time 0 (``arrival_s - start_s``; the first kept request
      may therefore arrive a little after 0, exactly as it did inside the window).
    - ``time_scale`` multiplies every arrival offset, hence every inter-arrival time:
      ``time_scale=2`` replays the trace **twice as slowly** (half the request rate);
      ``time_scale=0.5`` twice as fast. The MorphServe paper's "rate downscaled 4.75x" is
      ``time_scale=4.75``.
    - ``length_scale`` multiplies input and output lengths (rounded to the nearest integer), then
      ``max_input_tokens`` / ``max_output_tokens`` cap them, then every length is raised to at
      least ``min_tokens``.
    """
    _check_transform_args(window, time_scale, length_scale, max_input_tokens, max_output_tokens,
                          min_tokens)
    selected = sorted(requests, key=lambda r: r.arrival_s)
    origin = 0.0
    if window is not None:
        start, end = window
        selected = [r for r in selected if start <= r.arrival_s < end]
        origin = start
    return [
        TraceRequest(
            arrival_s=(r.arrival_s - origin) * time_scale,
            input_tokens=_scale_length(r.input_tokens, length_scale, max_input_tokens, min_tokens),
            output_tokens=_scale_length(r.output_tokens, length_scale, max_output_tokens, min_tokens),
            block_ids=r.block_ids,
        )
        for r in selected
    ]


def _check_transform_args(
    window: tuple[float, float] | None,
    time_scale: float,
    length_scale: float,
    max_input_tokens: int | None,
    max_output_tokens: int | None,
    min_tokens: int,
) -> None:
    if window is not None:
        if len(window) != 2 or not window[0] < window[1]:
            raise ValueError(f"window must be (start_s, end_s) with start_s < end_s, got {window!r}")
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"time_scale must be a positive finite number, got {time_scale!r}")
    if not (length_scale > 0 and math.isfinite(length_scale)):
        raise ValueError(f"length_scale must be a positive finite number, got {length_scale!r}")
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    for name, cap in (("max_input_tokens", max_input_tokens), ("max_output_tokens", max_output_tokens)):
        if cap is not None and cap < min_tokens:
            raise ValueError(f"{name}={cap} is below min_tokens={min_tokens}")


def _scale_length(n: int, scale: float, cap: int | None, min_tokens: int) -> int:
    scaled = int(math.floor(n * scale + 0.5))  # round half up, not to even
    if cap is not None:
        scaled = min(scaled, cap)
    return max(scaled, min_tokens)


def find_burst_window(requests: Sequence[TraceRequest], window_s: float) -> tuple[float, float]:
    """The window ``[start, start + window_s)`` containing the most arrivals (earliest on ties).

    The best window can always be slid right until it starts at an arrival, so only windows
    starting at arrivals are tried. Feed the result to ``transform(window=...)`` to replay
    "a bursty window" of a trace.
    """
    if not requests:
        raise ValueError("find_burst_window needs at least one request")
    if not (window_s > 0 and math.isfinite(window_s)):
        raise ValueError(f"window_s must be a positive finite number, got {window_s!r}")
    arrivals = sorted(r.arrival_s for r in requests)
    best_start, best_count = arrivals[0], 0
    for i, start in enumerate(arrivals):
        count = bisect.bisect_left(arrivals, start + window_s, lo=i) - i
        if count > best_count:
            best_start, best_count = start, count
    return best_start, best_start + window_s


# --------------------------------------------------------------------------------------------------
# Synthetic workloads
# --------------------------------------------------------------------------------------------------

def synthetic_gamma(
    num_requests: int,
    rate_rps: float,
    burstiness: float,
    input_tokens: LengthSpec,
    output_tokens: LengthSpec,
    seed: int,
) -> list[TraceRequest]:
    """Requests with gamma-distributed inter-arrival times, as ``vllm bench serve`` generates them.

    Gaps are i.i.d. Gamma(shape=burstiness, scale=1/(rate_rps*burstiness)), so their mean is
    ``1/rate_rps`` whatever the burstiness; ``burstiness=1`` is a Poisson process, ``< 1`` is
    burstier (coefficient of variation 1/sqrt(burstiness)), ``> 1`` more regular. The first request
    arrives at 0 and each later one one gap after the previous, like vLLM's sender loop;
    ``rate_rps=inf`` sends everything at 0. Lengths are a fixed int or an inclusive ``(low, high)``
    range sampled uniformly. The same seed gives the same trace.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate_rps > 0:
        raise ValueError(f"rate_rps must be > 0 (or inf), got {rate_rps!r}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness!r}")
    rng = np.random.default_rng(seed)
    arrivals = _gamma_arrivals(rng, num_requests, rate_rps, burstiness)
    inputs = _sample_lengths(rng, num_requests, input_tokens, "input_tokens")
    outputs = _sample_lengths(rng, num_requests, output_tokens, "output_tokens")
    return [TraceRequest(float(t), int(i), int(o)) for t, i, o in zip(arrivals, inputs, outputs)]


def _gamma_arrivals(rng: np.random.Generator, n: int, rate_rps: float, burstiness: float) -> np.ndarray:
    if n == 0:
        return np.zeros(0)
    if math.isinf(rate_rps):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate_rps * burstiness), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def _sample_lengths(rng: np.random.Generator, n: int, spec: LengthSpec, name: str) -> np.ndarray:
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        if spec < 1:
            raise ValueError(f"{name} must be >= 1, got {spec}")
        return np.full(n, int(spec))
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and all(isinstance(x, (int, np.integer)) for x in spec):
        low, high = int(spec[0]), int(spec[1])
        if not 1 <= low <= high:
            raise ValueError(f"{name} range must satisfy 1 <= low <= high, got {spec}")
        return rng.integers(low, high, size=n, endpoint=True)
    raise ValueError(f"{name} must be an int or a (low, high) tuple of ints, got {spec!r}")

