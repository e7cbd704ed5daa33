"""Overload over a real in-process stack: beyond the gateway's in-flight and queue bounds a call is
refused at once with RESOURCE_EXHAUSTED and a retry hint; admitted calls complete."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from shared.grpc_errors import RETRY_AFTER_MS_KEY
from shared.proto import gateway_pb2, gateway_pb2_grpc
from tests.support.inproc import five_services
from tests.support.tiny_models import build_tiny_model


async def test_overload_is_refused_with_resource_exhausted_not_queued_forever(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", "bpe")
    bounds = {"max_inflight_requests": 2, "max_queued_requests": 1, "max_queue_wait_s": 60.0}
    async with (
        five_services(model, gateway_overrides=bounds) as stack,
        grpc.aio.insecure_channel(stack.gateway.server.address) as ch,
    ):
        stub = gateway_pb2_grpc.GatewayStub(ch)
        req = gateway_pb2.GenerateRequest(prompt="busy busy", max_tokens=120, ignore_eos=True)
        started = [asyncio.Event() for _ in range(2)]

        async def long_stream(i: int) -> int:
            n = 0
            async for _ in stub.Generate(req, timeout=120):
                n += 1
                if i < 2 and n == 1:
                    started[i].set()
            return n

        running = [asyncio.ensure_future(long_stream(i)) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        queued = asyncio.ensure_future(long_stream(2))  # takes the one queue place
        while stack.gateway.service.admission.num_queued < 1:
            await asyncio.sleep(0.01)
        refused = []
        for _ in range(4):
            call = stub.Complete(req, timeout=120)
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                refused.append(exc)
        assert len(refused) == 4
        for error in refused:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "at capacity" in (error.details() or "")
            trailing = dict(error.trailing_metadata() or ())
            assert int(trailing[RETRY_AFTER_MS_KEY]) > 0
        counts = await asyncio.gather(*running, queued)
    assert all(c >= 1 for c in counts), counts  # the admitted and the queued ones completed
