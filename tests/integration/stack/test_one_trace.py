"""One trace per request across every hop, over real in-process servers of all five services:
gateway -> scheduler -> prefill worker -> KV push -> decode worker, with an in-memory exporter."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.gateway.server import GatewayApp, build_app
from services.gateway.settings import GatewaySettings
from services.load_monitor.server import build as build_load_monitor
from services.load_monitor.settings import Settings as LoadMonitorSettings
from services.scheduler.server import build as build_scheduler
from services.scheduler.settings import Settings as SchedulerSettings
from services.worker.server import WorkerApp
from services.worker.settings import WorkerSettings
from shared.cluster import Role
from shared.proto import gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from shared.tracing import configure_tracing, server_interceptors
from tests.support.tiny_models import build_tiny_model


def _attr(span: Any, key: str) -> Any:
    """One attribute of a finished span (the SDK types them as a union of every attribute type)."""
    return dict(span.attributes or {})[key]


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    configure_tracing("stack-tests", {}, exporter=exp)  # before any server is built
    return exp


@contextlib.asynccontextmanager
async def five_services(model: Path) -> AsyncIterator[GatewayApp]:
    lm = build_load_monitor(
        LoadMonitorSettings(listen="127.0.0.1:0", metrics_port=-1, load_interval_s=0.1, drain_grace_s=0.0)
    )
    await lm.start()
    sched = build_scheduler(
        SchedulerSettings(
            listen="127.0.0.1:0", metrics_port=-1, drain_grace_s=0.0, load_monitor_address=lm.server.address
        ),
        server_interceptors(),  # as its main() does
    )
    await sched.start()
    workers = [
        WorkerApp(
            WorkerSettings(
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
            )
        )
        for role in ("prefill", "decode")
    ]
    gateway = build_app(
        GatewaySettings(
            listen="127.0.0.1:0",
            http_port=-1,
            metrics_port=-1,
            model=str(model),
            scheduler_address=sched.server.address,
            drain_grace_s=0.0,
        )
    )
    try:
        for w in workers:
            await w.start()
        await gateway.start()
        async with grpc.aio.insecure_channel(sched.server.address) as ch:
            for _ in range(500):
                state = await scheduler_pb2_grpc.SchedulerStub(ch).GetState(scheduler_pb2.GetStateRequest())
                if len(state.workers) == 2:
                    break
                await asyncio.sleep(0.02)
        yield gateway
    finally:
        await gateway.stop(0)
        for w in workers:
            await w.stop()
        await sched.stop(0)
        await lm.stop(0)


def _ancestors(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[str]:
    names = []
    parent = span.parent
    while parent is not None and parent.span_id in by_id:
        names.append(by_id[parent.span_id].name)
        parent = by_id[parent.span_id].parent
    return names


async def test_one_trace_with_every_hop_in_parent_order(
    exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    model = build_tiny_model(tmp_path / "tiny", "bpe")
    async with five_services(model) as gateway:
        exporter.clear()
        async with grpc.aio.insecure_channel(gateway.server.address) as ch:
            req = gateway_pb2.GenerateRequest(
                prompt="Tracing every hop " * 3, max_tokens=6, temperature=0, ignore_eos=True
            )
            frames = [f async for f in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60)]
    assert frames[-1].usage.completion_tokens == 6
    for _ in range(100):  # client spans of streams end when the call is closed, just after the reply
        spans = exporter.get_finished_spans()
        (root,) = [s for s in spans if s.name == "generate"]
        trace_id = root.context.trace_id
        mine = [s for s in spans if s.context.trace_id == trace_id]
        by_id = {s.context.span_id: s for s in mine}
        if all(s.parent is None or s.parent.span_id in by_id for s in mine if s is not by_id.get(0)):
            break
        await asyncio.sleep(0.05)
    assert [s.name for s in mine if s.parent is None] == ["/pdserve.v1.Gateway/Generate"], (
        "one root per request"
    )

    names = {s.name for s in mine}
    for expected in (
        "schedule",
        "prefill",
        "kv_transfer",
        "decode",
        "/pdserve.v1.Scheduler/Schedule",
        "/pdserve.v1.Worker/Prefill",
        "/pdserve.v1.Worker/PushKv",
        "/pdserve.v1.Worker/Decode",
    ):
        assert expected in names, f"{expected} missing from the request's trace: {sorted(names)}"
    span = {n: next(s for s in mine if s.name == n) for n in names}
    assert _ancestors(span["schedule"], by_id)[:1] == ["generate"]
    assert _ancestors(root, by_id) == ["/pdserve.v1.Gateway/Generate"]  # the server span of the call
    assert "schedule" in _ancestors(span["/pdserve.v1.Scheduler/Schedule"], by_id)
    assert "prefill" in _ancestors(span["kv_transfer"], by_id)
    assert "kv_transfer" in _ancestors(span["/pdserve.v1.Worker/PushKv"], by_id)
    for name in ("prefill", "decode"):
        assert "generate" in _ancestors(span[name], by_id)
    assert _attr(span["prefill"], "pdserve.num_chunks") >= 1
    assert _attr(span["kv_transfer"], "pdserve.bytes") > 0
    assert _attr(span["decode"], "pdserve.tokens") == 5  # 6 generated, the first one by prefill
