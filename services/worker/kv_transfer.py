"""The sending side of the KV transports: the PushKv stream (KvPushStream) and the gRPC push (a
finished prefill's KV blocks streamed to the decode worker over PushKv; every version speaks it).
A prefill in several chunks starts at its first chunk (EarlyKvPush); else everything goes at the
end. NIXL's sending side (PushKv messages with the blocks' descriptors; the decode worker READs
them) is kv_send_nixl.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import structlog

from services.worker import convert
from services.worker.engine.api import Engine, KvBlocksChunk
from services.worker.messages import KvHandoff, KvPusher, KvPushResult, KvTargetSpec
from shared import errors
from shared.channels import ChannelCache
from shared.cluster import KvLayout, KvTransport
from shared.cluster_convert import kv_layout_to_pb
from shared.futures import retrieve_quietly
from shared.grpc_errors import error_from_rpc
from shared.proto import worker_pb2, worker_pb2_grpc

log = structlog.get_logger(__name__)


# What a decode worker's refusal of a push means for this request; any other failure (it is
# unreachable, draining, full, slow) is Unavailable: the gateway may retry on other workers.
_KEPT_STATUSES = (
    grpc.StatusCode.FAILED_PRECONDITION,  # layout mismatch
    grpc.StatusCode.NOT_FOUND,  # the ticket is gone: the request was aborted there
    grpc.StatusCode.INVALID_ARGUMENT,
)


class GrpcKvPusher:
    """Pushes KV over the worker's channels (a ChannelCache bounded for decode workers that come
    and go)."""

    def __init__(self, channels: ChannelCache, timeout_s: float = 60.0) -> None:
        self._channels = channels
        self._timeout_s = timeout_s

    async def push(
        self,
        request_id: str,
        target: KvTargetSpec,
        layout: KvLayout,
        chunks: Iterator[KvBlocksChunk],
        num_tokens: int,
        first_token_id: int | None,
        generated_tokens: int,
        draft_token_ids: tuple[int, ...] = (),
    ) -> KvPushResult:
        """Stream every chunk; the last carries num_tokens, first_token_id, generated_tokens
        and the proposals draft_token_ids.

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
                        yield self._count(
                            sent, convert.kv_chunk_to_pb(request_id, target, layout_pb, pending)
                        )
                    pending = chunk
            except Exception as exc:  # grpc would swallow it: end the stream unfinished, re-raise
                export_error.append(exc)
                return
            if pending is None:  # everything was skipped: an empty last chunk closes the import
                pending = KvBlocksChunk(first_block=target.skip_blocks, num_blocks=0, data=b"")
            yield self._count(
                sent,
                convert.kv_chunk_to_pb(
                    request_id, target, layout_pb, pending, last=last_fields, draft_token_ids=draft_token_ids
                ),
            )

        start = time.perf_counter()
        try:
            stub = worker_pb2_grpc.WorkerStub(self._channels.get(target.address))
            await stub.PushKv(messages(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            if export_error:
                raise export_error[0] from exc
            raise push_error(exc, target, request_id) from exc
        if export_error:
            raise export_error[0]
        return KvPushResult(
            bytes_sent=sent["bytes"],
            num_chunks=sent["chunks"],
            seconds=time.perf_counter() - start,
        )

    @staticmethod
    def _count(sent: dict[str, int], pb: worker_pb2.KvChunk) -> worker_pb2.KvChunk:
        sent["bytes"] += len(pb.data)
        sent["chunks"] += 1
        return pb

    def open_stream(self, request_id: str, target: KvTargetSpec, layout: KvLayout) -> KvPushStream:
        """A PushKv call opened now and fed chunk by chunk (the early push of a prefill that
        runs in several chunks); KvPushStream.finish sends the last one."""
        if not target.address:
            raise errors.InvalidArgument("kv_target.address is required")
        return KvPushStream(self._channels, self._timeout_s, request_id, target, layout)


class KvPushStream:
    """One PushKv call whose messages are queued as they are ready. It has no gRPC deadline
    (the prefill it overlaps bounds it: `cancel` when that fails); `finish` / `close` wait for
    the reply at most timeout_s. Messages wait in memory while the link is slower than the
    prefill (at most the prompt's KV)."""

    def __init__(
        self,
        channels: ChannelCache,
        timeout_s: float,
        request_id: str,
        target: KvTargetSpec,
        layout: KvLayout,
    ) -> None:
        self._timeout_s = timeout_s
        self._request_id = request_id
        self._target = target
        self.layout_pb = kv_layout_to_pb(layout)
        self._queue: asyncio.Queue[worker_pb2.KvChunk | None] = asyncio.Queue()
        self._sent = {"bytes": 0, "chunks": 0}
        stub = worker_pb2_grpc.WorkerStub(channels.get(target.address))
        self._rpc = stub.PushKv(self._messages())
        self._call = asyncio.ensure_future(self._reply())

    @property
    def num_messages(self) -> int:
        return self._sent["chunks"]

    def done(self) -> bool:
        """The call ended (answered, failed or cancelled)."""
        return self._call.done()

    def put(self, pb: worker_pb2.KvChunk) -> None:
        """Queue one message as it is."""
        self._queue.put_nowait(GrpcKvPusher._count(self._sent, pb))

    async def _reply(self) -> worker_pb2.PushKvResponse:
        return await self._rpc

    async def _messages(self) -> AsyncIterator[worker_pb2.KvChunk]:
        while (pb := await self._queue.get()) is not None:
            yield pb

    def send(self, chunks: Iterator[KvBlocksChunk]) -> None:
        """Queue these chunks (none marked last)."""
        for chunk in chunks:
            self.put(convert.kv_chunk_to_pb(self._request_id, self._target, self.layout_pb, chunk))

    async def finish(
        self,
        chunks: Iterator[KvBlocksChunk],
        first_block: int,
        last: tuple[int, int | None, int],
        draft_token_ids: tuple[int, ...] = (),
    ) -> KvPushResult:
        """Queue the remaining chunks, the last carrying last = (num_tokens, first_token_id,
        generated_tokens) and the proposals (an empty one at first_block when none remain),
        end the stream and wait for the reply. Raises like GrpcKvPusher.push."""
        start = time.perf_counter()
        pending: KvBlocksChunk | None = None
        try:
            for chunk in chunks:
                if pending is not None:
                    self.send(iter((pending,)))
                pending = chunk
        except BaseException:
            self.cancel()
            raise
        if pending is None:
            pending = KvBlocksChunk(first_block=first_block, num_blocks=0, data=b"")
        pb = convert.kv_chunk_to_pb(
            self._request_id,
            self._target,
            self.layout_pb,
            pending,
            last=last,
            draft_token_ids=draft_token_ids,
        )
        await self.close(pb)
        return KvPushResult(
            bytes_sent=self._sent["bytes"],
            num_chunks=self._sent["chunks"],
            seconds=time.perf_counter() - start,
        )

    async def close(self, last: worker_pb2.KvChunk) -> worker_pb2.PushKvResponse:
        """Queue the message marked last, end the stream, wait for the reply. Raises like
        GrpcKvPusher.push."""
        self.put(last)
        self._queue.put_nowait(None)
        try:
            return await asyncio.wait_for(self._call, self._timeout_s)
        except TimeoutError as exc:
            self._rpc.cancel()
            raise errors.Unavailable(
                f"decode worker {self._target.address} did not answer the KV push of request "
                f"{self._request_id!r} within {self._timeout_s} s"
            ) from exc
        except grpc.aio.AioRpcError as exc:
            raise push_error(exc, self._target, self._request_id) from exc

    def cancel(self) -> None:
        """Break the call: the stream ends unfinished (no message marked last), which the
        decode worker refuses at once, aborting the request (its KV can never complete).
        Measured in process: cancelling the client call while its request stream waited reached
        the server only when the channel closed. A decode worker that never answers: the call
        is cancelled after the push timeout."""
        self._queue.put_nowait(None)  # harmless when the stream already ended
        if not self._call.done():
            self._call.add_done_callback(retrieve_quietly)  # its error is expected: nobody awaits it
        asyncio.get_running_loop().call_later(self._timeout_s, self._rpc.cancel)


class GrpcKvSender:
    """The gRPC push as a KvSender: the engine's blocks serialized in chunks of ~chunk_bytes."""

    transport = KvTransport.GRPC_PUSH

    def __init__(self, engine: Engine, pusher: KvPusher, chunk_bytes: int) -> None:
        self._engine = engine
        self._pusher = pusher
        self._chunk_bytes = chunk_bytes

    def takes_early(self, target: KvTargetSpec) -> bool:
        """Any decode worker takes the early push (the same messages, sooner); a pusher that
        cannot stream (e.g. a test's) pushes at the end."""
        return isinstance(self._pusher, GrpcKvPusher)

    def start_early(self, request_id: str, target: KvTargetSpec, layout: KvLayout) -> EarlyKvPush | None:
        """The early push of a prefill running in several chunks (None with a pusher that
        cannot stream, e.g. a test's)."""
        if not isinstance(self._pusher, GrpcKvPusher):
            return None
        return EarlyKvPush(
            self._engine,
            self._pusher.open_stream(request_id, target, layout),
            self._chunk_bytes,
            target,
            layout.block_size,
            request_id,
        )

    async def send(self, handoff: KvHandoff, target: KvTargetSpec) -> KvPushResult:
        chunks: Iterator[KvBlocksChunk] = iter(())
        if handoff.first_token_id is not None:
            chunks = self._engine.export_kv(
                handoff.request_id, target.skip_blocks, self._chunk_bytes, target.trim_blocks
            )
        return await self._pusher.push(
            request_id=handoff.request_id,
            target=target,
            layout=handoff.layout,
            chunks=chunks,
            num_tokens=handoff.num_tokens,
            first_token_id=handoff.first_token_id,
            generated_tokens=handoff.generated_tokens,
            draft_token_ids=handoff.draft_token_ids,
        )


class EarlyKvPush:
    """The gRPC push of one prefill that runs in several chunks: after each chunk's forward
    pass its complete blocks go out at once (the decode worker imports them while the later
    chunks compute); the rest, the first token and the counts when the prefill ends. Blocks the
    decode worker has (target.skip_blocks) are never sent. The PushKv messages are those of the
    push at the end (any decode worker version imports them: they only come sooner)."""

    def __init__(
        self,
        engine: Engine,
        stream: KvPushStream,
        chunk_bytes: int,
        target: KvTargetSpec,
        block_size: int,
        request_id: str,
    ) -> None:
        self._engine = engine
        self._stream = stream
        self._chunk_bytes = chunk_bytes
        self._target = target
        self._block_size = block_size
        self._request_id = request_id
        self.next_block = target.skip_blocks  # blocks before it are sent (or not needed)
        self.num_early_blocks = 0  # sent before the prefill ended (blocks)

    def ready(self, num_computed_tokens: int) -> None:
        """The prompt's first num_computed_tokens have their K/V: send the complete blocks."""
        end = num_computed_tokens // self._block_size
        if end <= self.next_block:
            return
        try:
            chunks = list(
                self._engine.export_ready_kv(
                    self._request_id, self.next_block, end, self._chunk_bytes, self._target.trim_blocks
                )
            )
        except errors.InvalidArgument:  # preempted since: its blocks go when it computed them again
            return
        self._stream.send(iter(chunks))
        self.num_early_blocks += end - self.next_block
        self.next_block = end

    async def finish(self, handoff: KvHandoff) -> KvPushResult:
        chunks: Iterator[KvBlocksChunk] = iter(())
        if handoff.first_token_id is not None:
            chunks = self._engine.export_kv(
                self._request_id, self.next_block, self._chunk_bytes, self._target.trim_blocks
            )
        return await self._stream.finish(
            chunks,
            self.next_block,
            (handoff.num_tokens, handoff.first_token_id, handoff.generated_tokens),
            handoff.draft_token_ids,
        )

    def cancel(self) -> None:
        self._stream.cancel()


def push_error(exc: grpc.aio.AioRpcError, target: KvTargetSpec, request_id: str) -> Exception:
    log.warning("kv_push_failed", target=target.address, code=exc.code().name, details=exc.details())
    where = f"decode worker {target.address} (KV push of request {request_id!r}, rank {target.dp_rank})"
    return error_from_rpc(exc, where, keep=_KEPT_STATUSES, otherwise=errors.Unavailable)
