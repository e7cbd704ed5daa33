"""Calls the load-monitor makes to workers (GetLoad), over its ChannelCache."""

from __future__ import annotations

import grpc

from services.load_monitor import convert
from services.load_monitor.monitor import LoadReport
from shared.channels import ChannelCache
from shared.cluster import WorkerInfo
from shared.cluster_convert import worker_info_from_pb
from shared.grpc_errors import error_from_rpc
from shared.proto import worker_pb2, worker_pb2_grpc


class WorkerLoadClient:
    """`fetch` is the monitor's LoadFetcher; `forget` closes a departed worker's channel."""

    def __init__(self, channels: ChannelCache) -> None:
        self._channels = channels

    async def fetch(self, address: str, timeout_s: float) -> LoadReport:
        """Raises the domain error of a failed GetLoad (e.g. Unavailable, DeadlineExceeded)."""
        stub = worker_pb2_grpc.WorkerStub(self._channels.get(address))
        try:
            reply = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, f"worker {address}") from None
        return convert.load_report_from_pb(reply)

    async def info(self, address: str, timeout_s: float) -> WorkerInfo:
        """The identity the worker at `address` reports (Worker/Info)."""
        stub = worker_pb2_grpc.WorkerStub(self._channels.get(address))
        try:
            reply = await stub.Info(worker_pb2.InfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, f"worker {address}") from None
        return worker_info_from_pb(reply)

    async def forget(self, address: str) -> None:
        await self._channels.forget(address)

    async def close(self) -> None:
        await self._channels.close()
