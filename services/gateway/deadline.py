"""A request's deadline, on the time.monotonic() clock (None: no deadline): what is left of it,
the timeout of a control call inside it, and awaiting anything until it (DeadlineExceeded past
it). No task is created per await: a single await runs under `asyncio.timeout`; a stream's reads
run under one `ReadDeadline` (one timer per stream, not per frame)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from shared.errors import DeadlineExceeded

T = TypeVar("T")


def remaining_s(deadline_s: float | None) -> float | None:
    """Seconds left (at least 1 ms, so that a timeout passed on is never zero or negative)."""
    if deadline_s is None:
        return None
    return max(0.001, deadline_s - time.monotonic())


def control_timeout_s(deadline_s: float | None, limit_s: float) -> float:
    """A control call's timeout: `limit_s`, shortened to what is left of the deadline."""
    remaining = remaining_s(deadline_s)
    return limit_s if remaining is None else min(remaining, limit_s)


async def within(aw: Awaitable[T], deadline_s: float | None) -> T:
    """Await `aw` until the request's deadline."""
    if deadline_s is None:
        return await aw
    remaining = deadline_s - time.monotonic()
    if remaining <= 0:
        if asyncio.iscoroutine(aw):
            aw.close()
        raise deadline_error()
    timeout = asyncio.timeout(remaining)
    try:
        async with timeout:
            return await aw
    except TimeoutError:
        if timeout.expired():
            raise deadline_error() from None
        raise


class ReadDeadline:
    """The deadline over the many reads of one stream (`with` it around them): one timer for the
    stream, not one per read as `within` arms (a token stream would create, heap and cancel a
    timer per token). When it fires, the read pending then is cancelled and raises
    DeadlineExceeded; a read started after it raises at once. Between reads (e.g. while a relay
    is suspended at a yield) it cancels nothing, exactly as `within` would not."""

    def __init__(self, deadline_s: float | None) -> None:
        self._deadline_s = deadline_s
        self._timer: asyncio.TimerHandle | None = None
        self._reader: asyncio.Task[object] | None = None  # the task awaiting a read, if any
        self._cancelling = 0  # the reader's cancellation count when its read began
        self._cancelled_read = False  # the timer cancelled the pending read
        self.expired = False

    def __enter__(self) -> ReadDeadline:
        if self._deadline_s is not None:
            delay_s = self._deadline_s - time.monotonic()
            self._timer = asyncio.get_running_loop().call_later(max(0.0, delay_s), self._expire)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self.expired = True
        if self._reader is not None:
            self._cancelled_read = True
            self._reader.cancel()

    async def read(self, aw: Awaitable[T]) -> T:
        """Await `aw` (a read of the stream) until the deadline."""
        if self._deadline_s is None:
            return await aw
        if self.expired or self._deadline_s - time.monotonic() <= 0:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise deadline_error()
        task = asyncio.current_task()
        assert task is not None
        self._reader, self._cancelling, self._cancelled_read = task, task.cancelling(), False
        try:
            return await aw
        except asyncio.CancelledError:
            # ours (and no other cancellation pending): the deadline; else the caller's
            if self._cancelled_read and task.uncancel() <= self._cancelling:
                raise deadline_error() from None
            raise
        finally:
            self._reader = None


def deadline_error() -> DeadlineExceeded:
    return DeadlineExceeded("the request ran past its deadline and was aborted on the workers")
