"""Length-prefixed JSON messages over a pipe, between the engine's process and its grammar compile worker
(serve/guided/compile_worker.py): 4 bytes big-endian length, then that many bytes of UTF-8 JSON.

Stdlib only, so the worker imports nothing of the engine's."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30


def encode(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode("utf-8")
    return HEADER.pack(len(data)) + data


def write(fd: int, message: dict[str, Any]) -> None:
    """Write one message to a blocking file descriptor."""
    view = memoryview(encode(message))
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Reader:
    """Messages from a stream of bytes fed in pieces (a non-blocking pipe read as it comes)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            if n > MAX_FRAME_BYTES:
                raise ValueError(f"a message of {n} bytes is over the {MAX_FRAME_BYTES} limit")
            if len(self._buf) < HEADER.size + n:
                break
            out.append(json.loads(bytes(self._buf[HEADER.size:HEADER.size + n])))
            del self._buf[:HEADER.size + n]
        return out

