"""Domain errors become the right status over a real gRPC server; unknown errors are generic INTERNAL;
a client maps a peer's status back to the same domain error."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared import errors
from shared.grpc_errors import (
    ERROR_BY_STATUS,
    GENERIC_INTERNAL_MESSAGE,
    STATUS_BY_ERROR,
    error_from_rpc,
    error_from_status,
    status_for,
)
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


# --- the client side: a peer's status back to the domain error -----------------------------------

CLASS_BY_NAME = {cls.__name__: cls for cls in STATUS_BY_ERROR}


class RaisingWorker(worker_pb2_grpc.WorkerServicer):
    """Abort(request_id=<class name>) raises that domain error; anything else a RuntimeError."""

    async def Abort(self, request: worker_pb2.AbortRequest, context: object) -> worker_pb2.AbortResponse:
        cls = CLASS_BY_NAME.get(request.request_id)
        if cls is None:
            raise RuntimeError("secret internal detail")
        raise cls(f"{request.request_id} happened")


@pytest.fixture
async def raising_address() -> AsyncIterator[str]:
    srv = Server("127.0.0.1:0", ["pdserve.v1.Worker"])
    worker_pb2_grpc.add_WorkerServicer_to_server(RaisingWorker(), srv.grpc)
    await srv.start()
    yield srv.address
    await srv.stop(0)


async def _failed_call(address: str, request_id: str) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await worker_pb2_grpc.WorkerStub(channel).Abort(worker_pb2.AbortRequest(request_id=request_id))
    return exc.value


@pytest.mark.parametrize("cls", list(STATUS_BY_ERROR), ids=lambda c: c.__name__)
async def test_a_domain_error_crosses_a_service_boundary_as_itself(
    raising_address: str, cls: type[errors.PdserveError]
) -> None:
    error = error_from_rpc(await _failed_call(raising_address, cls.__name__), "worker w1")
    assert type(error) is cls
    assert "worker w1" in str(error)  # names the peer
    if cls not in (errors.DeadlineExceeded, errors.Cancelled):  # these say what happened instead
        assert f"{cls.__name__} happened" in str(error)  # and keeps its message
    assert status_for(error)[0] == STATUS_BY_ERROR[cls]  # relayed with the same status


async def test_a_peer_internal_error_stays_internal_and_generic(raising_address: str) -> None:
    exc = await _failed_call(raising_address, "other")
    error = error_from_rpc(exc, "worker w1")
    assert type(error) is errors.PdserveError
    assert str(error) == f"worker w1 failed with INTERNAL: {GENERIC_INTERNAL_MESSAGE}"
    assert status_for(error) == (grpc.StatusCode.INTERNAL, GENERIC_INTERNAL_MESSAGE)


def test_every_status_of_a_domain_class_maps_back() -> None:
    assert {ERROR_BY_STATUS[code] for code in STATUS_BY_ERROR.values()} == set(STATUS_BY_ERROR)


@pytest.mark.parametrize(
    ("code", "expected", "message"),
    [
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable, "d1 is unavailable (draining)"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted, "d1 is out of capacity (draining)"),
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument, "rejected by d1: draining"),
        (grpc.StatusCode.NOT_FOUND, errors.NotFound, "d1: draining"),
        (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            errors.DeadlineExceeded,
            "the request ran past its deadline at d1",
        ),
        (grpc.StatusCode.CANCELLED, errors.Cancelled, "d1 cancelled the request"),
        (grpc.StatusCode.DATA_LOSS, errors.PdserveError, "d1 failed with DATA_LOSS: draining"),
    ],
)
def test_status_messages(code: grpc.StatusCode, expected: type[errors.PdserveError], message: str) -> None:
    error = error_from_status(code, "draining", "d1")
    assert type(error) is expected and str(error) == message


def test_only_kept_statuses_keep_their_class() -> None:
    keep = {grpc.StatusCode.NOT_FOUND}
    kept = error_from_status(
        grpc.StatusCode.NOT_FOUND, "no ticket", "d1", keep=keep, otherwise=errors.Unavailable
    )
    other = error_from_status(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "full", "d1", keep=keep, otherwise=errors.Unavailable
    )
    assert type(kept) is errors.NotFound
    assert type(other) is errors.Unavailable and str(other) == "d1 failed with RESOURCE_EXHAUSTED: full"
