"""Membership in the load-monitor: Register, heartbeat (re-register when forgotten), Deregister.

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

    @property
    def _stub(self) -> load_monitor_pb2_grpc.LoadMonitorStub:
        return load_monitor_pb2_grpc.LoadMonitorStub(self._channels.get(self._address))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="load-monitor-registration")

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
                if self.worker_id is None:
                    interval_s = await self._register()
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
                await asyncio.sleep(interval_s)
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
                await asyncio.sleep(self._retry_s if self.worker_id is None else interval_s)

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
