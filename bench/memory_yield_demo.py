"""Demo of yield and reclaim (docs/memory-yield.md) against a real tritonserver on CPU.

  .venv/bin/python -m bench.memory_yield_demo [--floor 4GiB] [--shortfall 160MiB] [--hold-s 20]

1. Starts the server (mode ``default``, ``memory_floor`` = --floor, reclaim mark = floor + --margin) and two
   clients sending requests for the whole run. After --baseline-s the operator's control yields --manual and
   then reclaims it (the ``memory_yield`` / ``memory_reclaim`` controls on the operator port, loopback only;
   an inference client cannot send them).
2. Then a second process allocates (and touches) what the host's MemAvailable is above floor - --shortfall
   (once more if other processes freed memory meanwhile and nothing was yielded): the engine yields layers and
   gives their pages back.
3. After --hold-s the second process exits; once there is room (and --calm-s has passed) the engine reclaims.

Samples every 0.5 s: the host's MemAvailable, the server's resident memory (its process group), and the
engine's metrics (bytes yielded, outside free memory as it reads it, layers quantized). Prints one JSON object
(timeline + summary); ``--out`` writes it to a file too. The host needs --floor + the server (~1.5 GiB) + the
second process's allocation of free memory: the allocation is what is available above the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.soak import group_rss_bytes
from policy.precisions import QUANTIZED_PRECISIONS
from serve.config import EMBEDDED_MODEL, parse_size
from serve.memory.pressure import meminfo_available
from serve.triton.client import GenerationError, generate_http, metric_value, scrape_metrics
from serve.triton.operator_port import post_control
from serve.triton.server import TritonServer

MODEL = "morphserve"
# The second process: for each line "N" on stdin allocates (and touches) N more bytes and answers "ok"; an empty
# line ends it (its memory goes back to the host).
HOG = """
import sys
held = []
for line in sys.stdin:
    if not line.strip():
        break
    held.append(bytearray(b'\\x01') * int(line))
    print('ok', flush=True)
"""


def sample(srv: TritonServer, pgid: int, t0: float) -> dict[str, Any]:
    m = scrape_metrics(srv.metrics_url)
    layers = sum(metric_value(m, "morphserve_layers_quantized", model=MODEL, precision=p) or 0
                 for p in QUANTIZED_PRECISIONS)
    return {"t_s": round(time.monotonic() - t0, 2), "mem_available_mib": round((meminfo_available() or 0) / 2**20),
            "server_rss_mib": round(group_rss_bytes(pgid) / 2**20, 1),
            "yielded_mib": round((metric_value(m, "morphserve_memory_yielded_bytes", model=MODEL) or 0) / 2**20, 1),
            "outside_free_mib": round((metric_value(m, "morphserve_memory_outside_free_bytes", model=MODEL) or 0)
                                      / 2**20),
            "layers_quantized": int(layers),
            "kv_blocks_total": int(metric_value(m, "morphserve_kv_blocks_total", model=MODEL) or 0)}


def clients(srv: TritonServer, stop: threading.Event, counts: dict[str, int], n: int = 2) -> list[threading.Thread]:
    def loop() -> None:
        while not stop.is_set():
            try:
                generate_http("Write a short note about the sea.", url=srv.http_url, max_tokens=32)
                counts["ok"] += 1
            except (GenerationError, OSError) as exc:
                counts["failed"] += 1
                counts.setdefault("errors", []).append(str(exc)[:200])  # type: ignore[attr-defined]
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def control(srv: TritonServer, command: str) -> dict[str, Any]:
    """The operator's memory control on the server's operator port (serve/triton/operator_port.py): ``yield SIZE``
    or ``reclaim``. Returns the engine's answer (its memory state); RuntimeError when the control is refused."""
    if command == "reclaim":
        answer = post_control(srv.operator_port, "memory_reclaim")
    elif command.startswith("yield "):
        answer = post_control(srv.operator_port, "memory_yield", {"size": command.removeprefix("yield ").strip()})
    else:
        raise ValueError(f"control must be 'yield SIZE' or 'reclaim', got {command!r}")
    if answer.get("status") == "error":
        raise RuntimeError(f"operator control {command!r} refused: {answer}")
    return answer


class reached(threading.Event):  # noqa: N801 - reads as a condition
    """Set once the newest timeline sample satisfies ``test`` (checked whenever ``is_set`` is asked)."""

    def __init__(self, test, timeline: list[dict[str, Any]]) -> None:
        super().__init__()
        self._test, self._timeline = test, timeline

    def is_set(self) -> bool:
        return bool(self._timeline) and self._test(self._timeline[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--floor", default="4GiB", help="memory_floor of the server (default: %(default)s)")
    p.add_argument("--margin", default="256MiB", help="reclaim mark = floor + this (default: %(default)s)")
    p.add_argument("--shortfall", default="160MiB", help="how far below the floor the second process pushes the host")
    p.add_argument("--baseline-s", type=float, default=10.0)
    p.add_argument("--manual", default="48MiB", help="what the operator's control yields first (default: %(default)s)")
    p.add_argument("--hold-s", type=float, default=20.0, help="how long the second process holds its memory")
    p.add_argument("--after-s", type=float, default=40.0, help="how long to watch after it exits")
    p.add_argument("--calm-s", type=float, default=5.0, help="memory_reclaim_calm_s of the server")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    floor, margin, shortfall = parse_size(args.floor), parse_size(args.margin), parse_size(args.shortfall)
    params = {"engine_dir": EMBEDDED_MODEL, "morph_mode": "default", "max_model_len": 512, "num_threads": 1,
              "memory_floor": str(floor), "memory_reclaim_mark": str(floor + margin),
              "policy": json.dumps({"memory_reclaim_calm_s": args.calm_s}), "queue_timeout_s": 0}
    log_dir = Path(tempfile.gettempdir()) / f"morphserve-yield-demo-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    timeline: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    counts: dict[str, Any] = {"ok": 0, "failed": 0}
    with TritonServer(params=params, log_path=log_dir / "tritonserver.log") as srv:
        srv.wait_ready(timeout=300)
        pgid = os.getpgid(srv.proc.pid)
        t0 = time.monotonic()
        stop = threading.Event()
        threads = clients(srv, stop, counts)

        def watch(seconds: float, until: threading.Event | None = None) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end and not (until is not None and until.is_set()):
                timeline.append(sample(srv, pgid, t0))
                time.sleep(0.5)

        def now() -> float:
            return round(time.monotonic() - t0, 2)

        watch(args.baseline_s)
        # the operator's control first: yield --manual, then reclaim (a request parameter through the HTTP front end)
        state = control(srv, f"yield {args.manual}")
        events.append({"t_s": now(), "event": "manual_yield", "response": state})
        watch(30, until=reached(lambda s: s["yielded_mib"] * 2**20 >= parse_size(args.manual), timeline))
        events.append({"t_s": now(), "event": "manual_reclaim", "response": control(srv, "reclaim")})
        watch(30, until=reached(lambda s: s["yielded_mib"] == 0, timeline))
        events.append({"t_s": now(), "event": "manual_done"})
        watch(args.baseline_s / 2)
        avail = meminfo_available() or 0
        if avail <= floor:
            raise SystemExit(f"MemAvailable {avail / 2**30:.1f} GiB is already below the floor; choose a lower --floor")
        events.append({"t_s": now(), "event": "second_process_allocates", "target_mem_available_mib":
                       round((floor - shortfall) / 2**20), "mem_available_mib": round(avail / 2**20)})
        hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hog_total = 0

        def allocate(nbytes: int) -> None:  # in the background: the timeline goes on while the pages are touched
            nonlocal hog_total
            done = threading.Event()

            def ask() -> None:
                hog.stdin.write(f"{nbytes}\n")
                hog.stdin.flush()
                hog.stdout.readline()
                done.set()
            threading.Thread(target=ask, daemon=True).start()
            watch(600, until=done)
            hog_total += nbytes

        allocate(avail - (floor - shortfall))
        # Other processes' memory moves too: if the floor was never crossed (nothing yielded) top up once.
        if timeline[-1]["yielded_mib"] == 0 and (meminfo_available() or 0) > floor:
            allocate((meminfo_available() or 0) - (floor - shortfall))
        events.append({"t_s": now(), "event": "second_process_holds", "bytes_mib": round(hog_total / 2**20)})
        watch(args.hold_s)
        hog.communicate("\n", timeout=60)
        events.append({"t_s": now(), "event": "second_process_exited", "rc": hog.returncode})
        watch(args.after_s)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        log_text = Path(log_dir / "tritonserver.log").read_text(errors="replace")
    summary = summarize(timeline, events, counts, log_text)
    result = {"command": "python -m bench.memory_yield_demo " + " ".join(argv if argv is not None else sys.argv[1:]),
              "params": params, "summary": summary, "events": events, "timeline": timeline}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps(summary, indent=1))
    return 0 if summary["requests_failed"] == 0 and summary["yielded_max_mib"] > 0 and summary["reclaimed"] else 1


def summarize(timeline: list[dict], events: list[dict], counts: dict, log_text: str) -> dict[str, Any]:
    start = next(e["t_s"] for e in events if e["event"] == "second_process_allocates")
    end = next(e["t_s"] for e in events if e["event"] == "second_process_exited")
    before = [s for s in timeline if s["t_s"] < start]
    during = [s for s in timeline if start <= s["t_s"] <= end]
    after = [s for s in timeline if s["t_s"] > end]
    first_yield = next((s["t_s"] for s in during if s["yielded_mib"] > 0), None)
    at = {e["event"]: e["t_s"] for e in events}
    manual = [s for s in timeline if at.get("manual_yield", 0) <= s["t_s"] <= at.get("manual_done", -1)]
    manual_peak = max(manual, key=lambda s: s["yielded_mib"], default=None)
    back = next((s["t_s"] for s in after if s["yielded_mib"] == 0), None)
    return {
        "manual_yielded_mib": manual_peak["yielded_mib"] if manual_peak else None,
        "manual_rss_drop_mib": round(manual[0]["server_rss_mib"] - manual_peak["server_rss_mib"], 1) if manual_peak
        else None,
        "manual_seconds_to_yield": round(manual_peak["t_s"] - at["manual_yield"], 2) if manual_peak else None,
        "manual_seconds_to_reclaim": round(at["manual_done"] - at["manual_reclaim"], 2) if "manual_done" in at
        else None,
        "server_rss_before_mib": before[-1]["server_rss_mib"] if before else None,
        "server_rss_min_during_mib": min(s["server_rss_mib"] for s in during) if during else None,
        "server_rss_end_mib": timeline[-1]["server_rss_mib"],
        "yielded_max_mib": max((s["yielded_mib"] for s in timeline), default=0),
        "layers_quantized_max": max((s["layers_quantized"] for s in timeline), default=0),
        "seconds_to_first_yield": None if first_yield is None else round(first_yield - start, 2),
        "reclaimed": back is not None, "seconds_to_reclaim_all": None if back is None else round(back - end, 2),
        "requests_ok": counts["ok"], "requests_failed": counts["failed"], "errors": counts.get("errors", [])[:3],
        "log_yield_events": log_text.count('"event": "yield"'),
        "log_reclaim_events": log_text.count('"event": "reclaim"'),
    }


if __name__ == "__main__":
    raise SystemExit(main())
