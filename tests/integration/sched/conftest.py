"""A real load-monitor and scheduler in process on 127.0.0.1:0, with real channels."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from services.load_monitor.server import LoadMonitorApp
from services.load_monitor.server import build as build_load_monitor
from services.load_monitor.settings import Settings as LoadMonitorSettings
from services.scheduler.server import SchedulerApp
from services.scheduler.server import build as build_scheduler
from services.scheduler.settings import Settings as SchedulerSettings
from shared.proto import load_monitor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.integration.sched.fakes import FakeWorker

LOAD_INTERVAL_S = 0.2


def load_monitor_settings(**kw: Any) -> LoadMonitorSettings:
    values: dict[str, Any] = dict(
        listen="127.0.0.1:0",
        metrics_port=-1,
        load_interval_s=LOAD_INTERVAL_S,
        lease_ttl_s=3.0,
        stale_after_s=1.0,
        drain_grace_s=0.0,
    )
    values.update(kw)
    return LoadMonitorSettings(**values)


@dataclass
class Cluster:
    load_monitor: LoadMonitorApp
    scheduler: SchedulerApp
    scheduler_stub: scheduler_pb2_grpc.SchedulerStub
    load_monitor_stub: load_monitor_pb2_grpc.LoadMonitorStub
    workers: list[FakeWorker]
    channels: list[grpc.aio.Channel]

    async def add_worker(self, **kw: Any) -> FakeWorker:
        w = FakeWorker(**kw)
        await w.start(self.load_monitor.server.address)
        self.workers.append(w)
        return w

    async def state(self) -> scheduler_pb2.GetStateResponse:
        return await self.scheduler_stub.GetState(scheduler_pb2.GetStateRequest(), timeout=5)

    async def wait_state(
        self, predicate: Callable[[scheduler_pb2.GetStateResponse], bool], timeout_s: float = 10.0
    ) -> scheduler_pb2.GetStateResponse:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            state = await self.state()
            if predicate(state):
                return state
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"scheduler state never matched; last: {state}")
            await asyncio.sleep(0.02)

    async def wait_workers(self, n: int) -> scheduler_pb2.GetStateResponse:
        return await self.wait_state(lambda s: len(s.workers) == n)


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    lm = build_load_monitor(load_monitor_settings())
    await lm.start()
    sched = build_scheduler(
        SchedulerSettings(
            listen="127.0.0.1:0",
            metrics_port=-1,
            load_monitor_address=lm.server.address,
            seed=1,
            watch_backoff_max_s=0.2,
            drain_grace_s=0.0,
            # the fake workers are unified and cannot push KV: every request aggregated
            unified_disaggregate_threshold=0,
        )
    )
    await sched.start()
    s_channel = grpc.aio.insecure_channel(sched.server.address)
    l_channel = grpc.aio.insecure_channel(lm.server.address)
    c = Cluster(
        lm,
        sched,
        scheduler_pb2_grpc.SchedulerStub(s_channel),
        load_monitor_pb2_grpc.LoadMonitorStub(l_channel),
        [],
        [s_channel, l_channel],
    )
    try:
        yield c
    finally:
        for w in c.workers:
            await w.stop()
        for ch in c.channels:
            await ch.close()
        await c.scheduler.stop()
        await c.load_monitor.stop()
