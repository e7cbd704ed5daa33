"""The request life: schedule, admit on decode, prefill with a KV target, relay frames, finish;
abort both workers on cancel/deadline/error; reschedule (at most twice) when a worker is unavailable before
any output reached the client (retry before handoff); after that, migrate: when the workers fail
mid-stream, the prompt plus the tokens generated so far run on other workers and decoding
resumes at the next output index, so the client's stream goes on with no token lost or repeated
(up to `migration_limit` times). A decode worker that leaves the cluster's membership while it
carries a stream (lease expired, e.g. a SIGSTOPped process whose connection stays open) is found
by `membership.MembershipWatch`, which abandons the stream: it migrates the same way. No grpc
here: workers and the scheduler are reached through the ports in `ports.py`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from services.gateway.accounting import FrameSource
from services.gateway.breaker import CircuitBreakers, backoff_s
from services.gateway.membership import MembershipWatch, Watched
from services.gateway.ports import (
    DecodeEvent,
    DecodeEventKind,
    DecodeStream,
    KvDestination,
    Placement,
    ScheduleQuery,
    SchedulerClient,
    WorkerClient,
    WorkerGone,
    WorkerJob,
    WorkerLacksFeature,
    WorkerOutOfCapacity,
    WorkerTarget,
    WorkerUnavailable,
)
from services.gateway.request import (
    FrameKind,
    OutputFrame,
    RequestState,
    RequestStatus,
    Sampling,
    TokenLogprob,
)
from services.gateway.validation import resolve_max_tokens
from shared.block_hash import block_hashes
from shared.cluster import FinishReason, ServingMode, negotiate_kv_transport
from shared.errors import DeadlineExceeded, FailedPrecondition
from shared.tracing import tracer

log = structlog.get_logger(__name__)

T = TypeVar("T")

# The first try + two reschedules before handoff, each excluding the workers that failed (two
# workers may be down at once, e.g. a dead decode worker whose lease has not expired yet and a
# prefill worker that died meanwhile).
MAX_ATTEMPTS = 3
DEFAULT_MIGRATION_LIMIT = 3  # migrations of one request after handoff (gateway --migration-limit)


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready to schedule."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling  # max_tokens here is requested-or-default; resolved per placement
    requested_max_tokens: int | None
    default_max_tokens: int
    return_token_ids: bool


def attempt_request_id(request_id: str, attempt: int) -> str:
    """The id workers and the scheduler see. A reschedule uses a new one, so that it can never
    collide with the first attempt still winding down on a worker that is chosen again."""
    return request_id if attempt <= 1 else f"{request_id}:retry{attempt - 1}"


@dataclass
class _Attempt:
    """What one scheduling attempt started, so that it can be undone."""

    request_id: str
    placement: Placement | None = None
    started: list[str] = field(default_factory=list)  # worker addresses that know the request
    stream: DecodeStream | None = None

    def start(self, address: str) -> None:
        if address not in self.started:
            self.started.append(address)


# the worker capability (services/worker/messages.py) each optional sampling feature needs
def needed_capabilities(s: Sampling) -> set[str]:
    needed = set()
    if (
        s.presence_penalty
        or s.frequency_penalty
        or s.repetition_penalty != 1.0
        or s.logit_bias
        or s.min_tokens
    ):
        needed.add("sampling_penalties")
    if s.logprobs is not None:
        needed.add("logprobs")
    if s.structured is not None:
        needed.add("structured_outputs")
    if s.prompt_logprobs is not None:
        needed.add("prompt_logprobs")
    return needed


def _check_capabilities(s: Sampling, placement: Placement) -> None:
    """Raise WorkerLacksFeature when a chosen worker advertises capabilities but not one the
    request needs (an older worker would ignore the field). Targets without any capabilities
    listed (an old scheduler) are not checked."""
    needed = needed_capabilities(s)
    if not needed:
        return
    for target in (placement.prefill, placement.decode):
        if target is None or not target.capabilities:
            continue
        missing = needed - set(target.capabilities)
        if missing:
            raise WorkerLacksFeature(
                f"worker {target.worker_id} is older than this request needs (it lacks "
                f"{', '.join(sorted(missing))}); retry later, or leave out those fields",
                target.worker_id,
            )


class Dispatcher:
    def __init__(
        self,
        scheduler: SchedulerClient,
        workers: WorkerClient,
        block_size: int,
        control_timeout_s: float = 10.0,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        breakers: CircuitBreakers | None = None,
        membership: MembershipWatch | None = None,
    ) -> None:
        """`breakers`: per-worker circuit breakers shared by every request (None: none).
        `membership`: watches the decode workers carrying streams (None: not watched)."""
        self._scheduler = scheduler
        self._workers = workers
        self._block_size = block_size
        self._control_timeout_s = control_timeout_s
        self._migration_limit = migration_limit
        self._breakers = breakers or CircuitBreakers(failure_threshold=0)
        self._membership = membership
        self._abort_tasks: set[asyncio.Task[None]] = set()

    async def run(
        self, req: PreparedRequest, state: RequestState, deadline_s: float | None
    ) -> AsyncGenerator[OutputFrame, None]:
        """Frames for the client, the last one FINAL. Raises shared.errors on failure, after
        aborting whatever was started. deadline_s is on the time.monotonic() clock."""
        hashes = tuple(block_hashes(req.prompt_token_ids, self._block_size))
        exclude: list[str] = []
        tries = 0
        while True:
            tries += 1
            attempt = _Attempt(attempt_request_id(req.request_id, tries))
            try:
                avoid = tuple(dict.fromkeys([*exclude, *self._breakers.exclusions()]))
                frames = self._attempt(req, state, attempt, hashes, avoid, deadline_s)
                async with contextlib.aclosing(frames):
                    async for frame in frames:
                        yield frame
                self._record_success(attempt)
                return
            except (WorkerUnavailable, WorkerOutOfCapacity) as exc:
                if isinstance(exc, WorkerUnavailable):
                    self._breakers.record_failure(exc.worker_id)
                # A worker gone from membership is stopped or hung: its Abort would only time out
                # (it still goes out, and frees the KV if the worker comes back), so move on now.
                await self._undo(attempt, wait=not isinstance(exc, WorkerGone))
                if state.handed_off:
                    self._check_migratable(state, exc)  # raises (after state.fail) when not
                    log.warning(
                        "migrating",
                        error=str(exc),
                        exclude_worker_id=exc.worker_id or None,
                        generated_tokens=len(state.resume_token_ids),
                        migration=state.migrations + 1,
                    )
                    if exc.worker_id:
                        exclude.append(exc.worker_id)
                    state.begin_migration()
                    await self._pause(state.migrations, deadline_s)
                    continue
                if tries >= MAX_ATTEMPTS:
                    state.fail()
                    raise
                log.warning("retry_before_handoff", error=str(exc), exclude_worker_id=exc.worker_id or None)
                if exc.worker_id:
                    exclude.append(exc.worker_id)
                if state.status is not RequestStatus.WAITING:
                    state.reset_for_retry()
                await self._pause(tries, deadline_s)
            except (asyncio.CancelledError, GeneratorExit, DeadlineExceeded):
                # The state ends first: a second cancellation while the aborts go out must not
                # leave the request logged (and counted) as still running.
                if not state.status.is_finished:
                    state.finish(FinishReason.ABORT)
                await self._undo(attempt)
                raise
            except BaseException:
                state.fail()
                await self._undo(attempt)
                raise

    def _record_success(self, attempt: _Attempt) -> None:
        placement = attempt.placement
        if placement is not None:
            self._breakers.record_success(placement.decode.worker_id)
            if placement.prefill is not None:
                self._breakers.record_success(placement.prefill.worker_id)

    async def _pause(self, retry: int, deadline_s: float | None) -> None:
        """Jittered exponential backoff before retry/migration number `retry`, within the deadline."""
        pause_s = backoff_s(retry)
        remaining = self._remaining(deadline_s)
        await asyncio.sleep(pause_s if remaining is None else min(pause_s, remaining))

    def _check_migratable(self, state: RequestState, exc: WorkerUnavailable | WorkerOutOfCapacity) -> None:
        """Raise (the request failed) unless it may move on to other workers."""
        why = ""
        if state.migrations >= self._migration_limit:
            why = (
                f"gave up after {state.migrations} migration(s) (the gateway's --migration-limit)"
                if self._migration_limit
                else "migration is disabled (--migration-limit 0)"
            )
        elif not state.can_resume:
            why = "the workers did not return the generated token ids needed to resume it"
        if why:
            state.fail()
            raise WorkerUnavailable(
                f"{exc}; the request failed after {state.num_completion_tokens} generated token(s): {why}",
                exc.worker_id,
            ) from exc

    async def _attempt(
        self,
        req: PreparedRequest,
        state: RequestState,
        attempt: _Attempt,
        hashes: tuple[int, ...],
        exclude: tuple[str, ...],
        deadline_s: float | None,
    ) -> AsyncGenerator[OutputFrame, None]:
        generated = state.resume_token_ids if state.migrations else ()
        prompt = req.prompt_token_ids + generated
        if generated:  # a migrated run: the prompt holds the tokens generated so far
            if len(generated) >= state.max_tokens:  # the worker died before its FINAL frame
                state.finish()
                yield self._frame(state, FrameKind.FINAL, "", ())
                return
            hashes = tuple(block_hashes(prompt, self._block_size))
        query = ScheduleQuery(
            request_id=attempt.request_id,
            model=req.model,
            prompt_tokens=len(prompt),
            prefix_block_hashes=hashes,
            max_tokens=(state.max_tokens if generated else req.sampling.max_tokens) - len(generated),
            exclude_worker_ids=exclude,
        )
        with tracer().start_as_current_span("schedule") as span:
            span.set_attribute("pdserve.prompt_tokens", query.prompt_tokens)
            placement = await self._within(
                self._scheduler.schedule(query, self._control_timeout(deadline_s)), deadline_s
            )
            span.set_attribute("pdserve.mode", placement.mode.value)
        attempt.placement = placement
        _check_capabilities(req.sampling, placement)
        if state.migrations:
            max_tokens = state.max_tokens  # fixed when first scheduled
        else:
            max_tokens = resolve_max_tokens(
                req.requested_max_tokens,
                req.default_max_tokens,
                len(req.prompt_token_ids),
                placement.max_model_len,
            )
        state.mark_scheduled(max_tokens)
        job = WorkerJob(
            request_id=attempt.request_id,
            prompt_token_ids=prompt,
            sampling=dataclasses.replace(
                req.sampling,
                max_tokens=max_tokens - len(generated),
                first_output_index=len(generated),
                unshown_tail_tokens=state.unshown_tail_tokens if generated else 0,
                # a migrated run's prompt logprobs already went out with the first frame
                prompt_logprobs=None if state.migrations else req.sampling.prompt_logprobs,
            ),
            # Always: the ids of the tokens generated so far are what a migration resumes from.
            # The client gets them only when it asked (OutputFrame, from state.return_token_ids).
            return_token_ids=True,
        )
        log.debug(
            "scheduled",
            mode=placement.mode.value,
            decode=placement.decode.worker_id,
            prefill=placement.prefill.worker_id if placement.prefill else None,
            max_tokens=max_tokens,
        )
        if placement.mode is ServingMode.DISAGGREGATED:
            if placement.prefill is None:
                raise FailedPrecondition("the scheduler chose disaggregated serving without a prefill worker")
            if max_tokens == 0:  # only the prompt is scored: no decode worker, no KV handoff
                frames = self._prefill_only(state, attempt, placement.prefill, job, deadline_s)
            else:
                frames = self._disaggregated(
                    state, attempt, placement.prefill, placement.decode, job, deadline_s
                )
        else:
            frames = self._aggregated(state, attempt, placement.decode, job, deadline_s)
        async with contextlib.aclosing(frames):
            async for frame in frames:
                yield frame

    async def _disaggregated(
        self,
        state: RequestState,
        attempt: _Attempt,
        prefill: WorkerTarget,
        decode: WorkerTarget,
        job: WorkerJob,
        deadline_s: float | None,
    ) -> AsyncGenerator[OutputFrame, None]:
        # 1. The decode worker admits the request first: it reserves KV and issues a ticket.
        attempt.start(decode.address)
        stream = attempt.stream = self._workers.decode(
            decode, job, local_prefill=False, timeout_s=self._remaining(deadline_s)
        )
        with self._watching(decode, stream) as watched:  # from admission on: a gone worker ends it
            admitted = await self._within(stream.next(), deadline_s)
            if admitted is None or admitted.kind is not DecodeEventKind.ADMITTED:
                got = "the end of the stream" if admitted is None else f"a {admitted.kind.value} frame"
                raise WorkerUnavailable(
                    f"decode worker {decode.worker_id} did not admit the request (got {got})",
                    decode.worker_id,
                )
            # The decode worker's own cache hits and the KV it receives are not cache hits for this
            # request: the prefill worker computes every prompt token it does not find in ITS cache.
            state.advance(RequestStatus.ADMITTED)
            # 2. The prefill worker runs the prompt and pushes KV straight to that decode rank.
            kv = KvDestination(
                decode.address,
                decode.dp_rank,
                admitted.transfer_ticket,
                admitted.cached_blocks,
                negotiate_kv_transport(prefill.capabilities, decode.capabilities),
                admitted.trim_blocks,
            )
            state.advance(RequestStatus.PREFILLING)
            attempt.start(prefill.address)
            reply = await self._within(
                self._unless_gone(
                    lambda: self._workers.prefill(prefill, job, kv, self._remaining(deadline_s)), watched
                ),
                deadline_s,
            )
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
                await self._abort_all([decode.address], job.request_id)
                state.finish()
                yield _with_prompt_logprobs(
                    state,
                    self._frame(state, FrameKind.FINAL, reply.text, reply.token_ids, reply.logprobs),
                    reply.prompt_logprobs,
                )
                return
            # 3. The first token goes to the client at once (TTFT); decode continues.
            kind = FrameKind.CONTINUATION if state.handed_off else FrameKind.FIRST  # migrated: goes on
            state.advance(RequestStatus.DECODING)
            yield _with_prompt_logprobs(
                state,
                self._frame(state, kind, reply.text, reply.token_ids, reply.logprobs),
                reply.prompt_logprobs,
            )
            relayed = self._relay(state, stream, decode, deadline_s, prefilled_here=False)
            async with contextlib.aclosing(relayed):
                async for frame in relayed:
                    yield frame

    async def _prefill_only(
        self,
        state: RequestState,
        attempt: _Attempt,
        prefill: WorkerTarget,
        job: WorkerJob,
        deadline_s: float | None,
    ) -> AsyncGenerator[OutputFrame, None]:
        """max_tokens 0 (prompt logprobs only): the prefill worker runs the prompt with no KV
        target, so it frees the KV at once; no decode worker is involved."""
        attempt.start(prefill.address)
        state.advance(RequestStatus.PREFILLING)
        reply = await self._within(
            self._workers.prefill(prefill, job, None, self._remaining(deadline_s)), deadline_s
        )
        state.record_cache(local_tokens=reply.local_cached_tokens, transferred_tokens=0)
        state.record_output(
            FrameSource.PREFILL_REPLY,
            reply.text,
            reply.token_ids,
            reply.generated_tokens,
            reply.finish_reason,
        )
        state.finish()
        yield _with_prompt_logprobs(
            state,
            self._frame(state, FrameKind.FINAL, reply.text, reply.token_ids, reply.logprobs),
            reply.prompt_logprobs,
        )

    async def _aggregated(
        self,
        state: RequestState,
        attempt: _Attempt,
        target: WorkerTarget,
        job: WorkerJob,
        deadline_s: float | None,
    ) -> AsyncGenerator[OutputFrame, None]:
        attempt.start(target.address)
        state.advance(RequestStatus.PREFILLING)
        stream = attempt.stream = self._workers.decode(
            target, job, local_prefill=True, timeout_s=self._remaining(deadline_s)
        )
        with self._watching(target, stream):
            relayed = self._relay(state, stream, target, deadline_s, prefilled_here=True)
            async with contextlib.aclosing(relayed):
                async for frame in relayed:
                    yield frame

    def _watching(
        self, target: WorkerTarget, stream: DecodeStream
    ) -> contextlib.AbstractContextManager[Watched | None]:
        if self._membership is None:
            return contextlib.nullcontext()
        return self._membership.tracking(target, stream)

    @staticmethod
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
        self,
        state: RequestState,
        stream: DecodeStream,
        target: WorkerTarget,
        deadline_s: float | None,
        prefilled_here: bool,
    ) -> AsyncGenerator[OutputFrame, None]:
        """Relays decode frames. `prefilled_here`: the decode worker ran the prompt itself
        (aggregated / local prefill), so its prefix-cache hits are this request's local hits."""
        while True:
            event: DecodeEvent | None = await self._within(stream.next(), deadline_s)
            if event is None:
                raise WorkerUnavailable(
                    f"decode worker {target.worker_id} ended the stream without a final frame "
                    f"after {state.num_completion_tokens} tokens",
                    target.worker_id,
                )
            if prefilled_here:
                state.record_cache(local_tokens=event.local_cached_tokens, transferred_tokens=0)
            if event.kind is DecodeEventKind.ADMITTED:
                continue  # aggregated: admission carries only cache figures
            if event.kind is DecodeEventKind.FINAL:
                state.record_output(
                    FrameSource.DECODE_FINAL,
                    event.text,
                    event.token_ids,
                    event.generated_tokens,
                    event.finish_reason,
                )
                state.finish()
                yield _with_prompt_logprobs(
                    state,
                    self._frame(state, FrameKind.FINAL, event.text, event.token_ids, event.logprobs),
                    event.prompt_logprobs,
                )
                return
            # TOKENS frames: counts ride on FINAL only, so any count here is ignored by design.
            state.record_output(FrameSource.DECODE_TOKENS, event.text, event.token_ids, None, None)
            kind = FrameKind.CONTINUATION if state.handed_off else FrameKind.FIRST
            if state.status < RequestStatus.DECODING:
                state.advance(RequestStatus.DECODING)
            yield _with_prompt_logprobs(
                state,
                self._frame(state, kind, event.text, event.token_ids, event.logprobs),
                event.prompt_logprobs,
            )

    def _frame(
        self,
        state: RequestState,
        kind: FrameKind,
        text: str,
        token_ids: tuple[int, ...],
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> OutputFrame:
        state.note_frame_sent()
        final = kind is FrameKind.FINAL
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
        )

    # --- undo ---
    async def _undo(self, attempt: _Attempt, wait: bool = True) -> None:
        """Cancel the decode stream and abort the request on every worker this attempt reached
        (`wait`: until those Abort calls ended; else they go on in the background)."""
        if attempt.stream is not None:
            attempt.stream.cancel()
        await self._abort_all(attempt.started, attempt.request_id, wait)

    async def _abort_all(self, addresses: list[str], request_id: str, wait: bool = True) -> None:
        if not addresses:
            return
        tasks = [asyncio.ensure_future(self._abort_one(a, request_id)) for a in addresses]
        for task in tasks:  # keep them alive even if our caller is cancelled while waiting
            self._abort_tasks.add(task)
            task.add_done_callback(self._abort_tasks.discard)
        if not wait:
            return
        # If our caller is cancelled meanwhile, the aborts go on; wait_for_aborts() collects them.
        await asyncio.shield(asyncio.gather(*tasks))

    async def _abort_one(self, address: str, request_id: str) -> None:
        try:
            found = await asyncio.wait_for(self._workers.abort(address, request_id), self._control_timeout_s)
            log.info("aborted_on_worker", worker=address, found=found)
        except Exception as exc:  # best effort: the worker may be gone; its lease frees the KV
            log.warning("abort_failed", worker=address, error=str(exc) or type(exc).__name__)

    async def wait_for_aborts(self, timeout_s: float) -> None:
        """Let pending Abort calls finish (graceful shutdown)."""
        if self._abort_tasks:
            await asyncio.wait(list(self._abort_tasks), timeout=timeout_s)

    # --- deadlines ---
    def _remaining(self, deadline_s: float | None) -> float | None:
        if deadline_s is None:
            return None
        return max(0.001, deadline_s - time.monotonic())

    def _control_timeout(self, deadline_s: float | None) -> float:
        remaining = self._remaining(deadline_s)
        return self._control_timeout_s if remaining is None else min(remaining, self._control_timeout_s)

    async def _within(self, aw: Awaitable[T], deadline_s: float | None) -> T:
        """Await `aw` until the request's deadline (no extra task per frame)."""
        if deadline_s is None:
            return await aw
        remaining = deadline_s - time.monotonic()
        if remaining <= 0:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise self._deadline_error()
        timeout = asyncio.timeout(remaining)
        try:
            async with timeout:
                return await aw
        except TimeoutError:
            if timeout.expired():
                raise self._deadline_error() from None
            raise

    @staticmethod
    def _deadline_error() -> DeadlineExceeded:
        return DeadlineExceeded("the request ran past its deadline and was aborted on the workers")


def _with_prompt_logprobs(
    state: RequestState, frame: OutputFrame, prompt_logprobs: tuple[TokenLogprob, ...]
) -> OutputFrame:
    """The frame carrying the prompt logprobs a worker returned, with the prompt's ids (so a
    client sees which token each is for); other frames unchanged. (A prompt of one token has
    no entries, so no frame carries them.)"""
    if not prompt_logprobs:
        return frame
    return dataclasses.replace(
        frame, prompt_token_ids=state.prompt_token_ids, prompt_logprobs=prompt_logprobs
    )
