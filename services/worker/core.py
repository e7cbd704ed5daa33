"""The worker's domain core: prefill, decode, KV import, abort, loads and drain over one Engine.

No grpc here: the servicer converts protobuf to the messages in `messages`, calls one method,
converts back. Errors are `shared.errors` exceptions (the server interceptor maps them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
from collections.abc import AsyncGenerator, AsyncIterator, Iterator

import structlog

from services.worker.engine.api import (
    Engine,
    KvBlocksChunk,
    RequestKind,
    RequestOutput,
    TokenLogprobs,
)
from services.worker.engine.spec.stats import SpecStats
from services.worker.messages import (
    DecodeCall,
    DecodeEvent,
    FrameKind,
    IncomingKvChunk,
    KvPusher,
    KvReceipt,
    PrefillCall,
    PrefillResult,
)
from shared import errors, metrics
from shared.cluster import FinishReason, RankLoad, WorkerInfo
from shared.tracing import tracer

log = structlog.get_logger(__name__)


class Phase(enum.Enum):
    """Where a request with a live RPC on this worker is."""

    PREFILL = "prefill"
    PUSHING = "pushing"  # its KV is being pushed to a decode worker (a drain lets it end)
    DECODE = "decode"


def _layout_str(layout: object) -> str:
    d = dataclasses.asdict(layout)  # type: ignore[call-overload]
    return ", ".join(f"{k}={v}" for k, v in d.items())


class WorkerCore:
    """Serves one engine's requests; tracks in-flight requests so a drain can wait for them."""

    def __init__(
        self,
        engine: Engine,
        identity: WorkerInfo,
        pusher: KvPusher,
        kv_chunk_bytes: int = 1 << 20,
        log_prompts: bool = False,
    ) -> None:
        self.engine = engine
        self.identity = identity
        self._pusher = pusher
        self._kv_chunk_bytes = kv_chunk_bytes
        self._log_prompts = log_prompts
        # only requests with a live RPC
        self._active: dict[str, Phase] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        # per rank, engine counters already exported to Prometheus (cumulative)
        self._preemptions_seen: dict[int, int] = {}
        self._spec_seen: dict[int, SpecStats] = {}

    # ----- bookkeeping -----

    def _require(self, serves: bool, what: str) -> None:
        if not serves:
            raise errors.FailedPrecondition(f"{what} is not served by a {self.identity.role.value} worker")

    @contextlib.contextmanager
    def _track(self, request_id: str, phase: Phase) -> Iterator[None]:
        if self._draining:
            raise errors.Unavailable("worker is draining; send the request to another worker")
        if request_id in self._active:
            raise errors.AlreadyExists(f"request {request_id!r} is already running on this worker")
        self._active[request_id] = phase
        self._idle.clear()
        try:
            yield
        finally:
            self._active.pop(request_id, None)
            if not self._active:
                self._idle.set()

    def _aborted_error(self, request_id: str) -> errors.PdserveError:
        if self._draining:
            return errors.Unavailable(f"request {request_id!r} aborted: the worker is shutting down")
        return errors.Cancelled(f"request {request_id!r} was aborted")

    @staticmethod
    def _record_cache_stats(out: RequestOutput) -> None:
        """Once per request, when its cache stats are fixed (its first output)."""
        metrics.PREFIX_CACHE_QUERIES.inc(out.num_prompt_tokens)
        metrics.PREFIX_CACHE_HITS.labels(source="local").inc(out.num_local_cached_tokens)
        metrics.PREFIX_CACHE_HITS.labels(source="transferred").inc(out.num_transferred_tokens)

    # ----- Prefill -----

    async def prefill(self, call: PrefillCall) -> PrefillResult:
        """Run the prompt, sample the first token, push the KV to call.kv_target, free the KV."""
        self._require(self.identity.role.prefills, "Prefill (roles that serve it: prefill, unified)")
        request = dataclasses.replace(call.request, kind=RequestKind.PREFILL_ONLY)
        rid = request.request_id
        with self._track(rid, Phase.PREFILL), tracer().start_as_current_span("prefill") as span:
            span.set_attribute("pdserve.request_id", rid)
            span.set_attribute("pdserve.prompt_tokens", len(request.prompt_token_ids))
            handle = self.engine.add_request(request)
            token_ids: list[int] = []
            logprobs: list[TokenLogprobs] = []
            text: list[str] = []
            last: RequestOutput | None = None
            try:
                async for out in handle:
                    if last is None:
                        self._record_cache_stats(out)
                    last = out
                    token_ids.extend(out.new_token_ids)
                    logprobs.extend(out.new_logprobs)
                    text.append(out.text_delta)
                    if out.finished:
                        break
            except BaseException:  # the caller went away (CancelledError) or the engine failed
                self.engine.abort(rid)
                raise
            try:
                if last is None or last.finish_reason is FinishReason.ABORT:
                    raise self._aborted_error(rid)
                finish = last.finish_reason  # the engine's finish rule; None: decoding goes on
                span.set_attribute("pdserve.num_chunks", last.num_prefill_chunks)
                span.set_attribute("pdserve.local_cached_tokens", last.num_local_cached_tokens)
                kv_bytes, kv_ns = 0, 0
                if call.kv_target is not None:
                    # Finished at the first token: the handoff carries no KV and no first token,
                    # so the decode side ends the request at once (FINAL, its count 0).
                    first_token_id = token_ids[-1] if finish is None and token_ids else None
                    self._active[rid] = Phase.PUSHING
                    kv_bytes, kv_ns = await self._push(call, last, first_token_id)
            finally:
                self._release(rid)
            if self._log_prompts:
                log.info("prefill_done", prompt_token_ids=list(request.prompt_token_ids), text="".join(text))
            log.debug(
                "prefill_done",
                prompt_tokens=last.num_prompt_tokens,
                generated_tokens=last.num_generated_tokens,
                num_chunks=last.num_prefill_chunks,
                kv_bytes_sent=kv_bytes,
            )
            return PrefillResult(
                request_id=rid,
                text="".join(text),
                token_ids=tuple(token_ids) if call.return_token_ids else (),
                generated_tokens=last.num_generated_tokens,
                finish_reason=finish,
                prompt_tokens=last.num_prompt_tokens,
                local_cached_tokens=last.num_local_cached_tokens,
                kv_bytes_sent=kv_bytes,
                num_chunks=last.num_prefill_chunks,
                prefill_ns=last.prefill_ns,
                kv_transfer_ns=kv_ns,
                logprobs=tuple(logprobs),
            )

    async def _push(
        self, call: PrefillCall, out: RequestOutput, first_token_id: int | None
    ) -> tuple[int, int]:
        """Push the KV (all of it after target.skip_blocks; none when first_token_id is None)."""
        target = call.kv_target
        assert target is not None
        rid = call.request.request_id
        with tracer().start_as_current_span("kv_transfer") as span:
            span.set_attribute("pdserve.target", target.address)
            chunks: Iterator[KvBlocksChunk] = iter(())
            if first_token_id is not None:
                chunks = self.engine.export_kv(rid, target.skip_blocks, self._kv_chunk_bytes)
            result = await self._pusher.push(
                request_id=rid,
                target=target,
                layout=self.engine.kv_layout,
                chunks=chunks,
                num_tokens=out.num_prompt_tokens,
                first_token_id=first_token_id,
                generated_tokens=out.num_generated_tokens,
                draft_token_ids=out.draft_token_ids if first_token_id is not None else (),
            )
            span.set_attribute("pdserve.bytes", result.bytes_sent)
            span.set_attribute("pdserve.num_chunks", result.num_chunks)
        metrics.KV_TRANSFER_BYTES.labels(direction="sent").inc(result.bytes_sent)
        metrics.KV_TRANSFER_SECONDS.observe(result.seconds)
        log.debug(
            "kv_pushed",
            target=target.address,
            bytes=result.bytes_sent,
            chunks=result.num_chunks,
            seconds=round(result.seconds, 6),
        )
        return result.bytes_sent, int(result.seconds * 1e9)

    def _release(self, request_id: str) -> None:
        """Free a PREFILL_ONLY request's held blocks (they stay in the prefix cache)."""
        try:
            self.engine.release(request_id)
        except errors.NotFound:
            pass  # aborted before its first token: already freed
        except errors.PdserveError as exc:  # never mask the error that brought us here
            log.warning("release_failed", error=str(exc))

    # ----- Decode -----

    async def decode(self, call: DecodeCall) -> AsyncGenerator[DecodeEvent, None]:
        """ADMITTED, then TOKENS frames as the engine produces them, then FINAL.

        Closing the iterator early (client cancelled) aborts the request and frees its KV."""
        self._require(self.identity.role.decodes, "Decode (roles that serve it: decode, unified)")
        kind = RequestKind.FULL if call.local_prefill else RequestKind.DECODE_REMOTE
        request = dataclasses.replace(call.request, kind=kind)
        rid = request.request_id
        ids = call.return_token_ids
        with self._track(rid, Phase.DECODE):
            span = tracer().start_span("decode")
            span.set_attribute("pdserve.request_id", rid)
            span.set_attribute("pdserve.local_prefill", call.local_prefill)
            last: RequestOutput | None = None
            done = False  # the engine ended the request: nothing to abort
            completion: list[str] | None = [] if self._log_prompts else None
            try:
                if call.local_prefill:
                    handle = self.engine.add_request(request)
                    ticket, cached_blocks, local_cached = "", 0, 0
                else:
                    admission, handle = self.engine.admit_remote(request)
                    ticket, cached_blocks = admission.transfer_ticket, admission.num_cached_blocks
                    local_cached = admission.num_local_cached_tokens
                yield DecodeEvent(
                    request_id=rid,
                    kind=FrameKind.ADMITTED,
                    prompt_tokens=len(request.prompt_token_ids),
                    local_cached_tokens=local_cached,
                    transferred_cached_tokens=0,
                    transfer_ticket=ticket,
                    cached_blocks=cached_blocks,
                )
                async for out in handle:
                    if last is None:
                        self._record_cache_stats(out)
                    last = out
                    if completion is not None:
                        completion.append(out.text_delta)
                    if out.finished:
                        break
                    if out.text_delta or out.new_logprobs or (ids and out.new_token_ids):
                        yield _decode_event(rid, FrameKind.TOKENS, out, ids)
                done = True
                yield _final_event(rid, last, ids, len(request.prompt_token_ids))
            finally:
                if not done:
                    self.engine.abort(rid)
                generated = last.num_generated_tokens if last is not None else 0
                span.set_attribute("pdserve.tokens", generated)
                span.end()
                log.debug("decode_done", generated_tokens=generated, finished=done)
                if completion is not None:
                    log.info(
                        "decode_done",
                        prompt_token_ids=list(request.prompt_token_ids),
                        text="".join(completion),
                    )

    # ----- PushKv (receiving side) -----

    async def receive_kv(self, chunks: AsyncIterator[IncomingKvChunk]) -> KvReceipt:
        """Import one request's KV chunks; the last one starts decoding.

        A transfer that breaks after the engine accepted KV aborts the request (its Decode stream
        ends with ABORT and its blocks are freed); it could never complete otherwise."""
        self._require(self.identity.role.decodes, "PushKv (roles that serve it: decode, unified)")
        ours = self.engine.kv_layout
        request_id: str | None = None
        ticket = ""
        bytes_received = blocks_received = 0
        started = done = False
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
                if c.chunk.num_blocks:
                    self.engine.import_kv(ticket, c.chunk)
                    started = True
                bytes_received += len(c.chunk.data)
                blocks_received += c.chunk.num_blocks
                if c.last:
                    # An old (v1.0) prefill worker sends no count: it always generated 1 token.
                    prefill_generated = 1 if c.generated_tokens is None else c.generated_tokens
                    started = True
                    self.engine.finish_import(
                        ticket,
                        c.num_tokens,
                        c.first_token_id,
                        prefill_generated,
                        c.draft_token_ids,
                    )
                    done = True
            if request_id is None:
                raise errors.InvalidArgument("PushKv stream carried no KvChunk")
            if not done:
                raise errors.InvalidArgument("PushKv stream ended without a KvChunk marked last")
        except BaseException:
            if started and request_id is not None:
                self.engine.abort(request_id)
            raise
        metrics.KV_TRANSFER_BYTES.labels(direction="received").inc(bytes_received)
        log.debug("kv_received", request_id=request_id, bytes=bytes_received, blocks=blocks_received)
        return KvReceipt(bytes_received=bytes_received, blocks_received=blocks_received)

    # ----- Abort, loads -----

    def abort(self, request_id: str) -> bool:
        if not request_id:
            raise errors.InvalidArgument("request_id is required")
        return self.engine.abort(request_id)

    def rank_loads(self) -> list[RankLoad]:
        return self.engine.rank_loads()

    def refresh_metrics(self) -> None:
        """Update the per-rank gauges and counters from the engine (called periodically and on
        GetLoad); the engine's cumulative counts become Prometheus counter increments."""
        for load in self.engine.rank_loads():
            dp_rank = load.dp_rank
            rank = str(dp_rank)
            total = self.engine.num_total_blocks(dp_rank)
            free = self.engine.num_free_blocks(dp_rank)
            metrics.KV_USAGE_RATIO.labels(dp_rank=rank).set((total - free) / total if total else 0.0)
            metrics.RANK_USED_TOKENS.labels(dp_rank=rank).set(load.num_used_tokens)
            metrics.RANK_RUNNING.labels(dp_rank=rank).set(load.num_running)
            metrics.RANK_WAITING.labels(dp_rank=rank).set(load.num_waiting)
            metrics.RANK_WAITING_PROMPT_TOKENS.labels(dp_rank=rank).set(
                self.engine.num_waiting_prompt_tokens(dp_rank)
            )
            preempted = self.engine.num_preemptions(dp_rank)
            seen = self._preemptions_seen.get(dp_rank, 0)
            if preempted > seen:
                metrics.PREEMPTIONS.labels(dp_rank=rank).inc(preempted - seen)
                self._preemptions_seen[dp_rank] = preempted
            self._export_spec_stats(dp_rank)

    def _export_spec_stats(self, dp_rank: int) -> None:
        now = self.engine.spec_stats(dp_rank)
        seen = self._spec_seen.get(dp_rank, SpecStats())
        rank = str(dp_rank)
        for counter, new, old in (
            (metrics.SPEC_DRAFTS, now.num_drafts, seen.num_drafts),
            (metrics.SPEC_DRAFT_TOKENS, now.num_draft_tokens, seen.num_draft_tokens),
            (metrics.SPEC_ACCEPTED_TOKENS, now.num_accepted_tokens, seen.num_accepted_tokens),
        ):
            if new > old:
                counter.labels(dp_rank=rank).inc(new - old)
        for pos, count in enumerate(now.accepted_per_position):
            before = seen.accepted_per_position[pos] if pos < len(seen.accepted_per_position) else 0
            if count > before:
                metrics.SPEC_ACCEPTED_PER_POSITION.labels(dp_rank=rank, position=str(pos)).inc(count - before)
        if now.step_cost_ms is not None:
            for term, ms in zip(("fixed", "per_seq", "per_token", "verify"), now.step_cost_ms, strict=True):
                metrics.SPEC_STEP_COST_MS.labels(dp_rank=rank, term=term).set(ms)
        self._spec_seen[dp_rank] = now

    # ----- drain -----

    @property
    def num_active(self) -> int:
        return len(self._active)

    def begin_drain(self) -> None:
        """Refuse new Prefill/Decode (UNAVAILABLE); PushKv for admitted requests still works."""
        self._draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every in-flight request finished within timeout_s."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True

    def abort_all(self) -> list[str]:
        """Abort every in-flight request except KV pushes already under way (they end soon)."""
        aborted = [rid for rid, phase in self._active.items() if phase is not Phase.PUSHING]
        for rid in aborted:
            self.engine.abort(rid)
        return aborted


def _decode_event(
    request_id: str, kind: FrameKind, out: RequestOutput, return_token_ids: bool
) -> DecodeEvent:
    """A TOKENS or FINAL frame from an engine output (FINAL carries the count and reason)."""
    final = kind is FrameKind.FINAL
    return DecodeEvent(
        request_id=request_id,
        kind=kind,
        prompt_tokens=out.num_prompt_tokens,
        local_cached_tokens=out.num_local_cached_tokens,
        transferred_cached_tokens=out.num_transferred_tokens,
        text=out.text_delta,
        token_ids=out.new_token_ids if return_token_ids else (),
        generated_tokens=out.num_generated_tokens if final else None,
        finish_reason=(out.finish_reason or FinishReason.ABORT) if final else None,
        logprobs=out.new_logprobs,
    )


def _final_event(
    request_id: str, last: RequestOutput | None, return_token_ids: bool, prompt_tokens: int
) -> DecodeEvent:
    """The one builder of the FINAL frame: from the terminal output, or (a handle that ended
    without one) an ABORT that keeps the last figures seen."""
    if last is not None and last.finished:
        return _decode_event(request_id, FrameKind.FINAL, last, return_token_ids)
    if last is None:
        return DecodeEvent(
            request_id=request_id,
            kind=FrameKind.FINAL,
            prompt_tokens=prompt_tokens,
            local_cached_tokens=0,
            transferred_cached_tokens=0,
            generated_tokens=0,
            finish_reason=FinishReason.ABORT,
        )
    return dataclasses.replace(
        _decode_event(request_id, FrameKind.FINAL, last, return_token_ids),
        text="",
        token_ids=(),
        logprobs=(),
        finish_reason=FinishReason.ABORT,
    )
