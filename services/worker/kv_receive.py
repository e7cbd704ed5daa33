"""The decode side of a KV handoff: one PushKv stream's chunks imported into the engine (or,
over NIXL, the blocks its chunks name READ into the request's reserved blocks: one chunk at the
end, or one per prefill chunk, KvTarget.nixl_parts, each READ as it arrives), the layout checked
against this worker's, the last chunk starting the decode, and what a failed READ does
(--kv-load-failure-policy). No grpc here (the servicer converts the stream)."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import AsyncIterator

import structlog

from services.worker.engine.api import Engine
from services.worker.kv_nixl import KvTransferFailed, NixlKvAgent
from services.worker.messages import IncomingKvChunk, KvReceipt
from shared import errors, metrics
from shared.cluster import KvTransport
from shared.tracing import tracer

log = structlog.get_logger(__name__)


def _layout_str(layout: object) -> str:
    d = dataclasses.asdict(layout)  # type: ignore[call-overload]
    return ", ".join(f"{k}={v}" for k, v in d.items())


# How long a push waits for the admission its ticket names (s), and how often it looks (s).
ADMISSION_WAIT_S = 2.0
_ADMISSION_POLL_S = 0.001


class KvLoadFailurePolicy(enum.Enum):
    """What a decode worker does when a NIXL READ of a request's KV fails or times out."""

    RECOMPUTE = "recompute"  # keep the request and the first token; prefill the prompt here
    RETRY_PREFILL = "retry-prefill"  # abort it here: the handoff fails, the gateway reschedules


class KvReceiver:
    """Imports the KV of the requests this (decode or unified) worker admitted."""

    def __init__(
        self,
        engine: Engine,
        nixl: NixlKvAgent | None,
        kv_load_failure_policy: KvLoadFailurePolicy = KvLoadFailurePolicy.RECOMPUTE,
        kv_read_timeout_s: float = 10.0,
    ) -> None:
        self.engine = engine
        self._nixl = nixl
        self._kv_load_failure_policy = kv_load_failure_policy
        self._kv_read_timeout_s = kv_read_timeout_s

    async def receive(self, chunks: AsyncIterator[IncomingKvChunk]) -> KvReceipt:
        """Import one request's KV chunks (or, over NIXL, READ the blocks each chunk names, one
        READ at a time, in order); the last one starts decoding.

        A transfer that breaks before the last chunk (refused chunks included) aborts the request
        waiting under its ticket (its Decode stream ends with ABORT and its blocks are freed); it
        could never complete otherwise. One that breaks after the last chunk leaves the request
        decoding. A failed NIXL READ follows --kv-load-failure-policy: recompute here (the later
        parts are not READ), or abort (retry-prefill)."""
        ours = self.engine.kv_layout
        request_id: str | None = None
        ticket = ""
        bytes_received = blocks_received = 0
        read_ns: int | None = None
        recomputing = False
        done = False
        nixl_stream: bool | None = None  # whether the stream's chunks carry NIXL descriptors
        try:
            async for c in chunks:
                if request_id is None:
                    request_id, ticket = c.request_id, c.transfer_ticket
                    if c.layout is None:
                        raise errors.InvalidArgument("the first KvChunk must carry the layout")
                elif c.transfer_ticket != ticket:
                    raise errors.InvalidArgument(
                        "every KvChunk of one PushKv stream must carry the same transfer_ticket"
                    )
                if done:
                    raise errors.InvalidArgument("KvChunk received after the chunk marked last")
                if c.layout is not None and c.layout != ours:
                    raise errors.FailedPrecondition(
                        f"KV layout mismatch: the sender has ({_layout_str(c.layout)}), this "
                        f"worker has ({_layout_str(ours)}); pair workers with the same model, "
                        "dtype and block size"
                    )
                if nixl_stream is None:  # the first chunk
                    await self._admitted(ticket)
                    nixl_stream = c.nixl_source is not None
                elif nixl_stream != (c.nixl_source is not None):
                    raise errors.InvalidArgument(
                        "the KvChunks of one PushKv stream carry nixl_source all or none"
                    )
                if c.nixl_source is not None:
                    if c.chunk.data:
                        raise errors.InvalidArgument("a KvChunk with nixl_source carries no data")
                    # a part (not last) always; the last unless the request ended at its first
                    # token; nothing more once a READ failed and this worker recomputes
                    wanted = not c.last or c.first_token_id is not None
                    if wanted and c.nixl_source.block_ids and not recomputing:
                        part_ns, nbytes = await self._read_nixl(ticket, c)
                        recomputing = part_ns is None
                        if part_ns is not None:
                            read_ns = (read_ns or 0) + part_ns
                            bytes_received += nbytes
                            blocks_received += len(c.nixl_source.block_ids)
                elif c.chunk.num_blocks:
                    self.engine.import_kv(ticket, c.chunk)
                bytes_received += len(c.chunk.data)
                blocks_received += c.chunk.num_blocks if c.nixl_source is None else 0
                if c.last:
                    # An old (v1.0) prefill worker sends no count: it always generated 1 token.
                    prefill_generated = 1 if c.generated_tokens is None else c.generated_tokens
                    self.engine.finish_import(
                        ticket,
                        c.num_tokens,
                        c.first_token_id,
                        prefill_generated,
                        c.draft_token_ids,
                        recompute=recomputing,
                    )
                    done = True
            if request_id is None:
                raise errors.InvalidArgument("PushKv stream carried no KvChunk")
            if not done:
                raise errors.InvalidArgument("PushKv stream ended without a KvChunk marked last")
        except BaseException:
            # a stream that breaks after its last chunk (the sender died waiting for our reply)
            # leaves a request the engine already has whole: it decodes on (or recomputes, by
            # the policy, after a failed READ); a handoff cut short aborts the request waiting
            # under its ticket, whatever it had received: the prefill worker may have answered
            # the gateway already (KvTarget.reply_before_handoff), so this worker is the one to
            # end the request (its Decode stream ends with ABORT; the gateway moves it on)
            if not done and ticket:
                self.engine.abort_ticket(ticket)
            raise
        metrics.KV_TRANSFER_BYTES.labels(direction="received").inc(bytes_received)
        log.debug("kv_received", request_id=request_id, bytes=bytes_received, blocks=blocks_received)
        return KvReceipt(
            bytes_received=bytes_received,
            blocks_received=blocks_received,
            read_ns=read_ns,
            recomputing=recomputing,
        )

    async def _admitted(self, ticket: str) -> None:
        """Wait (at most ADMISSION_WAIT_S) for the request this ticket names to be admitted: the
        gateway that chose the ticket (DecodeRequest.transfer_ticket) starts the prefill with
        the admission, so a push may arrive first. An unknown ticket fails after the wait."""
        deadline = time.monotonic() + ADMISSION_WAIT_S
        while not self.engine.waits_for_kv(ticket) and time.monotonic() < deadline:
            await asyncio.sleep(_ADMISSION_POLL_S)

    async def _read_nixl(self, ticket: str, c: IncomingKvChunk) -> tuple[int | None, int]:
        """READ the blocks c.nixl_source names into the request's reserved blocks, in a worker
        thread (the event loop keeps serving). Returns (read_ns, bytes), or (None, 0) when the
        READ failed and the policy is to recompute. A cancelled call leaves the READ to end on
        its own (bounded by --kv-read-timeout-s); the blocks are freed only after it, or, when
        it timed out still in flight, only once NIXL saw that transfer end (quarantined,
        engine/handoff.py: a late READ never lands in a block another request holds)."""
        source = c.nixl_source
        assert source is not None
        nixl = self._nixl
        if nixl is None:
            raise errors.FailedPrecondition(
                "this worker has no NIXL agent (nixl-cu13 missing or failed to start); "
                "send the KV over the gRPC push"
            )
        timeout_s = self._kv_read_timeout_s

        def read(
            src_offset: int, dp_rank: int, block_ids: list[int], num_trimmed: int, layers: tuple[int, ...]
        ) -> int:
            return nixl.read(source, src_offset, dp_rank, block_ids, timeout_s, num_trimmed, layers)

        start = time.perf_counter_ns()
        with tracer().start_as_current_span("kv_read") as span:
            span.set_attribute("pdserve.kv_transport", KvTransport.NIXL.value)
            span.set_attribute("pdserve.source_agent", source.agent_name)
            try:
                nbytes = await asyncio.to_thread(
                    self.engine.import_kv_direct, ticket, source.first_block, len(source.block_ids), read
                )
            except KvTransferFailed as exc:
                nixl.forget(source.agent_name)
                metrics.KV_TRANSFER_FAILURES.labels(transport=KvTransport.NIXL.value, side="read").inc()
                span.set_attribute("pdserve.error", str(exc))
                policy = self._kv_load_failure_policy
                log.warning("kv_read_failed", error=str(exc), policy=policy.value)
                if policy is KvLoadFailurePolicy.RETRY_PREFILL:
                    raise
                metrics.KV_TRANSFER_RECOMPUTES.inc()
                span.set_attribute("pdserve.kv_recomputing", True)
                return None, 0
            elapsed_ns = time.perf_counter_ns() - start
            path = nixl.read_path(source)  # decided (and cached) by the read
            span.set_attribute("pdserve.kv_read_path", path)
            span.set_attribute("pdserve.bytes", nbytes)
            span.set_attribute("pdserve.kv_read_seconds", elapsed_ns / 1e9)
        metrics.KV_TRANSFER_READ_SECONDS.labels(path=path).observe(elapsed_ns / 1e9)
        return elapsed_ns, nbytes
