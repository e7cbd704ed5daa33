"""One DP rank: it admits and owns its requests (their table and output handles) and runs the
background step loop over its scheduler, model runner and speculation: schedule -> execute ->
update (engine/step.py). The handoff side (transfer tickets, KV import/export) is handoff.py.

Threading: every Request/scheduler/block-manager field is guarded by `self.lock`, taken only by
this module and handoff.py. The step thread holds it while scheduling and updating, and releases
it for the forward pass (torch releases the GIL), so API calls from the event loop wait at most
for one update phase. Aborts of scheduled requests are deferred to the step thread (their blocks
may be in use by the forward pass in flight). With a draft model (spec/draft.py) a step has a
second unlocked phase, the draft's forward passes for the next proposals; a PREFILL_ONLY request's
terminal output waits for them (its handoff proposals), and an abort meanwhile is deferred too.
Async scheduling (decode step N+1 launched before step N's tokens are on the host) is
async_steps.py.
"""

from __future__ import annotations

import logging
import threading
import time

from services.worker.engine.api import FinishReason, RankLoad, RequestKind, RequestOutput
from services.worker.engine.async_steps import AsyncSteps
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.handle import OutputHandle, deliver_batch
from services.worker.engine.handoff import Handoff
from services.worker.engine.model_runner import ModelRunner, ScheduledSeq
from services.worker.engine.outputs import Outputs, request_output
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.scheduler import Scheduler, StepPlan
from services.worker.engine.spec.calibrate import step_clock
from services.worker.engine.spec.speculation import NoSpeculation
from services.worker.engine.spec.stats import SpecStats
from services.worker.engine.step import StepOutput, StepUpdate, plan_batch
from services.worker.engine.step_stats import StepStats, step_kind
from shared.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted

log = logging.getLogger(__name__)


class Rank:
    def __init__(
        self,
        dp_rank: int,
        runner: ModelRunner,
        block_manager: BlockManager,
        scheduler: Scheduler,
        eos_token_ids: tuple[int, ...],
        speculation: NoSpeculation | None = None,
        async_scheduling: bool = False,
    ) -> None:
        self.dp_rank = dp_rank
        self.runner = runner
        self.blocks = block_manager
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.speculation = speculation or NoSpeculation()
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self.handoff = Handoff(self)
        self._requests: dict[str, Request] = {}  # every request not yet fully gone
        self._handles: dict[str, OutputHandle] = {}  # requests whose terminal output is unsent
        self._aborts: list[Request] = []
        self._next_seq = 0
        # what a step's cost is measured with (spec/calibrate.py): on a CPU the step thread's
        # CPU time, i.e. what its tokens cost without the time other processes took the cores
        # (wall-clock on a shared machine is mostly their noise)
        self._cost_clock = step_clock(runner.device)
        self._stopping = False
        self._thread: threading.Thread | None = None
        # async scheduling (module docstring): never with speculative decoding
        self.async_scheduling = async_scheduling and type(self.speculation) is NoSpeculation
        self.pipeline = AsyncSteps(self)
        # steps by kind (under the lock), and when the last one ended (perf_counter_ns)
        self.step_stats = StepStats()
        self._last_step_end_ns = 0

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"pdserve-rank-{self.dp_rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self.lock:
            for req in list(self._requests.values()):
                self._abort_locked(req)
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def control_pending(self) -> bool:
        """Under the lock: an abort or the stop waits for the step thread."""
        return bool(self._aborts) or self._stopping

    def wake(self) -> None:
        """New work for the step loop (under the lock)."""
        self._wake.notify_all()

    # ---- the request table ---------------------------------------------------------------
    def check_fits(self, req: Request) -> None:
        n = req.num_prompt_tokens
        if self.blocks.blocks_needed(n + 1) > self.blocks.num_blocks:
            raise ResourceExhausted(
                f"prompt of {n} tokens exceeds the KV pool of rank {self.dp_rank} "
                f"({self.blocks.num_blocks * self.blocks.block_size} tokens)"
            )

    def register(self, req: Request, handle: OutputHandle) -> None:
        """Under the lock: the request and its handle join the table."""
        if req.request_id in self._requests:
            raise AlreadyExists(f"request {req.request_id!r} already exists")
        adapter = req.sampling.lora_adapter
        lora = self.runner.lora
        if adapter and (lora is None or not lora.serves(adapter)):
            # checked under the lock: an unload (Engine.unload_lora_adapter) either sees this
            # request and refuses, or took the adapter away before it got here
            raise NotFound(f"LoRA adapter {adapter!r} is not loaded on this worker")
        self._next_seq += 1
        req.arrival_seq = self._next_seq
        self._requests[req.request_id] = req
        self._handles[req.request_id] = handle

    def lora_requests(self) -> dict[str, int]:
        """Requests in the table by LoRA adapter (queued, running or held; the base model's
        left out)."""
        counts: dict[str, int] = {}
        with self.lock:
            for r in self._requests.values():
                name = r.sampling.lora_adapter
                if name and not r.status.is_finished:
                    counts[name] = counts.get(name, 0) + 1
        return counts

    def lora_requests_locked(self, adapter: str) -> int:
        """Under the lock: requests of `adapter` in the table (queued, running, held)."""
        return sum(1 for r in self._requests.values() if r.sampling.lora_adapter == adapter)

    def has_request_locked(self, request_id: str) -> bool:
        return request_id in self._requests

    def has_request(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self._requests

    def request(self, request_id: str) -> Request:
        """Under the lock: the request, or NotFound."""
        req = self._requests.get(request_id)
        if req is None:
            raise NotFound(f"unknown request {request_id!r}")
        return req

    def add(self, req: Request, handle: OutputHandle) -> None:
        """Admit a FULL or PREFILL_ONLY request: it queues for prefill."""
        self.check_fits(req)
        with self.lock:
            self.register(req, handle)
            self.scheduler.add(req)
            self._wake.notify_all()

    # ---- the step loop -------------------------------------------------------------------
    def _loop(self) -> None:
        self.runner.bind_thread()
        while True:
            try:
                if not self._step():
                    return
            except Exception:  # a bug must not leave callers waiting forever
                log.exception("step loop failed on rank %d; aborting its requests", self.dp_rank)
                with self.lock:
                    self.pipeline.forget()
                    outputs: Outputs = []
                    for req in [*self.scheduler.running, *self.scheduler.waiting]:
                        self.finish(req, FinishReason.ABORT, outputs)
                    for req in self.speculation.abandon_round():  # handoffs waiting for drafts
                        self._emit(req, request_output(req, finished=True), outputs)
                deliver_batch(outputs)

    def _step(self) -> bool:
        """One iteration: schedule, execute, update. False once stopped."""
        if self.pipeline.in_flight is not None:
            self.pipeline.step(self.pipeline.in_flight)
            return True
        with self.lock:
            outputs: Outputs = []
            self._process_aborts(outputs)
            if self._stopping:
                deliver_batch(outputs)
                return False
            plan = self.scheduler.schedule()
            self.speculation.propose(plan)
            for req in plan.unfittable:
                log.warning("request %s outgrew the KV pool; aborting it", req.request_id)
                self.finish(req, FinishReason.ABORT, outputs)
            batch = plan_batch(plan, self.eos_token_ids)
            if not plan.scheduled:
                deliver_batch(outputs)
                # woken by add/finish_import/abort/release; the timeout covers waiting
                # requests blocked on blocks that free up without a notification
                self._wake.wait(timeout=0.05)
                return True
        deliver_batch(outputs)
        if self.async_scheduling and self.pipeline.launches(plan, batch):
            self.pipeline.launch(plan, batch, None)
            return True
        output = self._execute(plan, batch)
        if output is None:
            return True
        with self.lock:
            outputs = []
            self.record_step(batch, time.perf_counter_ns() - output.elapsed_ns)
            self.speculation.after_verify(plan, output)
            self.apply(self.scheduler.update(plan, output), outputs)
            self._report_prefill_progress(plan, outputs)
        deliver_batch(outputs)
        if self.speculation.has_round():  # the draft model's proposals for the next step
            outputs = []
            self.speculation.draft_round(
                self.lock,
                lambda req, drafts: self._emit(
                    req, request_output(req, finished=True, drafts=drafts), outputs
                ),
            )
            deliver_batch(outputs)
        return True

    def _execute(self, plan: StepPlan, batch: list[ScheduledSeq]) -> StepOutput | None:
        """The forward pass (unlocked); None when it failed (its requests are aborted)."""
        t0 = time.perf_counter_ns()
        cost_clock, cost_sync = self._cost_clock
        c0 = cost_clock()
        try:
            sampled = self.runner.execute(batch)
        except Exception:
            log.exception("forward pass failed on rank %d; aborting its batch", self.dp_rank)
            with self.lock:
                outputs: Outputs = []
                for s in plan.scheduled:
                    self.finish(s.request, FinishReason.ABORT, outputs)
            deliver_batch(outputs)
            return None
        elapsed_ns = time.perf_counter_ns() - t0
        if self.speculation.step_cost is not None:
            cost_sync()
        return StepOutput(batch, sampled, elapsed_ns, cost_clock() - c0)

    def record_step(self, batch: list[ScheduledSeq], t0_ns: int) -> None:
        """Under the lock: a step launched at t0_ns whose outputs are on the host now; only its
        time past the previous step's end counts (an async step overlaps the one before)."""
        now = time.perf_counter_ns()
        start = max(t0_ns, self._last_step_end_ns)
        self._last_step_end_ns = now
        self.step_stats.record(step_kind(batch), now - start, sum(len(s.token_ids) for s in batch))

    def steps(self) -> StepStats:
        with self.lock:
            return self.step_stats.copy()

    def apply(self, updates: list[StepUpdate], outputs: Outputs) -> None:
        """After scheduler.update: end what ended, hand speculation the requests that go on,
        send each request's output (a handoff's waits for draft proposals when it has them)."""
        for u in updates:
            if u.reason is not None and u.request.kind is not RequestKind.PREFILL_ONLY:
                self.finish(u.request, u.reason, outputs)
        deferred = self.speculation.after_update(updates)
        for u in updates:
            req = u.request
            if req.kind is RequestKind.PREFILL_ONLY:
                if req not in deferred:
                    drafts = req.spec_token_ids if u.reason is None else []
                    self._emit(req, request_output(req, finished=True, drafts=drafts), outputs)
            elif u.reason is None:
                out = request_output(req, finished=False)
                if out.new_token_ids or out.text_delta or out.prompt_logprobs:
                    self._emit(req, out, outputs)

    def _report_prefill_progress(self, plan: StepPlan, outputs: Outputs) -> None:
        """A progress output for each PREFILL_ONLY request that ran a prompt chunk but not its
        last one this step (the early KV export's cue; asked for per request). The step's
        kernels are done first: the blocks an output names may be READ by a peer at once."""
        cued = [
            s.request
            for s in plan.scheduled
            if s.request.report_prefill_progress
            and not s.samples
            and s.request.status is RequestStatus.RUNNING
        ]
        if cued:
            self.runner.wait_for_device()
        for req in cued:
            self._emit(req, request_output(req, finished=False), outputs)

    def _emit(self, req: Request, out: RequestOutput, outputs: Outputs) -> None:
        """Queue an output for the request's handle; the terminal one closes it."""
        handle = (
            self._handles.pop(req.request_id, None) if out.finished else self._handles.get(req.request_id)
        )
        if handle is not None:
            outputs.append((handle, out))

    def finish(self, req: Request, reason: FinishReason, outputs: Outputs) -> None:
        """End a request that is not HELD: free its blocks (after a direct import that still
        writes them, or while an async step in flight still reads them), send its terminal
        output."""
        deferred = self.pipeline.defers_free(req)
        self.scheduler.remove(req, keep_blocks=req.kv_import_in_flight or deferred)
        self.speculation.drop(req)
        req.finish(reason)
        self._requests.pop(req.request_id, None)
        self.handoff.forget(req)
        if req.request_id in self._handles:
            self._emit(req, request_output(req, finished=True), outputs)

    # ---- aborts and release --------------------------------------------------------------
    def _abort_locked(self, req: Request) -> None:
        # a HELD request whose output still waits for draft proposals is released after it
        if req.status is RequestStatus.HELD and req.request_id not in self._handles:
            self._release_locked(req)
        elif req.status is RequestStatus.WAITING_FOR_KV:
            outputs: Outputs = []
            self.finish(req, FinishReason.ABORT, outputs)
            deliver_batch(outputs)
        elif not req.abort_requested:
            req.abort_requested = True
            self._aborts.append(req)
            self._wake.notify_all()

    def _process_aborts(self, outputs: Outputs) -> None:
        for req in self._aborts:
            if req.status is RequestStatus.HELD:
                self._release_locked(req)
            elif not req.status.is_finished:
                self.finish(req, FinishReason.ABORT, outputs)
        self._aborts.clear()

    def abort(self, request_id: str) -> bool:
        with self.lock:
            req = self._requests.get(request_id)
            if req is None:
                return False
            self._abort_locked(req)
            return True

    def waits_for_kv(self, ticket: str) -> bool:
        with self.lock:
            return self.handoff.waiting(ticket) is not None

    def abort_ticket(self, ticket: str) -> bool:
        with self.lock:
            req = self.handoff.waiting(ticket)
            if req is None:
                return False
            self._abort_locked(req)
            return True

    def _release_locked(self, req: Request) -> None:
        self.scheduler.remove(req)  # frees the blocks; they stay in the prefix cache
        self.speculation.drop(req)
        req.release()
        self._requests.pop(req.request_id, None)
        self._wake.notify_all()

    def release(self, request_id: str) -> None:
        with self.lock:
            req = self.request(request_id)
            if req.status is not RequestStatus.HELD:
                raise InvalidArgument(f"request {request_id!r} holds no exportable KV")
            self._release_locked(req)

    # ---- loads and stats -----------------------------------------------------------------
    def num_waiting_prompt_tokens(self) -> int:
        with self.lock:
            return self.scheduler.num_waiting_prompt_tokens

    def num_free_blocks(self) -> int:
        with self.lock:
            return self.blocks.num_free_blocks

    def kv_offload_stats(self) -> tuple[int, int, int, int] | None:
        tier = self.scheduler.host_cache
        if tier is None:
            return None
        with self.lock:
            return tier.saved_blocks, tier.restored_blocks, tier.num_used_blocks, tier.num_blocks

    def num_preemptions(self) -> int:
        with self.lock:
            return self.scheduler.num_preemptions

    def draft_blocks(self) -> tuple[int, int]:
        """(free, total) blocks of the draft model's KV pool; (0, 0) without a draft model."""
        with self.lock:
            return self.speculation.draft_blocks()

    def spec_stats(self) -> SpecStats:
        with self.lock:
            return self.speculation.stats()

    def load(self) -> RankLoad:
        with self.lock:
            stats = self.speculation.stats()
            return RankLoad(
                dp_rank=self.dp_rank,
                num_used_tokens=self.blocks.num_used_blocks * self.blocks.block_size,
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting) + len(self.handoff.tickets),
                kv_capacity_tokens=self.blocks.num_blocks * self.blocks.block_size,
                prefix_cache_queries_tokens=self.blocks.prefix_queries_tokens,
                prefix_cache_hits_tokens=self.blocks.prefix_hits_tokens,
                spec_draft_tokens=stats.num_draft_tokens,
                spec_accepted_tokens=stats.num_accepted_tokens,
            )
