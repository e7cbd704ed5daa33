"""Bounded admission (load shedding): at most `max_inflight` requests run at once; up to
`max_queued` more wait, at most `max_wait_s` each, served by priority (lower first, vLLM's
convention) and first come first served among equals; anything beyond is refused at once with
an Overloaded error carrying a retry hint, so latency cannot grow without bound under overload.
When the queue is full, a request of better priority than its worst waiter takes that waiter's
place (the waiter gets the Overloaded error): under overload the low-priority traffic is shed
first. No grpc here; owned by one event loop."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shared.errors import ResourceExhausted


class Overloaded(ResourceExhausted):
    """The gateway is at its admission bounds (RESOURCE_EXHAUSTED; HTTP 429 + Retry-After)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int  # arrival order among equal priorities
    future: asyncio.Future[None] = field(compare=False)


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
        # sorted best first; entries whose future is done (cancelled, timed out, evicted) are
        # dropped lazily
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_queued(self) -> int:
        return sum(1 for w in self._waiters if not w.future.done())

    @contextlib.asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        """Hold one of the `max_inflight` slots for the body; raises Overloaded when the queue is
        full of requests of the same or better priority, when a better one takes this one's
        place in the queue, or when the wait for a slot exceeds `max_wait_s`."""
        if self.max_inflight <= 0:
            yield
            return
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, priority: int) -> None:
        if self._running < self.max_inflight and not self.num_queued:
            self._running += 1
            return
        if self.num_queued >= self.max_queued and not self._evict_worse_than(priority):
            raise Overloaded(
                f"the gateway is at capacity ({self._running} requests running, "
                f"{self.num_queued} queued, the most it queues); retry after "
                f"{self.retry_after_s:g} s or on another replica",
                self.retry_after_s,
            )
        waiter = _Waiter(priority, next(self._seq), asyncio.get_running_loop().create_future())
        bisect.insort(self._waiters, waiter)
        future = waiter.future
        try:
            await asyncio.wait_for(asyncio.shield(future), self.max_wait_s)
        except TimeoutError:
            if future.done() and not future.cancelled() and future.exception() is None:
                return  # the slot came just as time ran out
            future.cancel()
            raise Overloaded(
                f"the gateway is at capacity: no slot freed within {self.max_wait_s:g} s "
                f"({self._running} requests running); retry after {self.retry_after_s:g} s",
                self.retry_after_s,
            ) from None
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._release()  # handed a slot, then cancelled: pass it on
            else:
                future.cancel()
            raise
        # the releasing request handed its slot over: _running already counts this one

    def _evict_worse_than(self, priority: int) -> bool:
        """Refuse the worst queued waiter when it is worse than `priority` (the newest among
        equals); True when one made room."""
        while self._waiters and self._waiters[-1].future.done():
            self._waiters.pop()
        if not self._waiters or self._waiters[-1].priority <= priority:
            return False
        worst = self._waiters.pop()
        worst.future.set_exception(
            Overloaded(
                f"the gateway is at capacity and its queue is full; a request of better priority "
                f"(lower than {worst.priority}) took this one's place; retry after "
                f"{self.retry_after_s:g} s or on another replica",
                self.retry_after_s,
            )
        )
        return True

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.pop(0)
            if not waiter.future.done():
                waiter.future.set_result(None)  # the slot moves to the best waiter, _running unchanged
                return
        self._running -= 1
