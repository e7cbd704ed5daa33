"""ReadDeadline: one timer over a stream's reads that ends the read pending at the deadline with
DeadlineExceeded (as `within` around each read would), never mistakes the caller's own
cancellation for it, and fails a read begun after it at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.deadline import ReadDeadline
from shared.errors import DeadlineExceeded


async def _never() -> None:
    await asyncio.Event().wait()


async def test_the_pending_read_ends_at_the_deadline_and_later_reads_at_once() -> None:
    with ReadDeadline(time.monotonic() + 0.05) as until:
        assert await until.read(asyncio.sleep(0, "frame")) == "frame"
        with pytest.raises(DeadlineExceeded):
            await until.read(_never())
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        with pytest.raises(DeadlineExceeded):
            await until.read(asyncio.sleep(0, "late"))


async def test_a_deadline_passed_between_reads_cancels_nothing() -> None:
    """Fired while no read was pending (the relay was suspended at a yield): nothing is
    cancelled then; the next read raises."""
    with ReadDeadline(time.monotonic() + 0.02) as until:
        await asyncio.sleep(0.05)  # not a read: the timer fires meanwhile
        assert until.expired
        with pytest.raises(DeadlineExceeded):
            await until.read(asyncio.sleep(0))


async def test_the_callers_cancellation_stays_a_cancellation() -> None:
    async def reader() -> None:
        with ReadDeadline(time.monotonic() + 30) as until:
            await until.read(_never())

    task = asyncio.ensure_future(reader())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_no_deadline_reads_as_is() -> None:
    with ReadDeadline(None) as until:
        assert await until.read(asyncio.sleep(0.01, 7)) == 7
