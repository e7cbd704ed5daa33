"""Bounded admission (load shedding): at most `max_inflight` requests run at once; up to
`max_queued` more wait, first come first served, at most `max_wait_s` each; anything beyond is
refused at once with an Overloaded error carrying a retry hint, so latency cannot grow without
bound under overload. No grpc here; owned by one event loop."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from shared.errors import ResourceExhausted


class Overloaded(ResourceExhausted):
    """The gateway is at its admission bounds (RESOURCE_EXHAUSTED; HTTP 429 + Retry-After)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Admission:
    def __init__(
        self, max_inflight: int, max_queued: int, max_wait_s: float, retry_after_s: float = 1.0
    ) -> None:
        """max_inflight <= 0: no bound (everything is admitted at once)."""
        self.max_inflight = max_inflight
        self.max_queued = max(0, max_queued)
        self.max_wait_s = max_wait_s
        self.retry_after_s = retry_after_s
        self._running = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_queued(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the `max_inflight` slots for the body; raises Overloaded when the queue is
        full or the wait for a slot exceeds `max_wait_s`."""
        if self.max_inflight <= 0:
            yield
            return
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self._running < self.max_inflight and not self.num_queued:
            self._running += 1
            return
        if self.num_queued >= self.max_queued:
            raise Overloaded(
                f"the gateway is at capacity ({self._running} requests running, "
                f"{self.num_queued} queued, the most it queues); retry after "
                f"{self.retry_after_s:g} s or on another replica",
                self.retry_after_s,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.max_wait_s)
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():  # the slot came just as time ran out
                return
            waiter.cancel()
            raise Overloaded(
                f"the gateway is at capacity: no slot freed within {self.max_wait_s:g} s "
                f"({self._running} requests running); retry after {self.retry_after_s:g} s",
                self.retry_after_s,
            ) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot, then cancelled: pass it on
                self._release()
            else:
                waiter.cancel()
            raise
        # the releasing request handed its slot over: _running already counts this one

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the first waiter, _running unchanged
                return
        self._running -= 1
