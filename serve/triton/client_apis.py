"""Which of Triton's APIs clients may reach (docs/hardening.md, Reliability III, finding 4): closed by default except
inference, health, metadata (model metadata and configuration) and statistics, on HTTP and gRPC alike.

Why: Triton 2.51 restricts only the model-repository API by default, so any client could register a system shared-memory
region (the precondition of the 2025 Python-backend shared-memory advisories, fixed in Triton 25.07; 2.51 is older),
even with the Python backend's own region name, which is world-readable in /dev/shm, and could change the server's
logging. Here:

- the client ports are the project's front ends: HTTP (serve/triton/http_front.py) and gRPC
  (serve/triton/grpc_front.py) refuse every API that is not open (HTTP 403, gRPC PERMISSION_DENIED) before
  tritonserver sees it; ``python -m serve.triton --client-api shared-memory`` (or ``logging``, ``trace``) opens one;
  the model repository has its own switch (``--allow-repository-api``);
- tritonserver itself, on its internal loopback ports, restricts the same APIs to a random header value nobody is
  told (``--http-restricted-api`` / ``--grpc-restricted-protocol``, as Triton 2.51 supports them), so a local
  process that finds those ports gets no further.
"""

from __future__ import annotations

import re

OPEN_BY_DEFAULT = frozenset({"inference", "health", "metadata", "statistics"})
OPENABLE = ("shared-memory", "logging", "trace")
"""What ``--client-api`` may open (the model repository: ``--allow-repository-api``)."""
TRITON_RESTRICTABLE = ("shared-memory", "logging", "trace", "model-repository")
"""Triton's names for the APIs restricted on its own ports when closed to clients."""

_GRPC_SERVICE = "/inference.GRPCInferenceService/"
GRPC_METHODS: dict[str, tuple[str, bool]] = {
    # method -> (API, streams both ways)
    "ServerLive": ("health", False), "ServerReady": ("health", False), "ModelReady": ("health", False),
    "ServerMetadata": ("metadata", False), "ModelMetadata": ("metadata", False), "ModelConfig": ("metadata", False),
    "ModelInfer": ("inference", False), "ModelStreamInfer": ("inference", True),
    "ModelStatistics": ("statistics", False),
    "RepositoryIndex": ("model-repository", False), "RepositoryModelLoad": ("model-repository", False),
    "RepositoryModelUnload": ("model-repository", False),
    "SystemSharedMemoryStatus": ("shared-memory", False), "SystemSharedMemoryRegister": ("shared-memory", False),
    "SystemSharedMemoryUnregister": ("shared-memory", False), "CudaSharedMemoryStatus": ("shared-memory", False),
    "CudaSharedMemoryRegister": ("shared-memory", False), "CudaSharedMemoryUnregister": ("shared-memory", False),
    "TraceSetting": ("trace", False), "LogSettings": ("logging", False),
}

_MODEL = r"/v2/models/[^/]+(?:/versions/[^/]+)?"
_HTTP_PATHS: list[tuple[re.Pattern[str], str]] = [(re.compile(p), api) for p, api in (
    (r"/v2/health/(?:live|ready)", "health"),
    (_MODEL + r"/ready", "health"),
    (r"/v2/models/stats", "statistics"),  # before _MODEL, which "stats" would match as a model name
    (_MODEL + r"/stats", "statistics"),
    (r"/v2", "metadata"),
    (_MODEL, "metadata"),
    (_MODEL + r"/config", "metadata"),
    (_MODEL + r"/(?:infer|generate|generate_stream)", "inference"),
    (r"/v2/repository/.*", "model-repository"),
    (r"/v2/(?:systemsharedmemory|cudasharedmemory)(?:/.*)?", "shared-memory"),
    (r"/v2/logging", "logging"),
    (r"/v2/trace/setting", "trace"),
    (_MODEL + r"/trace/setting", "trace"),
)]


def open_apis(extra: tuple[str, ...] | list[str] = (), repository: bool = False) -> frozenset[str]:
    """The APIs open to clients: the defaults, ``extra`` (each one of OPENABLE) and the model repository when asked."""
    unknown = [a for a in extra if a not in OPENABLE]
    if unknown:
        raise ValueError(f"--client-api takes {', '.join(OPENABLE)}; got {', '.join(unknown)}")
    return OPEN_BY_DEFAULT | frozenset(extra) | ({"model-repository"} if repository else frozenset())


def http_api(path: str) -> str | None:
    """The API an HTTP path belongs to; None for a path Triton does not serve."""
    return next((api for pattern, api in _HTTP_PATHS if pattern.fullmatch(path)), None)


def grpc_api(method: str) -> tuple[str, bool] | None:
    """(API, bidirectional streaming) of a gRPC method path; None for a method that is not Triton's."""
    if not method.startswith(_GRPC_SERVICE):
        return None
    return GRPC_METHODS.get(method[len(_GRPC_SERVICE):])


def closed_message(api: str) -> str:
    hint = "--allow-repository-api" if api == "model-repository" else f"--client-api {api}"
    return (f"the {api} API is not open to clients on this server (python -m serve.triton {hint} opens it; "
            "docs/hardening.md)")


def triton_restrictions(opened: frozenset[str], key: str, value: str) -> list[str]:
    """tritonserver flags restricting, on its own ports, every restrictable API that is not open to clients."""
    closed = [api for api in TRITON_RESTRICTABLE if api not in opened]
    if not closed:
        return []
    apis = ",".join(closed)
    return [f"--http-restricted-api={apis}:{key}={value}", f"--grpc-restricted-protocol={apis}:{key}={value}"]
