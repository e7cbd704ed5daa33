"""Delivery of RequestOutputs from a rank's step thread to the caller's asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Sequence

from services.worker.engine.api import RequestOutput


class OutputHandle:
    """A RequestHandle: async iterator over one request's outputs, ending after finished=True.

    Created on the caller's event loop thread; `deliver_batch` may be called from any thread."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        # outputs not yet taken, and the future the consumer waits on while there are none (a
        # deque and one future: an asyncio.Queue's get coroutine, task counting and waiter
        # lists cost more than that per streamed token, for a queue with one consumer)
        self._outputs: deque[RequestOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        outputs = self._outputs
        while True:
            while not outputs:
                self._waiter = self.loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            out = outputs.popleft()
            yield out
            if out.finished:
                return

    def _put(self, out: RequestOutput) -> None:
        """On the handle's loop (deliver_batch's callback)."""
        self._outputs.append(out)
        waiter = self._waiter
        if waiter is not None and not waiter.done():  # done: the consumer was cancelled
            waiter.set_result(None)


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
