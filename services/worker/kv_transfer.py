"""The KV push client: streams a finished prefill's KV blocks to a decode worker over PushKv."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import grpc
import structlog

from services.worker import convert
from services.worker.engine.api import KvBlocksChunk
from services.worker.messages import KvPushResult, KvTargetSpec
from shared import errors
from shared.channels import ChannelCache
from shared.cluster import KvLayout
from shared.cluster_convert import kv_layout_to_pb
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
            raise _push_error(exc, target, request_id) from exc
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


def _push_error(exc: grpc.aio.AioRpcError, target: KvTargetSpec, request_id: str) -> Exception:
    log.warning("kv_push_failed", target=target.address, code=exc.code().name, details=exc.details())
    where = f"decode worker {target.address} (KV push of request {request_id!r}, rank {target.dp_rank})"
    return error_from_rpc(exc, where, keep=_KEPT_STATUSES, otherwise=errors.Unavailable)
