"""The KV push client over the worker's ChannelCache: a decode worker's refusal keeps its meaning
(layout, ticket, input); any other failure is Unavailable, naming the decode worker."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.worker.engine.api import KvBlocksChunk
from services.worker.kv_transfer import GrpcKvPusher
from services.worker.messages import KvTargetSpec
from shared import errors
from shared.channels import ChannelCache
from shared.cluster import KvLayout
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.server import Server

LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")
ERRORS = {
    "layout": errors.FailedPrecondition("KV layout mismatch"),
    "ticket": errors.NotFound("unknown transfer ticket"),
    "full": errors.ResourceExhausted("KV pool is full"),
}


class RefusingDecodeWorker(worker_pb2_grpc.WorkerServicer):
    async def PushKv(
        self, request_iterator: AsyncIterator[worker_pb2.KvChunk], context: object
    ) -> worker_pb2.PushKvResponse:
        async for chunk in request_iterator:
            raise ERRORS[chunk.request_id]
        return worker_pb2.PushKvResponse()


@pytest.fixture
async def decode_address() -> AsyncIterator[str]:
    server = Server("127.0.0.1:0", ["pdserve.v1.Worker"])
    worker_pb2_grpc.add_WorkerServicer_to_server(RefusingDecodeWorker(), server.grpc)
    await server.start()
    yield server.address
    await server.stop(0)


async def push(channels: ChannelCache, address: str, request_id: str) -> None:
    pusher = GrpcKvPusher(channels, timeout_s=5)
    target = KvTargetSpec(address=address, dp_rank=0, transfer_ticket="t", skip_blocks=0)
    chunks = iter([KvBlocksChunk(first_block=0, num_blocks=1, data=b"\0" * 64)])
    await pusher.push(request_id, target, LAYOUT, chunks, 4, 7, 1)


@pytest.mark.parametrize(
    ("request_id", "expected"),
    [("layout", errors.FailedPrecondition), ("ticket", errors.NotFound), ("full", errors.Unavailable)],
)
async def test_refusals(decode_address: str, request_id: str, expected: type[Exception]) -> None:
    channels = ChannelCache(tls=None)
    try:
        with pytest.raises(expected) as exc:
            await push(channels, decode_address, request_id)
        assert f"decode worker {decode_address} (KV push of request {request_id!r}, rank 0)" in str(exc.value)
        assert str(ERRORS[request_id]) in str(exc.value)
        assert decode_address in channels  # dialed through the worker's cache
    finally:
        await channels.close()


async def test_unreachable_decode_worker_is_unavailable() -> None:
    channels = ChannelCache(tls=None)
    try:
        with pytest.raises(errors.Unavailable, match="failed with UNAVAILABLE"):
            await push(channels, "127.0.0.1:1", "r")
    finally:
        await channels.close()
