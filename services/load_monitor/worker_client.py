"""Calls the load-monitor makes to workers (GetLoad), one cached channel per worker address."""

from __future__ import annotations

import grpc

from services.load_monitor import convert
from services.load_monitor.monitor import LoadReport
from shared.channels import make_channel
from shared.proto import worker_pb2, worker_pb2_grpc


class WorkerLoadClient:
    """`fetch` is the monitor's LoadFetcher; `forget` closes a departed worker's channel."""

    def __init__(self) -> None:
        self._channels: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerStub]] = {}

    async def fetch(self, address: str, timeout_s: float) -> LoadReport:
        entry = self._channels.get(address)
        if entry is None:
            channel = make_channel(address)
            entry = (channel, worker_pb2_grpc.WorkerStub(channel))
            self._channels[address] = entry
        reply = await entry[1].GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout_s)
        return convert.load_report_from_pb(reply)

    async def forget(self, address: str) -> None:
        entry = self._channels.pop(address, None)
        if entry is not None:
            await entry[0].close()

    async def close(self) -> None:
        for address in list(self._channels):
            await self.forget(address)
