"""Delivery of RequestOutputs from a rank's step thread to the caller's asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence

from services.worker.engine.api import RequestOutput


class OutputHandle:
    """A RequestHandle: async iterator over one request's outputs, ending after finished=True.

    Created on the caller's event loop thread; `deliver_batch` may be called from any thread."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while True:
            out = await self._queue.get()
            yield out
            if out.finished:
                return

    def _put(self, out: RequestOutput) -> None:
        self._queue.put_nowait(out)


def _put_all(items: Sequence[tuple[OutputHandle, RequestOutput]]) -> None:
    for handle, out in items:
        handle._put(out)


def deliver_batch(items: Sequence[tuple[OutputHandle, RequestOutput]]) -> None:
    """Queue outputs on their loops: one call_soon_threadsafe per loop per step."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputHandle, RequestOutput]]] = defaultdict(list)
    for handle, out in items:
        by_loop[handle.loop].append((handle, out))
    for loop, batch in by_loop.items():
        # a closed caller loop raises RuntimeError: nobody is listening any more
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, batch)
