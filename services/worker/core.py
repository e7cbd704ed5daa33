"""The worker's domain core: prefill, decode, KV import, abort, loads, drain and LoRA adapters
loaded or unloaded while it runs, over one Engine (whose adapter list the worker's identity
follows).

No grpc here: the servicer converts protobuf to the messages in `messages`, calls one method,
converts back. Errors are `shared.errors` exceptions (the server interceptor maps them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import structlog

from services.worker.engine.api import (
    Engine,
    RequestKind,
    RequestOutput,
    TokenLogprobs,
)
from services.worker.frames import decode_event, final_event
from services.worker.kv_nixl import NixlKvAgent
from services.worker.kv_receive import KvLoadFailurePolicy, KvReceiver
from services.worker.kv_transfer import GrpcKvSender
from services.worker.messages import (
    DecodeCall,
    DecodeEvent,
    EarlyPush,
    IncomingKvChunk,
    KvHandoff,
    KvPusher,
    KvPushResult,
    KvReceipt,
    KvSender,
    KvTargetSpec,
    LoraChange,
    PrefillCall,
    PrefillResult,
)
from services.worker.rank_metrics import RankMetrics
from services.worker.torch_metrics import TorchMetrics
from shared import errors, metrics
from shared.cluster import DecodeFrameKind, FinishReason, KvTransport, RankLoad, WorkerInfo
from shared.tracing import tracer

log = structlog.get_logger(__name__)


class Phase(enum.Enum):
    """Where a request with a live RPC on this worker is."""

    PREFILL = "prefill"
    PUSHING = "pushing"  # its KV is being pushed to a decode worker (a drain lets it end)
    DECODE = "decode"


class WorkerCore:
    """Serves one engine's requests; tracks in-flight requests so a drain can wait for them."""

    def __init__(
        self,
        engine: Engine,
        identity: WorkerInfo,
        pusher: KvPusher,
        kv_chunk_bytes: int = 1 << 20,
        log_prompts: bool = False,
        nixl: NixlKvAgent | None = None,
        senders: Mapping[KvTransport, KvSender] | None = None,
        kv_load_failure_policy: KvLoadFailurePolicy = KvLoadFailurePolicy.RECOMPUTE,
        kv_read_timeout_s: float = 10.0,
        lora_paths: Mapping[str, str] | None = None,
        on_identity_change: Callable[[WorkerInfo], None] | None = None,
    ) -> None:
        """`lora_paths`: the folder of each adapter loaded at start (--lora-modules);
        `on_identity_change`: called with the new identity after each adapter change (the
        worker registers again with it)."""
        self.engine = engine
        self.identity = identity
        self._lora_paths = dict(lora_paths or {})
        self._on_identity_change = on_identity_change
        self._lora_lock = asyncio.Lock()  # one adapter change at a time, in arrival order
        # transports this worker sends over: the gRPC push always, NIXL where its agent is up
        self._senders: dict[KvTransport, KvSender] = {
            KvTransport.GRPC_PUSH: GrpcKvSender(engine, pusher, kv_chunk_bytes)
        }
        self._senders.update(senders or {})
        self._receiver = KvReceiver(engine, nixl, kv_load_failure_policy, kv_read_timeout_s)
        self._log_prompts = log_prompts
        # only requests with a live RPC
        self._active: dict[str, Phase] = {}
        # handoffs that go on after their Prefill replied (KvTarget.reply_before_handoff)
        self._handoffs: dict[str, asyncio.Task[None]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._rank_metrics = RankMetrics(engine)
        self._torch_metrics = TorchMetrics(engine)

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
            self._set_idle_if_idle()

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
        target = call.kv_target
        sender = None if target is None else self._sender(target)
        # the handoff starts with the prefill's first complete chunk (the gRPC push always, NIXL
        # when the decode worker takes parts), else at the end
        early_push = sender is not None and target is not None and sender.takes_early(target)
        request = dataclasses.replace(
            call.request, kind=RequestKind.PREFILL_ONLY, report_prefill_progress=early_push
        )
        rid = request.request_id
        early: EarlyPush | None = None
        started_early = False
        with self._track(rid, Phase.PREFILL), tracer().start_as_current_span("prefill") as span:
            span.set_attribute("pdserve.request_id", rid)
            span.set_attribute("pdserve.prompt_tokens", len(request.prompt_token_ids))
            handle = self.engine.add_request(request)
            token_ids: list[int] = []
            logprobs: list[TokenLogprobs] = []
            prompt_logprobs: list[TokenLogprobs] = []
            text: list[str] = []
            last: RequestOutput | None = None
            try:
                async for out in handle:
                    if not out.finished and out.num_computed_tokens:  # a prompt chunk is done
                        if not started_early and sender is not None and target is not None:
                            started_early = True
                            early = sender.start_early(rid, target, self.engine.kv_layout)
                        if early is not None:
                            early.ready(out.num_computed_tokens)
                    if last is None:
                        self._record_cache_stats(out)
                    last = out
                    token_ids.extend(out.new_token_ids)
                    logprobs.extend(out.new_logprobs)
                    prompt_logprobs.extend(out.prompt_logprobs)
                    text.append(out.text_delta)
                    if out.finished:
                        break
            except BaseException:  # the caller went away (CancelledError) or the engine failed
                self.engine.abort(rid)
                if early is not None:
                    early.cancel()
                raise
            try:
                if last is None or last.finish_reason is FinishReason.ABORT:
                    if early is not None:
                        early.cancel()
                    raise self._aborted_error(rid)
                finish = last.finish_reason  # the engine's finish rule; None: decoding goes on
                span.set_attribute("pdserve.num_chunks", last.num_prefill_chunks)
                span.set_attribute("pdserve.local_cached_tokens", last.num_local_cached_tokens)
                pushed: KvPushResult | None = None
                handed_over = False  # the release is the background handoff's
                if call.kv_target is not None:
                    # Finished at the first token: the handoff carries no KV and no first token,
                    # so the decode side ends the request at once (FINAL, its count 0).
                    first_token_id = token_ids[-1] if finish is None and token_ids else None
                    if first_token_id is not None and call.kv_target.reply_before_handoff:
                        self._hand_off_in_background(call, last, first_token_id, early)
                        handed_over = True
                    else:
                        self._active[rid] = Phase.PUSHING
                        pushed = await self._push(call, last, first_token_id, early)
            finally:
                if not handed_over:
                    self._release(rid)
            if self._log_prompts:
                log.info("prefill_done", prompt_token_ids=list(request.prompt_token_ids), text="".join(text))
            log.debug(
                "prefill_done",
                prompt_tokens=last.num_prompt_tokens,
                generated_tokens=last.num_generated_tokens,
                num_chunks=last.num_prefill_chunks,
                kv_bytes_sent=pushed.bytes_sent if pushed else 0,
            )
            return PrefillResult(
                request_id=rid,
                text="".join(text),
                token_ids=tuple(token_ids) if call.return_token_ids else (),
                generated_tokens=last.num_generated_tokens,
                finish_reason=finish,
                prompt_tokens=last.num_prompt_tokens,
                local_cached_tokens=last.num_local_cached_tokens,
                kv_bytes_sent=pushed.bytes_sent if pushed else 0,
                num_chunks=last.num_prefill_chunks,
                prefill_ns=last.prefill_ns,
                kv_transfer_ns=int(pushed.seconds * 1e9) if pushed else 0,
                kv_transport=pushed.transport if pushed else None,
                logprobs=tuple(logprobs),
                prompt_logprobs=tuple(prompt_logprobs),
            )

    async def _push(
        self, call: PrefillCall, out: RequestOutput, first_token_id: int | None, early: EarlyPush | None
    ) -> KvPushResult:
        """Hand the KV over (all of it after target.skip_blocks; none when first_token_id is
        None) by the transport the gateway negotiated, when this worker has it; or the rest of
        an early push's."""
        target = call.kv_target
        assert target is not None
        sender = self._sender(target)
        handoff = KvHandoff(
            request_id=call.request.request_id,
            layout=self.engine.kv_layout,
            num_tokens=out.num_prompt_tokens,
            first_token_id=first_token_id,
            generated_tokens=out.num_generated_tokens,
            draft_token_ids=out.draft_token_ids if first_token_id is not None else (),
        )
        with tracer().start_as_current_span("kv_transfer") as span:
            span.set_attribute("pdserve.target", target.address)
            span.set_attribute("pdserve.kv_transport", sender.transport.value)
            try:
                if early is not None:
                    span.set_attribute("pdserve.kv_early_blocks", early.num_early_blocks)
                    result = await early.finish(handoff)
                else:
                    result = await sender.send(handoff, target)
            except errors.PdserveError as exc:
                metrics.KV_TRANSFER_FAILURES.labels(transport=sender.transport.value, side="send").inc()
                span.set_attribute("pdserve.error", type(exc).__name__)
                raise
            _record_transfer(span, result)
        log.debug(
            "kv_pushed",
            target=target.address,
            transport=result.transport.value,
            bytes=result.bytes_sent,
            chunks=result.num_chunks,
            seconds=round(result.seconds, 6),
            recomputing=result.recomputing,
        )
        return result

    def _hand_off_in_background(
        self, call: PrefillCall, out: RequestOutput, first_token_id: int, early: EarlyPush | None
    ) -> None:
        """KvTarget.reply_before_handoff: the Prefill reply (the first token) goes out now and the
        handoff ends in a task that owns the held blocks (released when the decode worker
        answered, the push failed, or Abort cancelled it). A drain waits for it. A failed
        handoff is the decode worker's to report: it aborts the request, its Decode stream ends
        with ABORT before any token, and the gateway moves the request on with the first token."""
        rid = call.request.request_id

        async def hand_off() -> None:
            try:
                await self._push(call, out, first_token_id, early)
            except asyncio.CancelledError:
                if early is not None:
                    early.cancel()
                log.info("kv_handoff_aborted", request_id=rid)
            except errors.PdserveError as exc:
                log.warning("kv_handoff_failed", request_id=rid, error=str(exc))
            except Exception:  # never lost silently: the task has no awaiter
                log.exception("kv_handoff_failed", request_id=rid)
            finally:
                self._release(rid)
                self._handoffs.pop(rid, None)
                self._set_idle_if_idle()

        self._handoffs[rid] = asyncio.create_task(hand_off(), name=f"kv-handoff-{rid}")
        self._idle.clear()

    def _set_idle_if_idle(self) -> None:
        if not self._active and not self._handoffs:
            self._idle.set()

    def _sender(self, target: KvTargetSpec) -> KvSender:
        """The transport the gateway negotiated, when this worker has it; else the gRPC push."""
        return self._senders.get(target.transport, self._senders[KvTransport.GRPC_PUSH])

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
                    ticket, cached_blocks, local_cached, trim_blocks = "", 0, 0, 0
                else:
                    admission, handle = self.engine.admit_remote(request, call.transfer_ticket)
                    ticket, cached_blocks = admission.transfer_ticket, admission.num_cached_blocks
                    local_cached = admission.num_local_cached_tokens
                    trim_blocks = admission.num_trim_blocks
                yield DecodeEvent(
                    request_id=rid,
                    kind=DecodeFrameKind.ADMITTED,
                    prompt_tokens=len(request.prompt_token_ids),
                    local_cached_tokens=local_cached,
                    transferred_cached_tokens=0,
                    transfer_ticket=ticket,
                    cached_blocks=cached_blocks,
                    trim_blocks=trim_blocks,
                )
                async for out in handle:
                    if last is None:
                        self._record_cache_stats(out)
                    last = out
                    if completion is not None:
                        completion.append(out.text_delta)
                    if out.finished:
                        break
                    if (
                        out.text_delta
                        or out.new_logprobs
                        or out.prompt_logprobs
                        or (ids and out.new_token_ids)
                    ):
                        yield decode_event(rid, DecodeFrameKind.TOKENS, out, ids)
                done = True
                yield final_event(rid, last, ids, len(request.prompt_token_ids))
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
        """Import one request's KV (kv_receive.py); the last chunk starts decoding."""
        self._require(self.identity.role.decodes, "PushKv (roles that serve it: decode, unified)")
        return await self._receiver.receive(chunks)

    # ----- Abort, loads -----

    def abort(self, request_id: str) -> bool:
        if not request_id:
            raise errors.InvalidArgument("request_id is required")
        handoff = self._handoffs.get(request_id)
        if handoff is not None:
            handoff.cancel()  # its task releases the blocks (and breaks the push stream)
        return self.engine.abort(request_id) or handoff is not None

    def rank_loads(self) -> list[RankLoad]:
        return self.engine.rank_loads()

    def refresh_metrics(self) -> None:
        """Update the per-rank gauges and counters from the engine (rank_metrics.py) and torch's
        own (torch_metrics.py: GPU memory, compilations)."""
        self._rank_metrics.refresh()
        self._torch_metrics.refresh()

    # ----- LoRA adapters loaded and unloaded while the worker runs -----

    async def load_lora_adapter(self, name: str, path: str) -> LoraChange:
        """Load the PEFT adapter in folder `path` as `name` (the engine's errors: InvalidArgument,
        AlreadyExists, FailedPrecondition; nothing changes then)."""
        if not name or not path:
            raise errors.InvalidArgument("both name and path of the LoRA adapter are required")
        return await self._change_lora(self._load_lora, name, path)

    async def unload_lora_adapter(self, name: str) -> LoraChange:
        """Unload adapter `name` (NotFound: not loaded; FailedPrecondition: requests of it are
        still queued or running)."""
        if not name:
            raise errors.InvalidArgument("the name of the LoRA adapter is required")
        return await self._change_lora(self._unload_lora, name)

    async def _change_lora(self, change: Callable[..., str], *args: str) -> LoraChange:
        """Run `change` (blocking: off the event loop) after the changes before it, then make the
        identity list the engine's adapters. Shielded: a caller that goes away (its deadline)
        does not leave the engine changed and the identity not."""
        if self._draining:
            raise errors.Unavailable("worker is draining; its LoRA adapters no longer change")
        started_s = time.perf_counter()

        async def run() -> LoraChange:
            async with self._lora_lock:
                path = await asyncio.to_thread(change, *args)
                self.identity = dataclasses.replace(
                    self.identity, lora_adapters=tuple(self.engine.lora_adapters)
                )
                if self._on_identity_change is not None:
                    self._on_identity_change(self.identity)
                return LoraChange(self.identity.lora_adapters, path, time.perf_counter() - started_s)

        task = asyncio.ensure_future(run())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved if unawaited
        done = await asyncio.shield(task)
        log.info(
            "lora_adapters_changed",
            lora_adapters=list(done.lora_adapters),
            path=done.path,
            seconds=round(done.seconds, 3),
        )
        return done

    def _load_lora(self, name: str, path: str) -> str:
        self.engine.load_lora_adapter(name, path)
        self._lora_paths[name] = path
        return path

    def _unload_lora(self, name: str) -> str:
        self.engine.unload_lora_adapter(name)
        return self._lora_paths.pop(name, "")

    # ----- drain -----

    @property
    def num_active(self) -> int:
        """Requests with a live RPC, and handoffs going on after their Prefill replied."""
        return len(self._active) + len(self._handoffs)

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

    async def cancel_handoffs(self) -> None:
        """Cancel the handoffs still going on after their reply (a stop past the drain's grace)
        and wait for them to release their blocks."""
        tasks = list(self._handoffs.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def abort_all(self) -> list[str]:
        """Abort every in-flight request except KV pushes already under way (they end soon)."""
        aborted = [rid for rid, phase in self._active.items() if phase is not Phase.PUSHING]
        for rid in aborted:
            self.engine.abort(rid)
        return aborted


def _record_transfer(span: Any, result: KvPushResult) -> None:
    """One handoff's figures in its span and in Prometheus (pdserve_kv_transfer_*)."""
    transport = result.transport.value
    span.set_attribute("pdserve.bytes", result.bytes_sent)
    span.set_attribute("pdserve.num_chunks", result.num_chunks)
    span.set_attribute("pdserve.kv_transfer_seconds", result.seconds)
    if result.seconds > 0:
        span.set_attribute("pdserve.kv_transfer_bytes_per_second", result.bytes_sent / result.seconds)
    if result.read_seconds is not None:
        span.set_attribute("pdserve.kv_read_seconds", result.read_seconds)
    span.set_attribute("pdserve.kv_recomputing", result.recomputing)
    metrics.KV_TRANSFER_BYTES.labels(direction="sent").inc(result.bytes_sent)
    metrics.KV_TRANSFER_SECONDS.observe(result.seconds)
    metrics.KV_TRANSFER_REQUESTS.labels(transport=transport).inc()
    metrics.KV_TRANSFER_REQUEST_SECONDS.labels(transport=transport).observe(result.seconds)
    if result.bytes_sent and result.seconds > 0:
        metrics.KV_TRANSFER_BANDWIDTH.labels(transport=transport).observe(result.bytes_sent / result.seconds)
