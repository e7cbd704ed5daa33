"""A rank's async scheduling (`async_scheduling`, issue 31 item 4; vLLM v1's async scheduling): while the
device runs decode step N, the step thread schedules and launches step N+1 before N's tokens are
on the host. It assumes every request of N produces one token: N+1's positions, slots and block
tables are built on the host, its input ids are N's drawn ids copied on the device
(ModelRunner.execute_async), and N's tokens are applied (appended, finish rule, outputs) once
N+1 is queued. A request that ended at N (EOS, a stop token or string) has one wasted row in
N+1, whose token is dropped; its blocks are freed only after N+1 completed (the loop then waits
for N+1 at once, so nothing in flight reads a freed block and its terminal output goes out after
the blocks are free). Outputs are the same as without it. The overlap is off for a step (the
loop waits for step N, applies it, then schedules as usual) when any of these holds: a request
is waiting to be admitted (prefill chunks, joining requests, imported KV), an abort or cancel is
pending or the rank stops, the running requests are not exactly N's, a request of N reaches its
max_tokens or the model's context with N's token, a request's next block cannot be had without
preemption, or a request wants something the host must know before the next draw or that a
decode step does not return: logprobs, prompt logprobs, penalties or min_tokens (the token
history), structured output (the grammar's mask), a PREFILL_ONLY handoff; and always with
speculative decoding (its proposals depend on the last tokens).

`AsyncSteps` runs on the rank's step thread; what it touches of the requests, the scheduler and
speculation it touches under the rank's lock, as the rank does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.worker.engine.api import FinishReason, RequestKind
from services.worker.engine.draws import PendingSample
from services.worker.engine.handle import deliver_batch
from services.worker.engine.model_runner import ScheduledSeq
from services.worker.engine.outputs import Outputs
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.scheduler import ScheduledRequest, StepPlan
from services.worker.engine.step import StepOutput

if TYPE_CHECKING:
    from services.worker.engine.rank import Rank

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A decode step queued on the device whose tokens are not applied yet (async scheduling)."""

    plan: StepPlan
    batch: list[ScheduledSeq]
    pending: PendingSample
    t0_ns: int  # perf_counter_ns at its launch
    # requests that ended while this step was in flight, their blocks freed once it is done
    ended: list[Request] = field(default_factory=list)


class AsyncSteps:
    """The decode step in flight and the one being applied (the step thread's own fields)."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self.in_flight: InFlight | None = None
        self.reading: InFlight | None = None  # while applying a step: the one still in flight

    def defers_free(self, req: Request) -> bool:
        """Under the lock, as `req` ends: whether the step in flight still reads its blocks; if
        so they are freed (scheduler.remove) once that step is done."""
        reading = self.reading
        if reading is None or req.kv_import_in_flight:
            return False
        if not any(s.request is req for s in reading.plan.scheduled):
            return False
        reading.ended.append(req)
        return True

    def launches(self, plan: StepPlan, batch: list[ScheduledSeq]) -> bool:
        """Whether a step runs on the async path: decode steps only, of requests that need
        nothing of the host between two draws (under the lock)."""
        return (
            bool(plan.scheduled)
            and not plan.unfittable
            and all(s.samples and s.num_new_tokens == 1 and not s.num_draft_tokens for s in plan.scheduled)
            and all(self.overlappable(s.request) for s in plan.scheduled)
            and all(not seq.prompt_targets and seq.history is None and seq.allowed is None for seq in batch)
        )

    @staticmethod
    def overlappable(req: Request) -> bool:
        sp = req.sampling
        return (
            req.status is RequestStatus.RUNNING
            and req.kind is not RequestKind.PREFILL_ONLY
            and sp.max_tokens > 0
            and sp.logprobs is None
            and not sp.needs_history
            and req.grammar is None
            and not req.wants_prompt_logprobs
        )

    def _next_plan(self, f: InFlight) -> tuple[StepPlan, list[ScheduledSeq]] | None:
        """Under the lock: step N+1 while step N (f) is in flight, assuming each of N's requests
        gets one token; None when the overlap is off for this step (module docstring)."""
        if self.rank.control_pending() or self.rank.scheduler.waiting:
            return None
        reqs = [s.request for s in f.plan.scheduled]
        if reqs != self.rank.scheduler.running:
            return None
        max_len = self.rank.scheduler.max_model_len
        for r in reqs:
            if not self.overlappable(r) or r.num_counted_towards_max + 1 >= r.sampling.max_tokens:
                return None
            if max_len and r.num_tokens + 1 >= max_len:
                return None
        for r in reqs:  # N+1 computes position num_tokens: room for num_tokens + 1 tokens
            if not self.rank.scheduler.grow(r, r.num_tokens + 1):
                return None
        batch = [
            ScheduledSeq(
                token_ids=[0],  # a placeholder: the input is N's drawn id, copied on the device
                start_pos=r.num_tokens,
                block_ids=list(r.block_ids),
                sample=True,
                sampling=r.sampling,
                generator=r.generator,
                draw_seeds=(r.draw_seed(1),),  # the draw after N's
            )
            for r in reqs
        ]
        budget = max(0, self.rank.scheduler.max_batch_tokens - len(reqs))
        return StepPlan([ScheduledRequest(r, 1) for r in reqs], [], budget), batch

    def launch(self, plan: StepPlan, batch: list[ScheduledSeq], prev: PendingSample | None) -> bool:
        """Queue a decode step (unlocked); False when it failed. With nothing in flight before
        it (prev None) its requests are aborted here; else the caller aborts them once the step
        before is applied."""
        t0 = time.perf_counter_ns()
        try:
            pending = self.rank.runner.execute_async(batch, None if prev is None else prev.ids)
        except Exception:
            log.exception("forward pass failed on rank %d; aborting its batch", self.rank.dp_rank)
            if prev is None:
                self._abort_plan(plan)
            return False
        self.in_flight = InFlight(plan, batch, pending, t0)
        return True

    def _abort_plan(self, plan: StepPlan) -> None:
        with self.rank.lock:
            outputs: Outputs = []
            for s in plan.scheduled:
                if not s.request.status.is_finished:
                    self.rank.finish(s.request, FinishReason.ABORT, outputs)
        deliver_batch(outputs)

    def step(self, f: InFlight) -> None:
        """Step N (f) is in flight: launch N+1 when the overlap holds, then apply N; otherwise
        wait for N and apply it (the next iteration schedules as usual)."""
        with self.rank.lock:
            nxt = self._next_plan(f)
        self.in_flight = None
        launched = False
        if nxt is not None:
            launched = self.launch(nxt[0], nxt[1], f.pending)
        outputs: Outputs = []
        tokens = f.pending.tokens()  # waits for step N (the step thread only)
        g = self.in_flight
        with self.rank.lock:
            self.reading = g
            try:
                self._apply_step(f, tokens, outputs)
            finally:
                self.reading = None
        if nxt is not None and not launched:
            deliver_batch(outputs)
            self._abort_plan(nxt[0])
            return
        if g is not None and g.ended:
            # requests ended at N and N+1 still reads their blocks: wait for it, apply it, then
            # free them (their terminal outputs go out after)
            self.in_flight = None
            tokens = g.pending.tokens()
            with self.rank.lock:
                self._apply_step(g, tokens, outputs)
                for req in g.ended:
                    self.rank.scheduler.remove(req)
        deliver_batch(outputs)

    def _apply_step(self, f: InFlight, tokens: list[list[int]], outputs: Outputs) -> None:
        """Under the lock: an async step's tokens, for its requests still running (one that
        ended at the step before had a wasted row)."""
        live = [
            (s, seq, run)
            for s, seq, run in zip(f.plan.scheduled, f.batch, tokens, strict=True)
            if not s.request.status.is_finished
        ]
        plan = StepPlan([s for s, _, _ in live], [], f.plan.budget_left)
        output = StepOutput([seq for _, seq, _ in live], [run for _, _, run in live])
        output.elapsed_ns = time.perf_counter_ns() - f.t0_ns
        self.rank.record_step(f.batch, f.t0_ns)
        self.rank.speculation.after_verify(plan, output)
        self.rank.apply(self.rank.scheduler.update(plan, output), outputs)

    def forget(self) -> None:
        """Under the lock, after a failure: nothing is in flight any more (what ended while it
        was frees its blocks now)."""
        for f in (self.in_flight, self.reading):
            if f is not None:
                for req in f.ended:
                    self.rank.scheduler.remove(req)
                f.ended.clear()
        self.in_flight = None
        self.reading = None
