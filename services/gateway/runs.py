"""One run of a request on the workers a placement chose, turned into the client's frames:
disaggregated (the decode worker admits it and reserves KV, the prefill worker runs the prompt and
pushes its KV there, the first token goes out at once, decode frames follow) or aggregated (one
Decode that prefills locally). Every worker message is recorded on the RequestState, which
derives the frames' usage and finish reason. `Attempt` records what a run started so that the
dispatcher can undo it. No grpc here: workers are reached through `ports.WorkerClient`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from services.gateway.aborts import Aborter
from services.gateway.accounting import FrameSource
from services.gateway.deadline import ReadDeadline, remaining_s, within
from services.gateway.inputs import TokenLogprob
from services.gateway.membership import MembershipWatch, Watched
from services.gateway.ports import (
    DecodeEvent,
    DecodeStream,
    KvDestination,
    Placement,
    PrefillResult,
    WorkerClient,
    WorkerGone,
    WorkerJob,
    WorkerTarget,
    WorkerUnavailable,
)
from services.gateway.request import OutputFrame, OutputFrameKind, RequestState, RequestStatus
from shared.cluster import (
    GATEWAY_TICKET_CAPABILITY,
    DecodeFrameKind,
    FinishReason,
    KvTransport,
    negotiate_kv_transport,
    negotiate_nixl_parts,
)
from shared.futures import retrieve_quietly

T = TypeVar("T")


@dataclass
class Attempt:
    """What one scheduling attempt started, so that it can be undone."""

    request_id: str
    placement: Placement | None = None
    started: list[str] = field(default_factory=list)  # worker addresses that know the request
    stream: DecodeStream | None = None

    def start(self, address: str) -> None:
        if address not in self.started:
            self.started.append(address)


@dataclass(frozen=True)
class _Run:
    """One disaggregated run's own: the request, what it started, its job and deadline."""

    state: RequestState
    attempt: Attempt
    job: WorkerJob
    deadline_s: float | None


@dataclass(frozen=True)
class _Pair:
    """A prefill and a decode worker, and how KV goes between them: the transport and NIXL parts
    their capabilities agree on, and the ticket the gateway chooses (over NIXL, to a decode
    worker that takes it: the prefill then starts with the admission; None: the decode worker
    gives one at ADMITTED)."""

    prefill: WorkerTarget
    decode: WorkerTarget
    transport: KvTransport
    nixl_parts: bool
    ticket: str | None

    @classmethod
    def negotiate(cls, prefill: WorkerTarget, decode: WorkerTarget) -> _Pair:
        transport = negotiate_kv_transport(prefill.capabilities, decode.capabilities)
        ticket = None
        if transport is KvTransport.NIXL and GATEWAY_TICKET_CAPABILITY in decode.capabilities:
            ticket = f"{decode.dp_rank}-{uuid.uuid4().hex}"
        nixl_parts = negotiate_nixl_parts(prefill.capabilities, decode.capabilities)
        return cls(prefill, decode, transport, nixl_parts, ticket)


class WorkerRuns:
    def __init__(
        self,
        workers: WorkerClient,
        aborter: Aborter,
        membership: MembershipWatch | None,
        first_token_before_handoff: bool = True,
    ) -> None:
        """`membership`: watches the decode workers carrying streams (None: not watched).
        `first_token_before_handoff`: ask prefill workers to answer before their handoff ends."""
        self._workers = workers
        self._aborter = aborter
        self._membership = membership
        self._first_token_before_handoff = first_token_before_handoff

    async def disaggregated(
        self,
        state: RequestState,
        attempt: Attempt,
        prefill: WorkerTarget,
        decode: WorkerTarget,
        job: WorkerJob,
        deadline_s: float | None,
    ) -> AsyncGenerator[OutputFrame, None]:
        # 1. The decode worker admits the request: it reserves KV and registers a ticket. Over
        # NIXL, to a decode worker that takes the gateway's ticket, the prefill (step 2) starts at
        # once with it: the decode worker READs only the blocks it lacks, so the prefill worker
        # needs none of the admission's figures, and the admission leaves the TTFT.
        pair = _Pair.negotiate(prefill, decode)
        attempt.start(decode.address)
        stream = attempt.stream = self._workers.decode(
            decode, job, local_prefill=False, timeout_s=remaining_s(deadline_s), transfer_ticket=pair.ticket
        )
        with self._watching(decode, stream) as watched:  # from admission on: a gone worker ends it
            run = _Run(state, attempt, job, deadline_s)
            reply = await self._admit_and_prefill(run, pair, stream, watched)
            state.record_cache(local_tokens=0, transferred_tokens=reply.local_cached_tokens)
            state.record_output(
                FrameSource.PREFILL_REPLY,
                reply.text,
                reply.token_ids,
                reply.generated_tokens,
                reply.finish_reason,
            )
            if reply.finish_reason is not None:
                # Finished at the first token (EOS, stop, max_tokens=1): free the decode side's KV.
                stream.cancel()
                await self._aborter.abort_all([decode.address], job.request_id)
                yield _final(state, reply.text, reply.token_ids, reply.logprobs, reply.prompt_logprobs)
                return
            # 3. The first token goes to the client at once (TTFT); decode continues.
            kind = (
                OutputFrameKind.CONTINUATION if state.handed_off else OutputFrameKind.FIRST
            )  # migrated: goes on
            state.advance(RequestStatus.DECODING)
            yield _with_prompt_logprobs(
                state, frame(state, kind, reply.text, reply.token_ids, reply.logprobs), reply.prompt_logprobs
            )
            # The handoff may still be under way (reply_before_handoff): a decode worker that
            # ends the request before any token lost its KV (the prefill worker died or the
            # transfer failed), a failure of the handoff, not a cancellation the client asked
            # for. A prefill worker that hangs (or dies before its push reached the decode
            # worker) breaks nothing the decode worker would see: it is watched until then.
            handoff = prefill if self._first_token_before_handoff else None
            with contextlib.ExitStack() as handoff_watch:
                if handoff is not None:
                    handoff_watch.enter_context(self._watching(prefill, stream))
                relayed = _relay(
                    state,
                    stream,
                    decode,
                    deadline_s,
                    prefilled_here=False,
                    handoff_from=handoff,
                    handoff_watch=handoff_watch,
                )
                async with contextlib.aclosing(relayed):
                    async for out in relayed:
                        yield out

    async def _admit_and_prefill(
        self, run: _Run, pair: _Pair, stream: DecodeStream, watched: Watched | None
    ) -> PrefillResult:
        """ADMITTED from `stream`, and the prefill worker's reply: the Prefill call goes out at once
        under the gateway's ticket (`pair.ticket`, no blocks skipped), else after ADMITTED with
        its ticket and figures. A prefill still running when this ends otherwise (the admission
        failed, the run was cancelled) is cancelled."""
        decode = pair.decode

        def start_prefill(
            ticket: str, skip_blocks: int, trim_blocks: int | None
        ) -> asyncio.Task[PrefillResult]:
            kv = KvDestination(
                decode.address,
                decode.dp_rank,
                ticket,
                skip_blocks,
                pair.transport,
                trim_blocks,
                pair.nixl_parts,
                self._first_token_before_handoff,
            )
            run.attempt.start(pair.prefill.address)
            return asyncio.ensure_future(
                self._workers.prefill(pair.prefill, run.job, kv, remaining_s(run.deadline_s))
            )

        prefilling = None if pair.ticket is None else start_prefill(pair.ticket, 0, None)
        try:
            admitted = await within(stream.next(), run.deadline_s)
            if admitted is None or admitted.kind is not DecodeFrameKind.ADMITTED:
                got = "the end of the stream" if admitted is None else f"a {admitted.kind.value} frame"
                raise WorkerUnavailable(
                    f"decode worker {decode.worker_id} did not admit the request (got {got})",
                    decode.worker_id,
                )
            # The decode worker's own cache hits and the KV it receives are not cache hits for this
            # request: the prefill worker computes every prompt token it does not find in ITS cache.
            run.state.advance(RequestStatus.ADMITTED)
            # 2. The prefill worker runs the prompt and pushes KV straight to that decode rank.
            if prefilling is None:
                prefilling = start_prefill(
                    admitted.transfer_ticket, admitted.cached_blocks, admitted.trim_blocks
                )
            run.state.advance(RequestStatus.PREFILLING)
            running = prefilling
            return await within(_unless_gone(lambda: running, watched), run.deadline_s)
        finally:
            if prefilling is not None:
                if not prefilling.done():
                    prefilling.cancel()  # the admission failed, or this run was cancelled
                prefilling.add_done_callback(retrieve_quietly)  # an error nobody awaited is not logged

    async def prefill_only(
        self,
        state: RequestState,
        attempt: Attempt,
        prefill: WorkerTarget,
        job: WorkerJob,
        deadline_s: float | None,
    ) -> AsyncGenerator[OutputFrame, None]:
        """max_tokens 0 (prompt logprobs only): the prefill worker runs the prompt with no KV
        target, so it frees the KV at once; no decode worker is involved."""
        attempt.start(prefill.address)
        state.advance(RequestStatus.PREFILLING)
        reply = await within(self._workers.prefill(prefill, job, None, remaining_s(deadline_s)), deadline_s)
        state.record_cache(local_tokens=reply.local_cached_tokens, transferred_tokens=0)
        state.record_output(
            FrameSource.PREFILL_REPLY,
            reply.text,
            reply.token_ids,
            reply.generated_tokens,
            reply.finish_reason,
        )
        yield _final(state, reply.text, reply.token_ids, reply.logprobs, reply.prompt_logprobs)

    async def aggregated(
        self,
        state: RequestState,
        attempt: Attempt,
        target: WorkerTarget,
        job: WorkerJob,
        deadline_s: float | None,
    ) -> AsyncGenerator[OutputFrame, None]:
        attempt.start(target.address)
        state.advance(RequestStatus.PREFILLING)
        stream = attempt.stream = self._workers.decode(
            target, job, local_prefill=True, timeout_s=remaining_s(deadline_s)
        )
        with self._watching(target, stream):
            relayed = _relay(state, stream, target, deadline_s, prefilled_here=True)
            async with contextlib.aclosing(relayed):
                async for out in relayed:
                    yield out

    def _watching(
        self, target: WorkerTarget, stream: DecodeStream
    ) -> contextlib.AbstractContextManager[Watched | None]:
        if self._membership is None:
            return contextlib.nullcontext()
        return self._membership.tracking(target, stream)


async def _unless_gone(call: Callable[[], Awaitable[T]], watched: Watched | None) -> T:
    """Await `call()` (the prefill, which pushes KV to the watched decode worker) unless that
    worker is found gone first: then it is cancelled and WorkerGone raised (a retry before
    the handoff, excluding it), instead of waiting for the prefill worker's push to time out."""
    if watched is None:
        return await call()
    work = asyncio.ensure_future(call())
    gone = asyncio.ensure_future(watched.gone.wait())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the worker is gone, or our caller was cancelled
            work.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    raise WorkerGone(watched.reason, watched.target.worker_id)


async def _relay(
    state: RequestState,
    stream: DecodeStream,
    target: WorkerTarget,
    deadline_s: float | None,
    prefilled_here: bool,
    handoff_from: WorkerTarget | None = None,
    handoff_watch: contextlib.ExitStack | None = None,
) -> AsyncGenerator[OutputFrame, None]:
    """Relays decode frames. `prefilled_here`: the decode worker ran the prompt itself
    (aggregated / local prefill), so its prefix-cache hits are this request's local hits.
    `handoff_from`: the prefill worker whose KV handoff may not have ended yet (it answered at
    the first token); until the decode worker's first frame after admission, a FINAL with
    finish reason ABORT is that handoff's failure (WorkerUnavailable: the request moves on),
    and `handoff_watch` (the membership watch of that worker) is closed at that frame."""
    with ReadDeadline(deadline_s) as until:  # one timer for the stream, not one per frame
        while True:
            event: DecodeEvent | None = await until.read(stream.next())
            if event is None:
                raise WorkerUnavailable(
                    f"decode worker {target.worker_id} ended the stream without a final frame "
                    f"after {state.num_completion_tokens} tokens",
                    target.worker_id,
                )
            if prefilled_here:
                state.record_cache(local_tokens=event.local_cached_tokens, transferred_tokens=0)
            if event.kind is DecodeFrameKind.ADMITTED:
                continue  # aggregated: admission carries only cache figures
            if handoff_from is not None:
                if event.kind is DecodeFrameKind.FINAL and event.finish_reason is FinishReason.ABORT:
                    raise WorkerUnavailable(
                        f"the KV handoff from prefill worker {handoff_from.worker_id} to decode "
                        f"worker {target.worker_id} failed after the first token",
                        handoff_from.worker_id,
                    )
                handoff_from = None  # the KV landed: the decode worker produced a frame
                if handoff_watch is not None:
                    handoff_watch.close()
            if event.kind is DecodeFrameKind.FINAL:
                state.record_output(
                    FrameSource.DECODE_FINAL,
                    event.text,
                    event.token_ids,
                    event.generated_tokens,
                    event.finish_reason,
                )
                yield _final(state, event.text, event.token_ids, event.logprobs, event.prompt_logprobs)
                return
            # TOKENS frames: counts ride on FINAL only, so any count here is ignored by design.
            state.record_output(FrameSource.DECODE_TOKENS, event.text, event.token_ids, None, None)
            kind = OutputFrameKind.CONTINUATION if state.handed_off else OutputFrameKind.FIRST
            if state.status < RequestStatus.DECODING:
                state.advance(RequestStatus.DECODING)
            yield _with_prompt_logprobs(
                state, frame(state, kind, event.text, event.token_ids, event.logprobs), event.prompt_logprobs
            )


def frame(
    state: RequestState,
    kind: OutputFrameKind,
    text: str,
    token_ids: tuple[int, ...],
    logprobs: tuple[TokenLogprob, ...] = (),
) -> OutputFrame:
    """The client's next frame (noted as sent); FINAL ones carry the state's usage and finish.
    With return_token_ids the client's first frame carries the prompt's ids too (the HTTP face
    shows them: vLLM's prompt_token_ids)."""
    first = state.return_token_ids and not state.handed_off
    state.note_frame_sent()
    final = kind is OutputFrameKind.FINAL
    return OutputFrame(
        request_id=state.request_id,
        kind=kind,
        text=text,
        token_ids=token_ids if state.return_token_ids else (),
        prompt_tokens=state.num_prompt_tokens,
        cached_tokens=state.cache.cached_tokens,
        model=state.model,
        finish_reason=state.finish_reason if final else None,
        usage=state.usage if final else None,
        logprobs=logprobs,
        completion_tokens=state.num_completion_tokens if final or state.continuous_usage else 0,
        prompt_token_ids=state.prompt_token_ids if first else (),
    )


def _final(
    state: RequestState,
    text: str,
    token_ids: tuple[int, ...],
    logprobs: tuple[TokenLogprob, ...],
    prompt_logprobs: tuple[TokenLogprob, ...],
) -> OutputFrame:
    """The run's last frame: the state finishes, the frame carries its usage and finish reason
    (and the prompt logprobs the worker returned with it)."""
    state.finish()
    return _with_prompt_logprobs(
        state, frame(state, OutputFrameKind.FINAL, text, token_ids, logprobs), prompt_logprobs
    )


def _with_prompt_logprobs(
    state: RequestState, out: OutputFrame, prompt_logprobs: tuple[TokenLogprob, ...]
) -> OutputFrame:
    """The frame carrying the prompt logprobs a worker returned, with the prompt's ids (so a
    client sees which token each is for); other frames unchanged. (A prompt of one token has
    no entries, so no frame carries them.)"""
    if not prompt_logprobs:
        return out
    return dataclasses.replace(out, prompt_token_ids=state.prompt_token_ids, prompt_logprobs=prompt_logprobs)
