"""Domain errors become the right status over a real gRPC server; unknown errors are generic INTERNAL."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared import errors
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.server import Server


class FailingWorker(worker_pb2_grpc.WorkerServicer):
    async def Abort(self, request: worker_pb2.AbortRequest, context: object) -> worker_pb2.AbortResponse:
        if request.request_id == "bad":
            raise errors.InvalidArgument("request_id 'bad' is not allowed")
        if request.request_id == "full":
            raise errors.ResourceExhausted("KV pool is full")
        raise RuntimeError("secret internal detail")

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: object
    ) -> AsyncIterator[worker_pb2.DecodeFrame]:
        yield worker_pb2.DecodeFrame(request_id=request.request_id)
        raise errors.Unavailable("draining")


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    srv = Server("127.0.0.1:0", ["pdserve.v1.Worker"])
    worker_pb2_grpc.add_WorkerServicer_to_server(FailingWorker(), srv.grpc)
    await srv.start()
    yield srv
    await srv.stop(0)


@pytest.mark.parametrize(
    ("request_id", "code", "message"),
    [
        ("bad", grpc.StatusCode.INVALID_ARGUMENT, "request_id 'bad' is not allowed"),
        ("full", grpc.StatusCode.RESOURCE_EXHAUSTED, "KV pool is full"),
        ("other", grpc.StatusCode.INTERNAL, "internal error; see the server log"),
    ],
)
async def test_unary_errors_map_to_status(
    server: Server, request_id: str, code: grpc.StatusCode, message: str
) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await worker_pb2_grpc.WorkerStub(channel).Abort(worker_pb2.AbortRequest(request_id=request_id))
    assert exc.value.code() == code
    assert exc.value.details() == message


async def test_stream_error_after_frames(server: Server) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Decode(worker_pb2.DecodeRequest(request_id="r"))
        frames = []
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for frame in call:
                frames.append(frame)
    assert [f.request_id for f in frames] == ["r"]
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_health_starts_not_serving_then_serving(server: Server) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        before = await stub.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Worker"))
        await server.set_serving(True)
        after = await stub.Check(health_pb2.HealthCheckRequest(service=""))
    assert before.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert after.status == health_pb2.HealthCheckResponse.SERVING
