"""What the reliability probe's rows share (``bench.reliability_probe``): a running server as the probe sees it
(its URLs and its launcher's process tree) and the requests, process and metric readings the rows make."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.triton.client import generate_http, metric_value, scrape_metrics

MODEL = "morphserve"
TRITONSERVER, ENGINE_STUB, COMPILE_WORKER = "bin/tritonserver", "/morphserve/1/model.py", "serve.guided.compile_worker"


@dataclass
class Target:
    """A running server: ``host:port`` of each front end, and the pid whose process tree holds tritonserver (the
    launcher's; in a test, the test process's own)."""

    http: str
    grpc: str
    metrics: str
    operator_port: int
    root_pid: int
    log: Path | None = None


def post(url: str, path: str, body: bytes | dict[str, Any], timeout: float = 120.0,
         method: str = "POST") -> tuple[int, str, float]:
    """(status, body text, seconds) of one request on a fresh connection."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    host, port = url.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    t0 = time.perf_counter()
    try:
        c.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", errors="replace"), time.perf_counter() - t0
    finally:
        c.close()


def generate(t: Target, body: bytes | dict[str, Any], model: str = MODEL) -> tuple[int, str, float]:
    return post(t.http, f"/v2/models/{model}/generate", body)


def error_of(text: str) -> str:
    try:
        return str(json.loads(text).get("error", ""))
    except (ValueError, AttributeError):
        return text


def gauge(t: Target, name: str) -> float:
    return metric_value(scrape_metrics(f"http://{t.metrics}/metrics"), name, model=MODEL) or 0.0


def descendants(pid: int) -> list[int]:
    out = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            out += [int(child), *descendants(int(child))]
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def processes(t: Target, needle: str) -> list[int]:
    return [p for p in descendants(t.root_pid) if needle in cmdline(p)]


def status_field(pid: int, field: str) -> int:
    """A number from /proc/PID/status (``VmRSS`` in KiB, ``Threads``); 0 when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mib(pid: int) -> float:
    return round(status_field(pid, "VmRSS") / 1024, 1)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (clock ticks of 1/100 s)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / 100
    except OSError:
        return 0.0


def streams(t: Target, n: int, tokens: int, started: list[threading.Event]) -> tuple[list[threading.Thread], dict]:
    """``n`` HTTP streams of ``tokens`` tokens (ignore_eos) in threads; results[i] = (tokens, finish reason) or the
    error's words. Each sets started[i] at its first token."""
    results: dict[int, Any] = {}

    def one(i: int) -> None:
        events = [0]

        def on_text(_t: str) -> None:
            events[0] += 1
            started[i].set()

        try:
            c = generate_http(f"Client {i}: count slowly: 1, 2,", url=t.http, stream=True, max_tokens=tokens,
                              ignore_eos=True, temperature=0.0, timeout=600, on_text=on_text)
            results[i] = (c.num_output_tokens, c.finish_reason)
        except Exception as e:  # noqa: BLE001 - how a stream ended is what the row reports
            results[i] = f"{type(e).__name__} after {events[0]} text events: {str(e)[:80]}"

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    return threads, results


def wait_until(cond: Any, timeout_s: float, every_s: float = 0.1) -> float | None:
    """Seconds until ``cond()`` was true, or None after ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if cond():
                return round(time.monotonic() - t0, 2)
        except OSError:
            pass
        time.sleep(every_s)
    return None


def ready(t: Target) -> bool:
    try:
        return post(t.http, "/v2/health/ready", b"", timeout=5, method="GET")[0] == 200
    except OSError:
        return False
