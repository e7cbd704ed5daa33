"""Membership in the load-monitor: Register, heartbeat (re-register when forgotten), Deregister,
and Register again at once when the worker's identity changed (LoRA adapters loaded or unloaded
while it runs: `update`).

The load-monitor being down never stops the worker: registration is retried in the background.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import structlog

from shared.channels import ChannelCache
from shared.proto import common_pb2, load_monitor_pb2, load_monitor_pb2_grpc

log = structlog.get_logger(__name__)

_RPC_TIMEOUT_S = 5.0
_DEFAULT_HEARTBEAT_S = 2.0


class Registration:
    """Runs the register/heartbeat loop for one WorkerInfo until `deregister`."""

    def __init__(
        self,
        channels: ChannelCache,
        address: str,
        info: common_pb2.WorkerInfo,
        heartbeat_interval_s: float = 0.0,
        retry_s: float = 2.0,
    ) -> None:
        self._channels = channels
        self._address = address
        self._info = info
        self._heartbeat_override_s = heartbeat_interval_s
        self._retry_s = retry_s
        self._task: asyncio.Task[None] | None = None
        self.worker_id: str | None = None  # set while registered
        self._attempted = False  # a Register was sent at least once
        self.registered = asyncio.Event()
        # the info changed since the load-monitor last accepted it: Register again (not Heartbeat)
        self._changed = False
        self._wake = asyncio.Event()  # cuts the loop's sleep short (an update)

    @property
    def _stub(self) -> load_monitor_pb2_grpc.LoadMonitorStub:
        return load_monitor_pb2_grpc.LoadMonitorStub(self._channels.get(self._address))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="load-monitor-registration")

    def update(self, info: common_pb2.WorkerInfo) -> None:
        """Register `info` in place of the registered one, at once and then on every retry until
        the load-monitor accepts it (it replaces the member of the same id, so the scheduler's
        pools follow). The load-monitor checks it against Info, which must already say the same:
        a refusal because a later change got there first is retried with the latest info."""
        self._info = info
        self._changed = True
        self._wake.set()

    async def _sleep(self, seconds: float) -> None:
        """Sleep `seconds`, or less when `update` wakes the loop."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()

    async def _register(self) -> float:
        """Register once; returns the heartbeat period (seconds)."""
        self._attempted = True
        resp = await self._stub.Register(
            load_monitor_pb2.RegisterRequest(worker=self._info), timeout=_RPC_TIMEOUT_S
        )
        self.worker_id = resp.worker_id or self._info.worker_id
        self.registered.set()
        interval_s = self._heartbeat_override_s or (resp.heartbeat_interval_ms / 1000.0)
        if interval_s <= 0:
            interval_s = _DEFAULT_HEARTBEAT_S
        log.info(
            "registered",
            load_monitor=self._address,
            worker_id=self.worker_id,
            lease_ttl_ms=resp.lease_ttl_ms,
            heartbeat_interval_s=interval_s,
        )
        return interval_s

    async def _run(self) -> None:
        interval_s = _DEFAULT_HEARTBEAT_S
        failures = 0
        while True:
            try:
                if self.worker_id is None or self._changed:
                    changed, self._changed = self._changed, False
                    try:
                        interval_s = await self._register()
                    except BaseException:
                        self._changed = self._changed or changed  # still to tell
                        raise
                else:
                    resp = await self._stub.Heartbeat(
                        load_monitor_pb2.HeartbeatRequest(worker_id=self.worker_id),
                        timeout=_RPC_TIMEOUT_S,
                    )
                    if not resp.known:
                        log.warning("lease_lost_reregistering", worker_id=self.worker_id)
                        self.worker_id = None
                        self.registered.clear()
                        continue
                if failures:
                    log.info("load_monitor_reachable_again", load_monitor=self._address)
                failures = 0
                await self._sleep(interval_s)
            except Exception as exc:  # never let membership die: retry whatever went wrong
                failures += 1
                # Log the first failure and then every 10th, not a line per retry.
                if failures == 1 or failures % 10 == 0:
                    if isinstance(exc, grpc.aio.AioRpcError):
                        log.warning(
                            "load_monitor_unreachable",
                            load_monitor=self._address,
                            code=exc.code().name,
                            details=exc.details(),
                            attempts=failures,
                        )
                    else:
                        log.exception(
                            "load_monitor_call_failed", load_monitor=self._address, attempts=failures
                        )
                retry = self.worker_id is None or self._changed
                await self._sleep(self._retry_s if retry else interval_s)

    async def deregister(self) -> None:
        """Stop heartbeating and leave the cluster (best effort)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        # Also when a Register was cut short by the cancel: the load-monitor may know us.
        worker_id = self.worker_id or (self._info.worker_id if self._attempted else None)
        if worker_id is not None:
            try:
                resp = await self._stub.Deregister(
                    load_monitor_pb2.DeregisterRequest(worker_id=worker_id),
                    timeout=_RPC_TIMEOUT_S,
                )
                log.info("deregistered", worker_id=worker_id, found=resp.found)
            except grpc.aio.AioRpcError as exc:
                log.warning("deregister_failed", code=exc.code().name, details=exc.details())
            self.worker_id = None
            self.registered.clear()
