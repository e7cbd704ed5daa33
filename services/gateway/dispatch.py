"""The request life across attempts: schedule, run the placement (`runs.py`: admit on decode,
prefill with a KV target, relay frames), finish; abort the workers reached on cancel/deadline/error
(`aborts.py`); reschedule (at most twice) when a worker is unavailable before
any output reached the client (retry before handoff); after that, migrate: when the workers fail
mid-stream, the prompt plus the tokens generated so far run on other workers and decoding
resumes at the next output index, so the client's stream goes on with no token lost or repeated
(up to `migration_limit` times). A decode worker that leaves the cluster's membership while it
carries a stream (lease expired, e.g. a SIGSTOPped process whose connection stays open) is found
by `membership.MembershipWatch`, which abandons the stream: it migrates the same way. The request's
max_tokens is resolved here, once, before the first Schedule call, against the model's smallest
max_model_len as last listed (`model_cards.py`), and only refitted to a placement whose workers
accept less (`budget.py`). No grpc here: workers and the scheduler are reached through the ports
in `ports.py`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import structlog

from services.gateway import deadline
from services.gateway.aborts import Aborter
from services.gateway.breaker import CircuitBreakers, backoff_s
from services.gateway.budget import MaxTokens
from services.gateway.capabilities import check_capabilities
from services.gateway.inputs import Sampling
from services.gateway.membership import MembershipWatch
from services.gateway.model_cards import ModelCards
from services.gateway.ports import (
    ScheduleQuery,
    SchedulerClient,
    WorkerClient,
    WorkerGone,
    WorkerJob,
    WorkerOutOfCapacity,
    WorkerUnavailable,
)
from services.gateway.request import OutputFrame, OutputFrameKind, RequestState, RequestStatus
from services.gateway.runs import Attempt, WorkerRuns, frame
from shared.block_hash import block_hashes, chain_root
from shared.cluster import FinishReason, ServingMode
from shared.errors import DeadlineExceeded, FailedPrecondition
from shared.tracing import tracer

log = structlog.get_logger(__name__)

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
    sampling: Sampling  # the same for every run; a run's max_tokens is set when its job is built
    max_tokens: MaxTokens  # resolved once before scheduling (Dispatcher.run; budget.py)
    return_token_ids: bool
    priority: int = 0  # lower is served first (admission queue and workers' queues)
    continuous_usage: bool = False  # every frame carries completion_tokens so far


def attempt_request_id(request_id: str, attempt: int) -> str:
    """The id workers and the scheduler see. A reschedule uses a new one, so that it can never
    collide with the first attempt still winding down on a worker that is chosen again."""
    return request_id if attempt <= 1 else f"{request_id}:retry{attempt - 1}"


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
        model_cards: ModelCards | None = None,
        first_token_before_handoff: bool = True,
    ) -> None:
        """`breakers`: per-worker circuit breakers shared by every request (None: none).
        `membership`: watches the decode workers carrying streams (None: not watched).
        `model_cards`: the cluster's models, whose max_model_len a budget is resolved against
        (None: cards fetched from `scheduler`). `first_token_before_handoff`: disaggregated runs
        ask the prefill worker to answer before its KV handoff ends (KvTarget.reply_before_handoff)."""
        self._scheduler = scheduler
        self.model_cards = model_cards or ModelCards(scheduler)
        self._block_size = block_size
        self._control_timeout_s = control_timeout_s
        self._migration_limit = migration_limit
        self._breakers = breakers or CircuitBreakers(failure_threshold=0)
        self._aborter = Aborter(workers, control_timeout_s)
        # a handoff that fails after the first token went out moves the request on like a
        # migration: with migration off the first token waits for the handoff (a failure before
        # it is retried unseen)
        early = first_token_before_handoff and migration_limit > 0
        self._runs = WorkerRuns(workers, self._aborter, membership, early)

    async def run(
        self, req: PreparedRequest, state: RequestState, deadline_s: float | None
    ) -> AsyncGenerator[OutputFrame, None]:
        """Frames for the client, the last one FINAL. Raises shared.errors on failure, after
        aborting whatever was started. deadline_s is on the time.monotonic() clock."""
        try:  # before any Schedule call: nothing to undo
            budget = await self._resolve_budget(req, state, deadline_s)
        except asyncio.CancelledError:
            state.finish(FinishReason.ABORT)
            raise
        except BaseException:
            state.fail()
            raise
        # the workers' prefix-cache keys: under the request's cache salt and LoRA adapter, if any
        root = chain_root(req.sampling.cache_salt, req.sampling.lora_adapter)
        hashes = tuple(block_hashes(req.prompt_token_ids, self._block_size, root))
        exclude: list[str] = []
        tries = 0
        while True:
            tries += 1
            attempt = Attempt(attempt_request_id(req.request_id, tries))
            try:
                avoid = tuple(dict.fromkeys([*exclude, *self._breakers.exclusions()]))
                frames = self._attempt(req, state, attempt, budget, hashes, avoid, deadline_s)
                async with contextlib.aclosing(frames):
                    async for out in frames:
                        yield out
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

    async def _resolve_budget(
        self, req: PreparedRequest, state: RequestState, deadline_s: float | None
    ) -> int:
        """The request's budget (tokens), resolved once against the smallest max_model_len of its
        model's workers as last listed (the served model when it names none); raises
        InvalidArgument when the prompt or an explicit max_tokens does not fit."""
        timeout_s = deadline.control_timeout_s(deadline_s, self._control_timeout_s)
        max_model_len = await self.model_cards.max_model_len(req.model or state.model, timeout_s)
        return req.max_tokens.resolve(len(req.prompt_token_ids), max_model_len)

    def _record_success(self, attempt: Attempt) -> None:
        placement = attempt.placement
        if placement is not None:
            self._breakers.record_success(placement.decode.worker_id)
            if placement.prefill is not None:
                self._breakers.record_success(placement.prefill.worker_id)

    async def _pause(self, retry: int, deadline_s: float | None) -> None:
        """Jittered exponential backoff before retry/migration number `retry`, within the deadline."""
        pause_s = backoff_s(retry)
        remaining = deadline.remaining_s(deadline_s)
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
        attempt: Attempt,
        budget: int,
        hashes: tuple[int, ...],
        exclude: tuple[str, ...],
        deadline_s: float | None,
    ) -> AsyncGenerator[OutputFrame, None]:
        generated = state.resume_token_ids if state.migrations else ()
        prompt = req.prompt_token_ids + generated
        if generated:  # a migrated run: the prompt holds the tokens generated so far
            if len(generated) >= state.max_tokens:  # the worker died before its FINAL frame
                state.finish()
                yield frame(state, OutputFrameKind.FINAL, "", ())
                return
            root = chain_root(req.sampling.cache_salt, req.sampling.lora_adapter)
            hashes = tuple(block_hashes(prompt, self._block_size, root))
        query = ScheduleQuery(
            request_id=attempt.request_id,
            model=req.model,
            prompt_tokens=len(prompt),
            prefix_block_hashes=hashes,
            max_tokens=(state.max_tokens if generated else budget) - len(generated),
            exclude_worker_ids=exclude,
        )
        with tracer().start_as_current_span("schedule") as span:
            span.set_attribute("pdserve.prompt_tokens", query.prompt_tokens)
            timeout_s = deadline.control_timeout_s(deadline_s, self._control_timeout_s)
            placement = await deadline.within(self._scheduler.schedule(query, timeout_s), deadline_s)
            span.set_attribute("pdserve.mode", placement.mode.value)
        attempt.placement = placement
        check_capabilities(req.sampling, placement)
        # Each try before handoff refits the budget to its placement's workers (the only re-check:
        # they may accept less than the figure it was resolved against); a migration keeps it.
        max_tokens = (
            state.max_tokens
            if state.migrations
            else req.max_tokens.refit(budget, len(req.prompt_token_ids), placement.max_model_len)
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
            priority=req.priority,
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
                frames = self._runs.prefill_only(state, attempt, placement.prefill, job, deadline_s)
            else:
                frames = self._runs.disaggregated(
                    state, attempt, placement.prefill, placement.decode, job, deadline_s
                )
        else:
            frames = self._runs.aggregated(state, attempt, placement.decode, job, deadline_s)
        async with contextlib.aclosing(frames):
            async for out in frames:
                yield out

    # --- undo ---
    async def _undo(self, attempt: Attempt, wait: bool = True) -> None:
        """Cancel the decode stream and abort the request on every worker this attempt reached
        (`wait`: until those Abort calls ended; else they go on in the background)."""
        if attempt.stream is not None:
            attempt.stream.cancel()
        await self._aborter.abort_all(attempt.started, attempt.request_id, wait)

    async def wait_for_aborts(self, timeout_s: float) -> None:
        """Let pending Abort calls finish (graceful shutdown)."""
        await self._aborter.wait(timeout_s)
