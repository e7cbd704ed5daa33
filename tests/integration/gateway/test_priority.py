"""Request priority through the gateway and a REAL unified worker (in process, tiny random
Llama): with one slot taken, the waiting requests finish best priority first whatever their
arrival order, whether they wait in the gateway's admission queue (one request served at once)
or in the worker's waiting queue (one sequence decoded at once); over gRPC and HTTP alike.

The scheduler is the stand-in of the HTTP tests, routing every request to the unified worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio

from services.gateway.server import GatewayApp, build_app
from services.worker.server import WorkerApp
from services.worker.settings import WorkerSettings
from shared.cluster import Role
from shared.proto import gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from .conftest import gateway_settings
from .http_stack import Router

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Stack:
    gateway: GatewayApp
    stub: gateway_pb2_grpc.GatewayStub


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["gateway_queue", "worker_queue"])
async def stack(request: pytest.FixtureRequest, tiny_model: Path) -> AsyncIterator[Stack]:
    """gateway_queue: the gateway serves one request at once (the rest wait in its admission
    queue); worker_queue: the gateway admits everything and the worker decodes one sequence at
    once (the rest wait in its scheduler)."""
    in_gateway = request.param == "gateway_queue"
    worker = WorkerApp(
        WorkerSettings(
            role=Role.UNIFIED,
            listen="127.0.0.1:0",
            metrics_port=-1,
            model=str(tiny_model),
            device="cpu",
            dtype="float32",
            block_size=4,
            kv_cache_tokens=4096,
            max_num_seqs=8 if in_gateway else 1,
            torch_threads=1,
            drain_grace_s=1.0,
        )
    )
    await worker.start()
    router = Router(mode="unified")
    router.targets["unified"] = scheduler_pb2.WorkerTarget(worker_id=worker.worker_id, address=worker.address)
    sched = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(router, sched)
    port = sched.add_insecure_port("127.0.0.1:0")
    await sched.start()
    limits = {"max_inflight_requests": 1, "max_queued_requests": 8} if in_gateway else {}
    gateway = build_app(
        gateway_settings(tiny_model, f"127.0.0.1:{port}", block_size=4, http_port=0, **limits)
    )
    await gateway.start()
    channel = grpc.aio.insecure_channel(gateway.server.address)
    try:
        yield Stack(gateway, gateway_pb2_grpc.GatewayStub(channel))
    finally:
        await channel.close()
        await gateway.stop(0)
        await sched.stop(0)
        await worker.stop()


async def test_waiting_requests_finish_best_priority_first(stack: Stack) -> None:
    finished: list[str] = []

    async def grpc_call(name: str, priority: int) -> None:
        req = gateway_pb2.GenerateRequest(
            prompt=f"{name} one two", max_tokens=4, ignore_eos=True, priority=priority
        )
        await stack.stub.Complete(req, timeout=60)
        finished.append(name)

    async def http_call(http: httpx.AsyncClient, name: str, priority: int) -> None:
        body = {"prompt": f"{name} one two", "max_tokens": 4, "ignore_eos": True, "priority": priority}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        finished.append(name)

    # the busy request holds the one slot (it has streamed a token) while the others arrive,
    # the worst first, a second request of equal priority after the first
    busy = stack.stub.Generate(
        gateway_pb2.GenerateRequest(prompt="busy", max_tokens=1000, ignore_eos=True), timeout=60
    )
    first = await anext(aiter(busy))
    assert first.kind == gateway_pb2.FRAME_KIND_FIRST

    async def drain_busy() -> None:
        async for _ in busy:
            pass
        finished.append("busy")

    async with httpx.AsyncClient(base_url=stack.gateway.http_url or "", timeout=60) as http:
        tasks = [asyncio.ensure_future(drain_busy())]
        for name, priority, face in (
            ("batch", 10, "grpc"),
            ("default-1", 0, "http"),
            ("default-2", 0, "grpc"),
            ("urgent", -5, "http"),
        ):
            call = grpc_call(name, priority) if face == "grpc" else http_call(http, name, priority)
            tasks.append(asyncio.ensure_future(call))
            await asyncio.sleep(0.05)  # arrival order
        await asyncio.gather(*tasks)
    assert finished == ["busy", "urgent", "default-1", "default-2", "batch"]
