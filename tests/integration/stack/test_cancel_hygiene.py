"""Cancelled and deadline-expired streams over a real in-process stack: their clean-up runs in the
call's own task (no `Failed to detach context` tracebacks), they end as aborted (logged with a
finish reason, counted in pdserve_requests_total) and every KV block is freed."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import pytest

from shared.proto import gateway_pb2, gateway_pb2_grpc
from shared.tracing import configure_tracing
from tests.support.inproc import five_services
from tests.support.prom import sample_total
from tests.support.tiny_models import build_tiny_model


def _aborted_total() -> float:
    return sample_total("pdserve_requests_total", finish_reason="abort")


async def test_cancelled_and_expired_streams_end_cleanly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    configure_tracing("cancel-tests", {})  # the server interceptors then open real spans
    model = build_tiny_model(tmp_path / "tiny", "bpe")
    caplog.set_level(logging.ERROR)
    before = _aborted_total()
    cancels, expired = 8, 4
    async with five_services(model) as stack:
        async with grpc.aio.insecure_channel(stack.gateway.server.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            req = gateway_pb2.GenerateRequest(
                prompt="cancel me " * 4, max_tokens=200, ignore_eos=True, temperature=0
            )
            for _ in range(cancels):
                call = stub.Generate(req)
                seen = 0
                async for _frame in call:
                    seen += 1
                    if seen == 2:
                        call.cancel()
                        break
            # Long enough that none can finish inside its deadline, however fast the machine is
            # (200 tokens of the tiny model sometimes did, and the test failed).
            long_req = gateway_pb2.GenerateRequest(
                prompt="cancel me " * 4, max_tokens=1500, ignore_eos=True, temperature=0
            )
            for i in range(expired):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _frame in stub.Generate(long_req, timeout=0.1 + 0.1 * i):
                        pass
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(200):  # aborts reach the workers just after the client's call ended
            used = [load.num_used_tokens for w in stack.workers for load in w.core.rank_loads()]  # type: ignore[union-attr]
            if _aborted_total() - before >= cancels + expired and not any(used):
                break
            await asyncio.sleep(0.05)
    detach = [r for r in caplog.records if "Failed to detach context" in r.getMessage()]
    assert not detach, f"{len(detach)} 'Failed to detach context' errors"
    assert _aborted_total() - before == cancels + expired
    assert not any(used), f"KV still in use after every request ended: {used}"
