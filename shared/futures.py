"""Futures whose outcome nobody awaits (a call broken on purpose, a prefill started with an
admission that then failed): their exception is marked retrieved, so asyncio does not log it as
lost; the caller reports its own failure instead."""

from __future__ import annotations

import asyncio
from typing import Any


def retrieve_quietly(future: asyncio.Future[Any]) -> None:
    """A done callback: mark the future's exception (if any) retrieved."""
    if not future.cancelled():
        future.exception()
