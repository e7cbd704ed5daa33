"""NIXL's sending side (the prefill worker): one PushKv message names a finished prefill's blocks
in this worker's registered pool and the decode worker READs them (services/worker/kv_nixl.py);
to a decode worker that takes parts (KvTarget.nixl_parts, protocol 1.10) a prefill in several
chunks names each chunk's complete blocks as it finishes (EarlyNixlPush), so the READs overlap
the rest of the prefill. The PushKv stream and error mapping are kv_transfer.py's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import grpc

from services.worker import convert
from services.worker.engine.api import Engine, KvBlocksChunk
from services.worker.kv_nixl import NixlKvAgent
from services.worker.kv_transfer import KvPushStream, push_error
from services.worker.messages import KvHandoff, KvPushResult, KvTargetSpec
from shared import errors
from shared.channels import ChannelCache
from shared.cluster import KvLayout, KvTransport
from shared.cluster_convert import kv_layout_to_pb
from shared.proto import worker_pb2, worker_pb2_grpc

_T = TypeVar("_T")
# How often a prefill worker progresses its NIXL agent while a decode worker READs (seconds).
_PROGRESS_INTERVAL_S = 0.001


class NixlKvSender:
    """NIXL as a KvSender: one PushKv message names the blocks in this worker's registered pool
    (one per prefill chunk where the decode worker takes parts: EarlyNixlPush); the decode
    worker READs them and answers when they landed (or when it gave up and recomputes, by its
    --kv-load-failure-policy). The blocks stay held until then."""

    transport = KvTransport.NIXL

    def __init__(
        self, engine: Engine, agent: NixlKvAgent, channels: ChannelCache, timeout_s: float = 60.0
    ) -> None:
        self._engine = engine
        self._agent = agent
        self._channels = channels
        self._timeout_s = timeout_s

    def takes_early(self, target: KvTargetSpec) -> bool:
        """Only a decode worker that takes the descriptors in parts (KvTarget.nixl_parts, 1.10):
        an older one refuses a second NIXL message."""
        return target.nixl_parts

    def start_early(self, request_id: str, target: KvTargetSpec, layout: KvLayout) -> EarlyNixlPush | None:
        if not target.nixl_parts:
            return None
        if not target.address:
            raise errors.InvalidArgument("kv_target.address is required")
        stream = KvPushStream(self._channels, self._timeout_s, request_id, target, layout)
        return EarlyNixlPush(self._engine, self._agent, stream, target, layout.block_size, request_id)

    async def send(self, handoff: KvHandoff, target: KvTargetSpec) -> KvPushResult:
        if not target.address:
            raise errors.InvalidArgument("kv_target.address is required")
        rid = handoff.request_id
        block_ids: list[int] = []
        dp_rank = 0
        if handoff.first_token_id is not None:
            dp_rank, block_ids = self._engine.export_block_ids(rid, target.skip_blocks)
        source = self._agent.source(dp_rank, block_ids, target.skip_blocks)
        empty = KvBlocksChunk(first_block=target.skip_blocks, num_blocks=len(block_ids), data=b"")
        pb = convert.kv_chunk_to_pb(
            rid,
            target,
            kv_layout_to_pb(handoff.layout),
            empty,
            last=(handoff.num_tokens, handoff.first_token_id, handoff.generated_tokens),
            draft_token_ids=handoff.draft_token_ids,
            nixl_source=source,
        )

        async def one() -> AsyncIterator[worker_pb2.KvChunk]:
            yield pb

        start = time.perf_counter()
        try:
            stub = worker_pb2_grpc.WorkerStub(self._channels.get(target.address))
            reply = await self._progressing(stub.PushKv(one(), timeout=self._timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise push_error(exc, target, rid) from exc
        return _nixl_result(reply, 1, time.perf_counter() - start)

    async def _progressing(self, call: Awaitable[_T]) -> _T:
        """Await the call while progressing this agent about every millisecond, so that the
        decode worker's READ of our blocks completes (unless NIXL's progress thread does)."""
        if self._agent.progress_thread:
            return await call
        task = asyncio.ensure_future(call)
        try:
            while not task.done():
                self._agent.progress()
                await asyncio.wait({task}, timeout=_PROGRESS_INTERVAL_S)
        finally:
            if not task.done():
                task.cancel()
        return task.result()


class EarlyNixlPush:
    """The NIXL handoff of one prefill that runs in several chunks, to a decode worker that
    takes it in parts (KvTarget.nixl_parts): after each chunk's forward pass one PushKv message
    names its complete blocks (the decode worker READs them while the later chunks compute, one
    READ at a time, in order); the last names the rest and carries the first token and counts.
    Blocks the decode worker has (target.skip_blocks) are never named. This agent is progressed
    about every millisecond from the first message until the call ends (a READ needs the
    target's progress), a cancelled one included (the decode worker sees the end of the stream
    only after the READ it is doing)."""

    def __init__(
        self,
        engine: Engine,
        agent: NixlKvAgent,
        stream: KvPushStream,
        target: KvTargetSpec,
        block_size: int,
        request_id: str,
    ) -> None:
        self._engine = engine
        self._agent = agent
        self._stream = stream
        self._target = target
        self._block_size = block_size
        self._request_id = request_id
        self.next_block = target.skip_blocks  # blocks before it are named (or not needed)
        self.num_early_blocks = 0  # named before the prefill ended (blocks)
        self._sent_ids: list[int] = []  # pool block ids named so far, from skip_blocks on
        # the request's preemption count when the first part was named (None: none named): a
        # preemption frees named blocks, which may hold another request's data while a READ of
        # them runs, and come back with the same ids; then the last message names them all again
        self._preemptions: int | None = None
        self._progress = asyncio.ensure_future(self._progressing())

    async def _progressing(self) -> None:
        if self._agent.progress_thread:
            return
        while not self._stream.done():
            self._agent.progress()
            await asyncio.sleep(_PROGRESS_INTERVAL_S)

    def ready(self, num_computed_tokens: int) -> None:
        """The prompt's first num_computed_tokens have their K/V: name the complete blocks."""
        end = num_computed_tokens // self._block_size
        if end <= self.next_block:
            return
        try:
            preemptions = self._engine.request_preemptions(self._request_id)  # read first: see finish
            dp_rank, block_ids = self._engine.export_block_ids(self._request_id, self.next_block, end)
        except errors.InvalidArgument:  # preempted since: its blocks go when it computed them again
            return
        if self._preemptions is None:
            self._preemptions = preemptions
        source = self._agent.source(dp_rank, block_ids, self.next_block)
        part = KvBlocksChunk(first_block=self.next_block, num_blocks=len(block_ids), data=b"")
        pb = convert.kv_chunk_to_pb(
            self._request_id, self._target, self._stream.layout_pb, part, nixl_source=source
        )
        self._stream.put(pb)
        self._sent_ids.extend(block_ids)
        self.num_early_blocks += len(block_ids)
        self.next_block = end

    async def finish(self, handoff: KvHandoff) -> KvPushResult:
        """The last message (the blocks not named yet) and the decode worker's answer. A prefill
        preempted after naming blocks computed them again, maybe in other blocks (the ones named
        were freed, and a READ of them may have copied another request's data): then the last
        message names every block again, READ over the first ones after every earlier READ (the
        decode worker READs the parts in order)."""
        start = time.perf_counter()
        first = self.next_block
        block_ids: list[int] = []
        dp_rank = 0
        if handoff.first_token_id is not None:
            try:
                dp_rank, block_ids = self._engine.export_block_ids(self._request_id, self._target.skip_blocks)
            except BaseException:
                self.cancel()  # the stream never ends otherwise (it has no deadline)
                raise
            preempted = (
                self._preemptions is not None
                and self._engine.request_preemptions(self._request_id) != self._preemptions
            )
            if not preempted and block_ids[: len(self._sent_ids)] == self._sent_ids:
                block_ids = block_ids[len(self._sent_ids) :]
            else:
                first = self._target.skip_blocks
        source = self._agent.source(dp_rank, block_ids, first)
        pb = convert.kv_chunk_to_pb(
            self._request_id,
            self._target,
            self._stream.layout_pb,
            KvBlocksChunk(first_block=first, num_blocks=len(block_ids), data=b""),
            last=(handoff.num_tokens, handoff.first_token_id, handoff.generated_tokens),
            draft_token_ids=handoff.draft_token_ids,
            nixl_source=source,
        )
        reply = await self._stream.close(pb)
        return _nixl_result(reply, self._stream.num_messages, time.perf_counter() - start)

    def cancel(self) -> None:
        self._stream.cancel()


def _nixl_result(reply: worker_pb2.PushKvResponse, num_messages: int, seconds: float) -> KvPushResult:
    recomputing = reply.HasField("recomputing") and reply.recomputing
    return KvPushResult(
        bytes_sent=0 if recomputing else reply.bytes_received,
        num_chunks=num_messages,
        seconds=seconds,
        transport=KvTransport.NIXL,
        read_seconds=reply.kv_read_ns / 1e9 if reply.HasField("kv_read_ns") else None,
        recomputing=recomputing,
    )
