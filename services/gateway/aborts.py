"""Aborting a request on the workers it reached: one Abort per worker address, best effort
(a gone worker's lease frees its KV anyway), kept alive even when the caller is cancelled while
waiting, and collected at shutdown (`wait`)."""

from __future__ import annotations

import asyncio

import structlog

from services.gateway.ports import WorkerClient

log = structlog.get_logger(__name__)


class Aborter:
    def __init__(self, workers: WorkerClient, control_timeout_s: float) -> None:
        self._workers = workers
        self._control_timeout_s = control_timeout_s  # each Abort call's timeout
        self._tasks: set[asyncio.Task[None]] = set()

    async def abort_all(self, addresses: list[str], request_id: str, wait: bool = True) -> None:
        """Abort `request_id` on every address (`wait`: until those calls ended; else they go on
        in the background)."""
        if not addresses:
            return
        tasks = [asyncio.ensure_future(self._abort_one(a, request_id)) for a in addresses]
        for task in tasks:  # keep them alive even if our caller is cancelled while waiting
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if not wait:
            return
        # If our caller is cancelled meanwhile, the aborts go on; wait() collects them.
        await asyncio.shield(asyncio.gather(*tasks))

    async def _abort_one(self, address: str, request_id: str) -> None:
        try:
            found = await asyncio.wait_for(self._workers.abort(address, request_id), self._control_timeout_s)
            log.info("aborted_on_worker", worker=address, found=found)
        except Exception as exc:  # best effort: the worker may be gone; its lease frees the KV
            log.warning("abort_failed", worker=address, error=str(exc) or type(exc).__name__)

    async def wait(self, timeout_s: float) -> None:
        """Let pending Abort calls finish (graceful shutdown)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
