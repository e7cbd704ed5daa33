"""serve_until_stopped: a signal while getting ready stops at once; a signal while serving runs
on_stop_requested before health turns NOT_SERVING, then drains and stops."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.server import Server, serve_until_stopped


def _sigterm_soon() -> None:
    asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)


async def test_signal_while_getting_ready_cancels_it_and_stops() -> None:
    server = Server("127.0.0.1:0", ["pdserve.v1.Worker"])
    calls: list[str] = []

    async def on_ready() -> None:  # a model that takes forever to load
        calls.append("ready_started")
        _sigterm_soon()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            calls.append("ready_cancelled")
            raise

    async def on_drain() -> None:
        calls.append("drained")

    await asyncio.wait_for(serve_until_stopped(server, on_ready, on_drain, grace_s=0), 10)
    assert calls == ["ready_started", "ready_cancelled"]  # nothing served: nothing to drain
    async with grpc.aio.insecure_channel(server.address) as channel:  # and the server is down
        with pytest.raises(grpc.aio.AioRpcError):
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)


async def test_stop_request_comes_before_not_serving() -> None:
    server = Server("127.0.0.1:0", ["pdserve.v1.Worker"])
    calls: list[str] = []
    set_serving = server.set_serving

    async def recording_set_serving(serving: bool) -> None:
        calls.append(f"serving={serving}")
        await set_serving(serving)

    server.set_serving = recording_set_serving  # type: ignore[method-assign]

    async def on_ready() -> None:
        calls.append("ready")
        _sigterm_soon()

    async def on_drain() -> None:
        calls.append("drain")

    await asyncio.wait_for(
        serve_until_stopped(
            server, on_ready, on_drain, grace_s=0, on_stop_requested=lambda: calls.append("refuse_new")
        ),
        10,
    )
    assert calls == ["serving=False", "ready", "serving=True", "refuse_new", "serving=False", "drain"]
