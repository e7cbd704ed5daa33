"""The scheduler's subscription to the load-monitor's WatchLoads stream: every snapshot goes to the
router; when the stream breaks, the router is marked stale (it keeps routing on the last snapshot)
and the watcher reconnects with exponential backoff."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import structlog

from services.scheduler.router import Router
from shared.channels import ChannelCache
from shared.cluster_convert import snapshot_from_pb
from shared.proto import load_monitor_pb2, load_monitor_pb2_grpc

log = structlog.get_logger(__name__)


class LoadWatcher:
    def __init__(
        self,
        channels: ChannelCache,
        address: str,
        router: Router,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
    ) -> None:
        self._channels = channels
        self.address = address
        self._router = router
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()  # set while the stream delivers snapshots
        self.snapshots_received = 0
        self._skipped: set[str] = set()  # worker ids left out of the last snapshot (logged once)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="watch-loads")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        backoff_s = self._backoff_initial_s
        down_since_logged = False
        while True:
            try:
                stub = load_monitor_pb2_grpc.LoadMonitorStub(self._channels.get(self.address))
                call = stub.WatchLoads(load_monitor_pb2.WatchLoadsRequest())
                async for pb in call:
                    snapshot, skipped = snapshot_from_pb(pb)
                    if skipped and set(skipped) != self._skipped:
                        log.warning("workers_ignored", worker_ids=skipped, reason="unusable entry")
                    self._skipped = set(skipped)
                    self._router.apply_snapshot(snapshot)
                    self.snapshots_received += 1
                    if not self.connected.is_set():
                        self.connected.set()
                        log.info("load_monitor_connected", address=self.address)
                        down_since_logged = False
                    backoff_s = self._backoff_initial_s
                error = "stream ended"
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            except Exception as exc:  # a snapshot that does not convert, ...
                log.exception("load_snapshot_rejected")
                error = str(exc) or type(exc).__name__
            self.connected.clear()
            self._router.mark_stale()
            if not down_since_logged:
                log.warning(
                    "load_monitor_unreachable",
                    address=self.address,
                    error=error,
                    routing="last snapshot, marked stale",
                )
                down_since_logged = True
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self._backoff_max_s)
