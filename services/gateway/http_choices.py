"""The choices of one HTTP request, run as domain requests side by side: each choice in its own task
(so a drain or a disconnect cancels exactly that request life, which aborts it on its workers),
their frames merged into one stream in arrival order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple

from services.gateway.inputs import GenerateInput
from services.gateway.request import Completion, OutputFrame, OutputFrameKind
from services.gateway.service import GatewayService


class _Event(NamedTuple):
    """One per frame of every choice (a tuple: cheap to build per token)."""

    choice: int  # its index
    frame: OutputFrame | None = None  # None: this choice's stream ended
    error: BaseException | None = None


class ChoiceRun:
    """Start with `stream()` or `complete()`; `cancel()` (idempotent, no await needed) stops every
    choice still running: its request life aborts it on the workers."""

    def __init__(
        self, service: GatewayService, inputs: Sequence[GenerateInput], tasks: set[asyncio.Task[None]]
    ):
        self._service = service
        self._inputs = list(inputs)
        self._tasks: list[asyncio.Task[None]] = []
        self._live = tasks  # owned by the caller: keeps cancelled tasks referenced until they end
        self._events: asyncio.Queue[_Event] = asyncio.Queue()
        self.completions: list[Completion | None] = [None] * len(self._inputs)
        self._finals = 0  # FINAL frames dequeued

    def _spawn(self, coro_index: int, streaming: bool) -> None:
        coro = self._pump(coro_index) if streaming else self._complete(coro_index)
        task = asyncio.ensure_future(coro)
        self._tasks.append(task)
        self._live.add(task)
        task.add_done_callback(self._live.discard)

    async def _pump(self, i: int) -> None:
        try:
            async for frame in self._service.generate(self._inputs[i]):
                self._events.put_nowait(_Event(i, frame))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._events.put_nowait(_Event(i, error=exc))
        else:
            self._events.put_nowait(_Event(i))

    async def _complete(self, i: int) -> None:
        try:
            self.completions[i] = await self._service.complete(self._inputs[i])
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._events.put_nowait(_Event(i, error=exc))
        else:
            self._events.put_nowait(_Event(i))

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def complete(self) -> list[Completion]:
        """Every choice's Completion (the first error, if any, after cancelling the others)."""
        for i in range(len(self._inputs)):
            self._spawn(i, streaming=False)
        try:
            for _ in self._inputs:
                event = await self._events.get()
                if event.error is not None:
                    raise event.error
        finally:
            self.cancel()
        return [c for c in self.completions if c is not None]

    def stream(self) -> None:
        for i in range(len(self._inputs)):
            self._spawn(i, streaming=True)

    async def _next(self) -> _Event:
        event = await self._events.get()
        if event.error is not None:
            raise event.error
        if event.frame is not None and event.frame.kind is OutputFrameKind.FINAL:
            self._finals += 1
        return event

    async def first_frames(self) -> list[tuple[int, OutputFrame]]:
        """Waits until every choice sent its first frame; raises the first error before that (a
        request fails as a whole, with a proper status, while nothing was sent)."""
        started: set[int] = set()
        buffered: list[tuple[int, OutputFrame]] = []
        while len(started) < len(self._inputs):
            event = await self._next()
            if event.frame is not None:  # (an end marker always follows that choice's FINAL frame)
                started.add(event.choice)
                buffered.append((event.choice, event.frame))
        return buffered

    async def rest(self) -> AsyncIterator[tuple[int, OutputFrame]]:
        """The frames after first_frames(), until every choice sent its FINAL frame."""
        while self._finals < len(self._inputs):
            event = await self._next()
            if event.frame is not None:
                yield event.choice, event.frame
