"""The KV push client: streams a finished prefill's KV blocks to a decode worker over PushKv."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import structlog

from services.worker import convert
from services.worker.engine.api import KvBlocksChunk
from services.worker.messages import KvPushResult, KvTargetSpec
from shared import errors
from shared.channels import make_channel
from shared.cluster import KvLayout
from shared.cluster_convert import kv_layout_to_pb
from shared.proto import worker_pb2, worker_pb2_grpc

log = structlog.get_logger(__name__)

_MAX_CACHED_CHANNELS = 64
# An evicted channel may still carry a push in flight: let it finish (seconds).
_CLOSE_GRACE_S = 60.0


class GrpcKvPusher:
    """Pushes KV over one cached channel per decode-worker address."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self._timeout_s = timeout_s
        # One channel per decode-worker address, least recently used first.
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Future[None]] = set()

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.pop(address, None)
        if stub is None:
            if len(self._stubs) >= _MAX_CACHED_CHANNELS:  # decode workers come and go
                oldest = next(iter(self._stubs))
                del self._stubs[oldest]
                channel = self._channels.pop(oldest)
                closing = asyncio.ensure_future(channel.close(grace=_CLOSE_GRACE_S))
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
            self._channels[address] = make_channel(address)
            stub = worker_pb2_grpc.WorkerStub(self._channels[address])
        self._stubs[address] = stub  # most recently used last
        return stub

    async def push(
        self,
        request_id: str,
        target: KvTargetSpec,
        layout: KvLayout,
        chunks: Iterator[KvBlocksChunk],
        num_tokens: int,
        first_token_id: int | None,
        generated_tokens: int,
    ) -> KvPushResult:
        """Stream every chunk; the last carries num_tokens, first_token_id, generated_tokens.

        Raises FailedPrecondition (layout mismatch), NotFound (the decode worker no longer knows
        the ticket: the request was aborted there) or Unavailable (anything else)."""
        if not target.address:
            raise errors.InvalidArgument("kv_target.address is required")
        layout_pb = kv_layout_to_pb(layout)
        sent = {"bytes": 0, "chunks": 0}
        last_fields = (num_tokens, first_token_id, generated_tokens)

        export_error: list[BaseException] = []

        async def messages() -> AsyncIterator[worker_pb2.KvChunk]:
            # One chunk of lookahead, so the last real chunk carries last=True.
            pending: KvBlocksChunk | None = None
            try:
                for chunk in chunks:
                    if pending is not None:
                        yield self._count(sent, convert.kv_chunk_to_pb(
                            request_id, target, layout_pb, pending))
                    pending = chunk
            except Exception as exc:  # grpc would swallow it: end the stream unfinished, re-raise
                export_error.append(exc)
                return
            if pending is None:  # everything was skipped: an empty last chunk closes the import
                pending = KvBlocksChunk(first_block=target.skip_blocks, num_blocks=0, data=b"")
            yield self._count(sent, convert.kv_chunk_to_pb(
                request_id, target, layout_pb, pending, last=last_fields))

        start = time.perf_counter()
        try:
            await self._stub(target.address).PushKv(messages(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            if export_error:
                raise export_error[0] from exc
            raise _push_error(exc, target, request_id) from exc
        if export_error:
            raise export_error[0]
        return KvPushResult(
            bytes_sent=sent["bytes"], num_chunks=sent["chunks"],
            seconds=time.perf_counter() - start,
        )

    @staticmethod
    def _count(sent: dict[str, int], pb: worker_pb2.KvChunk) -> worker_pb2.KvChunk:
        sent["bytes"] += len(pb.data)
        sent["chunks"] += 1
        return pb

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        self._closing.clear()
        self._channels.clear()
        self._stubs.clear()


def _push_error(exc: grpc.aio.AioRpcError, target: KvTargetSpec, request_id: str) -> Exception:
    code, details = exc.code(), exc.details() or ""
    where = f"KV push of request {request_id!r} to {target.address} rank {target.dp_rank}"
    log.warning("kv_push_failed", target=target.address, code=code.name, details=details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return errors.FailedPrecondition(f"{where} refused: {details}")
    if code == grpc.StatusCode.NOT_FOUND:
        return errors.NotFound(f"{where}: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.InvalidArgument(f"{where} rejected: {details}")
    return errors.Unavailable(f"{where} failed: {code.name}: {details}")
