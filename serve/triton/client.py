"""Command-line and library client for the morphserve Triton model.

    python -m serve.triton.client --prompt "The capital of France is" --stream --max-tokens 32
    python -m serve.triton.client --prompt "Hello" --protocol http --url 127.0.0.1:8000

gRPC uses tritonclient's bidirectional stream (the model is decoupled); HTTP uses Triton's generate
extension (POST /v2/models/NAME/generate, and /generate_stream with Server-Sent Events for --stream),
because Triton's plain HTTP infer endpoint does not serve decoupled models.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serve.error_kinds import ErrorKind
from serve.logging_setup import configure_logging, get_logger
from serve.triton.errors import read_tag

DEFAULT_MODEL = "morphserve"
DEFAULT_GRPC_URL = "127.0.0.1:8001"
DEFAULT_HTTP_URL = "127.0.0.1:8000"

log = get_logger("client")


class GenerationError(RuntimeError):
    """The server answered with an error (bad input, cancellation, server failure).

    ``kind``: what kind of error (serve/error_kinds.py), read from a gRPC stream's message tag; ``status`` and
    ``retry_after``: the HTTP status and Retry-After header (HTTP), or the tag's Retry-After (gRPC)."""

    def __init__(self, message: str, kind: ErrorKind | None = None, status: int | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.status, self.retry_after = kind, status, retry_after

    @classmethod
    def from_stream(cls, message: str) -> GenerationError:
        """A gRPC stream's error message: its kind and Retry-After from the tag, the words without it."""
        tag = read_tag(message)
        return cls(tag.text, tag.kind, retry_after=tag.retry_after_s)


@dataclass
class Completion:
    """A finished generation as the client saw it (times are client-side, time.perf_counter)."""

    text: str = ""
    chunks: list[str] = field(default_factory=list)
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)


def request_inputs(
    prompt: str | bytes,
    max_tokens: int | None = None,
    stream: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    ignore_eos: bool | None = None,
    ttft_slo_s: float | None = None,
    tbt_slo_s: float | None = None,
    priority: int | None = None,
    speculate: bool | None = None,
) -> dict[str, np.ndarray]:
    """The model's inputs as numpy arrays of the shapes config.pbtxt declares (optional ones omitted)."""
    text = prompt if isinstance(prompt, bytes) else prompt.encode("utf-8")
    arrays: dict[str, np.ndarray] = {"text_input": np.array([text], dtype=np.object_)}
    if max_tokens is not None:
        arrays["max_tokens"] = np.array([max_tokens], dtype=np.int32)
    if temperature is not None:
        arrays["temperature"] = np.array([temperature], dtype=np.float32)
    if top_p is not None:
        arrays["top_p"] = np.array([top_p], dtype=np.float32)
    if top_k is not None:
        arrays["top_k"] = np.array([top_k], dtype=np.int32)
    if seed is not None:
        arrays["seed"] = np.array([seed], dtype=np.uint64)
    if stop:
        arrays["stop"] = np.array([s.encode("utf-8") for s in stop], dtype=np.object_)
    if ignore_eos is not None:
        arrays["ignore_eos"] = np.array([ignore_eos], dtype=bool)
    if ttft_slo_s is not None:
        arrays["ttft_slo_s"] = np.array([ttft_slo_s], dtype=np.float32)
    if tbt_slo_s is not None:
        arrays["tbt_slo_s"] = np.array([tbt_slo_s], dtype=np.float32)
    if priority is not None:
        arrays["priority"] = np.array([priority], dtype=np.int32)
    if speculate is not None:
        arrays["speculate"] = np.array([speculate], dtype=bool)
    arrays["stream"] = np.array([stream], dtype=bool)
    return arrays


_NP_TO_TRITON = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32", np.dtype(np.uint64): "UINT64",
                 np.dtype(np.int64): "INT64", np.dtype(bool): "BOOL", np.dtype(np.object_): "BYTES"}


def grpc_inputs(arrays: dict[str, np.ndarray]) -> list[Any]:
    """tritonclient.grpc InferInputs for ``arrays`` (dtype mapped to Triton's names)."""
    import tritonclient.grpc as grpcclient  # noqa: PLC0415 - keep `--help` fast

    out = []
    for name, arr in arrays.items():
        inp = grpcclient.InferInput(name, list(arr.shape), _NP_TO_TRITON[arr.dtype])
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


class GrpcStream:
    """One gRPC bidirectional stream to the server (tritonclient allows one stream per client).

    Use as a context manager; ``generate()`` yields text chunks as they arrive; ``cancel()`` stops the
    stream and cancels its in-flight requests on the server.
    """

    def __init__(self, url: str = DEFAULT_GRPC_URL, model: str = DEFAULT_MODEL) -> None:
        import tritonclient.grpc as grpcclient  # noqa: PLC0415

        self.url = url
        self.model = model
        self.client = grpcclient.InferenceServerClient(url=url)
        self._q: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self._open = False

    def __enter__(self) -> GrpcStream:
        self.client.start_stream(callback=lambda result, error: self._q.put((result, error)))
        self._open = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._open:
            self.client.stop_stream()
            self._open = False
        self.client.close()

    def cancel(self) -> None:
        """Close the stream and ask the server to cancel the requests still running on it."""
        if self._open:
            self.client.stop_stream(cancel_requests=True)
            self._open = False

    def send(self, arrays: dict[str, np.ndarray], request_id: str | None = None,
             parameters: dict[str, Any] | None = None) -> str:
        """Send one request (``parameters``: request parameters, e.g. any input by name)."""
        rid = request_id or uuid.uuid4().hex
        self.client.async_stream_infer(self.model, grpc_inputs(arrays), request_id=rid,
                                       enable_empty_final_response=True, parameters=parameters)
        return rid

    def responses(self, timeout: float = 120.0) -> Iterator[dict[str, Any]]:
        """Yield each response of the request in flight as a dict of outputs, until the final one.

        Raises GenerationError on a server error and TimeoutError when nothing arrives in ``timeout``.
        """
        while True:
            try:
                result, error = self._q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no response from {self.url} within {timeout} s") from None
            if error is not None:
                message = error.message() if callable(getattr(error, "message", None)) else None
                raise GenerationError.from_stream(message or str(error))
            resp = result.get_response()
            final = bool(resp.parameters["triton_final_response"].bool_param) if (
                "triton_final_response" in resp.parameters) else True
            outputs = {o.name for o in resp.outputs}
            item: dict[str, Any] = {"final": final}
            if "text_output" in outputs:
                item["text_output"] = _first(result.as_numpy("text_output"))
                for name in ("num_input_tokens", "num_output_tokens"):
                    if name in outputs:
                        item[name] = int(_first(result.as_numpy(name)))
                if "finish_reason" in outputs:
                    item["finish_reason"] = _first(result.as_numpy("finish_reason"))
            yield item
            if final:
                return

    def generate(self, prompt: str | bytes, *, on_text: Callable[[str], None] | None = None,
                 timeout: float = 120.0, **options: Any) -> Completion:
        """Send one request on this stream and collect its completion (options: see request_inputs)."""
        t0 = time.perf_counter()
        self.send(request_inputs(prompt, **options))
        return _collect(self.responses(timeout), t0, on_text)


def _first(arr: np.ndarray) -> Any:
    v = arr.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else v


def _collect(items: Iterator[dict[str, Any]], t0: float, on_text: Callable[[str], None] | None) -> Completion:
    c = Completion()
    for item in items:
        text = item.get("text_output")
        if text:
            now = time.perf_counter()
            if c.ttft_s is None:
                c.ttft_s = now - t0
            c.chunk_times.append(now)
            c.chunks.append(text)
            if on_text is not None:
                on_text(text)
        for k in ("num_input_tokens", "num_output_tokens"):
            if k in item:
                setattr(c, k, item[k])
        if item.get("finish_reason"):
            c.finish_reason = item["finish_reason"]
    c.text = "".join(c.chunks)
    c.e2e_s = time.perf_counter() - t0
    return c


def generate_grpc(prompt: str | bytes, url: str = DEFAULT_GRPC_URL, model: str = DEFAULT_MODEL,
                  on_text: Callable[[str], None] | None = None, timeout: float = 120.0, **options: Any) -> Completion:
    """One request over a fresh gRPC stream."""
    with GrpcStream(url, model) as s:
        return s.generate(prompt, on_text=on_text, timeout=timeout, **options)


def _http_body(prompt: str, **options: Any) -> bytes:
    body: dict[str, Any] = {"text_input": prompt}
    body.update({k: v for k, v in options.items() if v is not None})
    return json.dumps(body).encode("utf-8")


def _http_error(e: urllib.error.HTTPError) -> GenerationError:
    raw = e.read().decode("utf-8", errors="replace")
    retry = e.headers.get("Retry-After")
    answer = {"status": e.code, "retry_after": int(retry) if retry and retry.isdigit() else None}
    for line in raw.splitlines():
        line = line.removeprefix("data:").strip()
        if line:
            try:
                return GenerationError(json.loads(line).get("error", line), **answer)
            except json.JSONDecodeError:
                return GenerationError(line, **answer)
    return GenerationError(f"HTTP {e.code}", **answer)


def generate_http(prompt: str, url: str = DEFAULT_HTTP_URL, model: str = DEFAULT_MODEL, stream: bool = False,
                  on_text: Callable[[str], None] | None = None, timeout: float = 120.0, **options: Any) -> Completion:
    """One request through the generate extension; with ``stream`` via generate_stream (SSE)."""
    endpoint = "generate_stream" if stream else "generate"
    req = urllib.request.Request(
        f"http://{url}/v2/models/{model}/{endpoint}",
        data=_http_body(prompt, stream=stream, **options),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    t0 = time.perf_counter()
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 - caller-chosen loopback URL
    except urllib.error.HTTPError as e:
        raise _http_error(e) from None
    with resp:
        if not stream:
            payload = json.loads(resp.read())
            if "error" in payload:
                raise GenerationError(payload["error"])
            return _collect(iter([payload]), t0, on_text)

        def events() -> Iterator[dict[str, Any]]:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                payload = json.loads(line[len("data:"):])
                if "error" in payload:
                    raise GenerationError(payload["error"])
                yield payload

        return _collect(events(), t0, on_text)


_SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$')
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus_text(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Parse Prometheus text exposition into {metric name: [(labels, value), ...]}.

    Enough for Triton's /metrics (no timestamps, no escaped quotes in our label values); histogram
    series keep their ``_bucket``/``_sum``/``_count`` suffixes as separate names.
    """
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m is None:
            raise ValueError(f"unparseable metrics line: {line!r}")
        name, labels_raw, value = m.groups()
        labels = dict(_LABEL_RE.findall(labels_raw or ""))
        out.setdefault(name, []).append((labels, float(value)))
    return out


def scrape_metrics(url: str, timeout: float = 5.0) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET a Prometheus endpoint (e.g. http://127.0.0.1:8002/metrics) and parse it."""
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - caller-chosen loopback URL
        return parse_prometheus_text(r.read().decode("utf-8"))


def metric_value(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float | None:
    """The value of the one series of ``name`` whose labels include ``labels`` (None if absent)."""
    for lbls, value in metrics.get(name, []):
        if all(lbls.get(k) == v for k, v in labels.items()):
            return value
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serve.triton.client",
        description="Send one prompt to the morphserve model on a Triton server and print the completion.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (server default if omitted)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (server default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None, help="generate exactly --max-tokens tokens")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--url", default=None,
                   help=f"host:port (default {DEFAULT_GRPC_URL} for gRPC, {DEFAULT_HTTP_URL} for HTTP)")
    p.add_argument("--model-name", "--model", dest="model_name", default=DEFAULT_MODEL,
                   help="the model's name on the server, as serve.triton's --model-name (default: %(default)s). "
                        "--model is a deprecated alias kept for old scripts: every other command's --model names an "
                        "engine source")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for a response")
    p.add_argument("--json", action="store_true", help="print the completion and timings as one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("warning")
    options: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                               "top_k": args.top_k, "seed": args.seed, "stop": args.stop,
                               "ignore_eos": args.ignore_eos}
    streaming_print = args.stream and not args.json

    def on_text(t: str) -> None:
        sys.stdout.write(t)
        sys.stdout.flush()

    cb = on_text if streaming_print else None
    try:
        if args.protocol == "grpc":
            c = generate_grpc(args.prompt, url=args.url or DEFAULT_GRPC_URL, model=args.model_name, on_text=cb,
                              timeout=args.timeout, stream=args.stream, **options)
        else:
            c = generate_http(args.prompt, url=args.url or DEFAULT_HTTP_URL, model=args.model_name, stream=args.stream,
                              on_text=cb, timeout=args.timeout, **options)
    except (GenerationError, TimeoutError, OSError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    except Exception as e:  # noqa: BLE001 - tritonclient raises its own exception types
        sys.stderr.write(f"error: {type(e).__name__}: {e}\n")
        return 1
    if args.json:
        sys.stdout.write(json.dumps({
            "text": c.text, "num_input_tokens": c.num_input_tokens, "num_output_tokens": c.num_output_tokens,
            "finish_reason": c.finish_reason, "ttft_s": c.ttft_s, "e2e_s": c.e2e_s, "chunks": len(c.chunks),
        }) + "\n")
    elif streaming_print:
        sys.stdout.write("\n")
    else:
        sys.stdout.write(c.text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
