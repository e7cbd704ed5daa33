"""A request's deadline, on the time.monotonic() clock (None: no deadline): what is left of it,
the timeout of a control call inside it, and awaiting anything until it (DeadlineExceeded past
it). No task is created per await: a stream's frames are read under `asyncio.timeout`."""

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


def deadline_error() -> DeadlineExceeded:
    return DeadlineExceeded("the request ran past its deadline and was aborted on the workers")
