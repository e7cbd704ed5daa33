"""Request priority through the gateway and a REAL unified worker (in process, tiny random
Llama): with one slot taken, the waiting requests finish best priority first whatever their
arrival order, whether they wait in the gateway's admission queue (one request served at once)
or in the worker's waiting queue (one sequence decoded at once, where a strictly better request
preempts the running one); over gRPC and HTTP alike.

The scheduler is the stand-in of the HTTP tests (http_stack), routing every request to the unified
worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from services.worker.engine.rank import Rank
from shared.proto import gateway_pb2

from .http_stack import HttpStack, http_stack

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["gateway_queue", "worker_queue"])
async def stack(request: pytest.FixtureRequest, tiny_model: Path) -> AsyncIterator[HttpStack]:
    """gateway_queue: the gateway serves one request at once (the rest wait in its admission
    queue); worker_queue: the gateway admits everything and the unified worker decodes one
    sequence at once (the rest wait in its scheduler)."""
    in_gateway = request.param == "gateway_queue"
    limits = {"max_inflight_requests": 1, "max_queued_requests": 8} if in_gateway else {}
    async with http_stack(tiny_model, {"max_num_seqs": 8 if in_gateway else 1}, **limits) as served:
        served.router.mode = "unified"
        yield served


# each request's (priority, max_tokens): what tells them apart on the worker
SHAPES = {"busy": (0, 1000), "batch": (10, 4), "default-1": (0, 5), "default-2": (0, 6), "urgent": (-5, 4)}


async def test_waiting_requests_finish_best_priority_first(
    stack: HttpStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the order the worker ends them in (the clients see busy's end only once they have read
    # its 1,000 streamed frames, which on a loaded machine can be after the short requests')
    finished: list[str] = []
    names = {shape: name for name, shape in SHAPES.items()}
    real_finish = Rank.finish

    def finish(rank: Rank, req: Any, *args: Any) -> None:
        finished.append(names.get((req.priority, req.sampling.max_tokens), "?"))
        real_finish(rank, req, *args)

    monkeypatch.setattr(Rank, "finish", finish)

    async def grpc_call(name: str, priority: int) -> None:
        req = gateway_pb2.GenerateRequest(
            prompt=f"{name} one two", max_tokens=SHAPES[name][1], ignore_eos=True, priority=priority
        )
        await stack.stub.Complete(req, timeout=60)

    async def http_call(http: httpx.AsyncClient, name: str, priority: int) -> None:
        body = {
            "prompt": f"{name} one two",
            "max_tokens": SHAPES[name][1],
            "ignore_eos": True,
            "priority": priority,
        }
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text

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
    if stack.gateway.settings.max_inflight_requests == 1:  # busy keeps the gateway's one slot
        assert finished == ["busy", "urgent", "default-1", "default-2", "batch"]
    else:  # the worker preempts busy (priority 0) for urgent; busy resumes first among its equals
        assert finished == ["urgent", "busy", "default-1", "default-2", "batch"]
