"""Engine thread -> asyncio: one queue per request, fed by the engine's callback.

The engine calls a request's callback from its loop thread after each iteration; the callback must not
block that loop, so it only schedules ``queue.put_nowait`` on the worker's event loop
(``call_soon_threadsafe``). ``generate()`` awaits the queue, so tokens leave the worker as soon as the
event loop runs, and an aborted or failed request ends its stream with the engine's final output.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any


class OutputStream:
    """The outputs of one engine request, as an async iterator that ends after the final one."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False

    def push(self, output: Any) -> None:
        """The engine callback (any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, output)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening any more
            pass

    async def __aiter__(self) -> AsyncIterator[Any]:
        while not self.finished:
            output = await self._queue.get()
            self.finished = bool(output.finished)
            yield output
