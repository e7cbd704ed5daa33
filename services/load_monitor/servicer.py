"""The LoadMonitor gRPC servicer: convert -> one domain call -> convert."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.load_monitor import convert
from services.load_monitor.monitor import LoadMonitor
from shared import cluster_convert
from shared.errors import InvalidArgument
from shared.proto import load_monitor_pb2, load_monitor_pb2_grpc


class LoadMonitorServicer(load_monitor_pb2_grpc.LoadMonitorServicer):
    def __init__(self, monitor: LoadMonitor) -> None:
        self._monitor = monitor

    async def Register(
        self, request: load_monitor_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> load_monitor_pb2.RegisterResponse:
        if not request.HasField("worker"):
            raise InvalidArgument("worker is required")
        info = cluster_convert.worker_info_from_pb(request.worker)
        return convert.registration_to_pb(await self._monitor.admit(info))

    async def Heartbeat(
        self, request: load_monitor_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> load_monitor_pb2.HeartbeatResponse:
        return load_monitor_pb2.HeartbeatResponse(known=self._monitor.heartbeat(request.worker_id))

    async def Deregister(
        self, request: load_monitor_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> load_monitor_pb2.DeregisterResponse:
        found = await self._monitor.deregister(request.worker_id)
        return load_monitor_pb2.DeregisterResponse(found=found)

    async def GetLoads(
        self, request: load_monitor_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> load_monitor_pb2.LoadSnapshot:
        return cluster_convert.snapshot_to_pb(self._monitor.snapshot())

    async def WatchLoads(
        self, request: load_monitor_pb2.WatchLoadsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[load_monitor_pb2.LoadSnapshot]:
        async for snapshot in self._monitor.watch():
            yield cluster_convert.snapshot_to_pb(snapshot)
