"""All five services as real gRPC servers in this process, on 127.0.0.1:0, over a tiny model."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.gateway.server import GatewayApp, build_app
from services.gateway.settings import GatewaySettings
from services.load_monitor.server import build as build_load_monitor
from services.load_monitor.settings import Settings as LoadMonitorSettings
from services.scheduler.server import build as build_scheduler
from services.scheduler.settings import Settings as SchedulerSettings
from services.worker.server import WorkerApp
from services.worker.settings import WorkerSettings
from shared.cluster import Role
from shared.proto import scheduler_pb2, scheduler_pb2_grpc
from shared.tracing import server_interceptors


@dataclass
class InProcessStack:
    gateway: GatewayApp
    scheduler: Any
    load_monitor: Any
    workers: list[WorkerApp]

    @property
    def addresses(self) -> dict[str, str]:
        """Service name -> address, one entry per server (workers by role and index)."""
        out = {
            "gateway": self.gateway.server.address,
            "scheduler": self.scheduler.server.address,
            "load_monitor": self.load_monitor.server.address,
        }
        for i, w in enumerate(self.workers):
            out[f"worker{i}:{w.settings.role.value}"] = w.address
        return out


@contextlib.asynccontextmanager
async def five_services(
    model: Path,
    roles: Sequence[str] = ("prefill", "decode"),
    *,
    gateway_overrides: dict[str, Any] | None = None,
    worker_overrides: dict[str, Any] | None = None,
    common_overrides: dict[str, Any] | None = None,
) -> AsyncIterator[InProcessStack]:
    """Load-monitor, scheduler, one worker per role in `roles`, gateway; yields once the scheduler
    sees every worker. `common_overrides` go to every service's settings (e.g. a cluster token)."""
    common = dict(common_overrides or {})
    lm = build_load_monitor(
        LoadMonitorSettings(
            listen="127.0.0.1:0", metrics_port=-1, load_interval_s=0.1, drain_grace_s=0.0, **common
        )
    )
    await lm.start()
    sched = build_scheduler(
        SchedulerSettings(
            listen="127.0.0.1:0",
            metrics_port=-1,
            drain_grace_s=0.0,
            load_monitor_address=lm.server.address,
            **common,
        ),
        server_interceptors(),  # as its main() does
    )
    await sched.start()
    workers = [
        WorkerApp(
            WorkerSettings(
                **{
                    **dict(
                        role=Role(role),
                        listen="127.0.0.1:0",
                        metrics_port=-1,
                        model=str(model),
                        device="cpu",
                        dtype="float32",
                        kv_cache_tokens=2048,
                        torch_threads=1,
                        drain_grace_s=0.0,
                        load_monitor_address=lm.server.address,
                        heartbeat_interval_s=0.2,
                        load_refresh_s=0.2,
                    ),
                    **common,
                    **(worker_overrides or {}),
                }
            )
        )
        for role in roles
    ]
    gateway = build_app(
        GatewaySettings(
            **{
                **dict(
                    listen="127.0.0.1:0",
                    http_port=-1,
                    metrics_port=-1,
                    model=str(model),
                    scheduler_address=sched.server.address,
                    drain_grace_s=0.0,
                ),
                **common,
                **(gateway_overrides or {}),
            }
        )
    )
    started: list[WorkerApp] = []
    try:
        for w in workers:
            await w.start()
            started.append(w)
        await gateway.start()
        await wait_for_workers(sched.server.address, len(workers), common.get("cluster_token"))
        yield InProcessStack(gateway, sched, lm, workers)
    finally:
        await gateway.stop(0)
        for w in started:
            await w.stop()
        await sched.stop(0)
        await lm.stop(0)


async def wait_for_workers(scheduler_address: str, n: int, cluster_token: str | None = None) -> None:
    metadata = (("x-pdserve-cluster-token", cluster_token),) if cluster_token else None
    async with grpc.aio.insecure_channel(scheduler_address) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        for _ in range(1000):
            state = await stub.GetState(scheduler_pb2.GetStateRequest(), metadata=metadata)
            if len(state.workers) >= n:
                return
            await asyncio.sleep(0.02)
    raise RuntimeError(f"the scheduler never saw {n} workers")
