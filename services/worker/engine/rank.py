"""One DP rank: it admits and owns its requests (their table, transfer tickets, output handles),
runs its scheduler, model runner and speculative proposer in the background step loop.

Threading: every Request/scheduler/block-manager field is guarded by `self.lock`, taken only by
this module. The step thread holds it while scheduling and post-processing, and releases it for
the forward pass (torch releases the GIL), so API calls from the event loop wait at most for one
post-processing phase. Aborts of scheduled requests are deferred to the step thread (their blocks
may be in use by the forward pass in flight). With a draft model (spec/draft.py) a step has a
second unlocked phase, the draft's forward passes for the next proposals; a PREFILL_ONLY request's
terminal output waits for them (its handoff proposals), and an abort meanwhile is deferred too.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from services.worker.engine.api import (
    Admission,
    FinishReason,
    KvBlocksChunk,
    RankLoad,
    RequestKind,
    RequestOutput,
)
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.handle import OutputHandle, deliver_batch
from services.worker.engine.model_runner import ModelRunner, ScheduledSeq
from services.worker.engine.request import Request, RequestStatus, finish_rule
from services.worker.engine.scheduler import ScheduledRequest, Scheduler
from services.worker.engine.spec import policy
from services.worker.engine.spec.calibrate import step_clock
from services.worker.engine.spec.draft import DraftJob, DraftProposer, fit_to_room
from services.worker.engine.spec.ngram import NgramProposer
from services.worker.engine.spec.stats import SpecStats
from services.worker.engine.spec.verify import accept_run
from shared.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted

log = logging.getLogger(__name__)

Outputs = list[tuple[OutputHandle, RequestOutput]]


@dataclass(frozen=True)
class Speculation:
    """A rank's speculative decoding: the proposer and the proposals per step (k)."""

    proposer: NgramProposer | DraftProposer
    num_tokens: int  # k


class Rank:
    def __init__(
        self,
        dp_rank: int,
        runner: ModelRunner,
        block_manager: BlockManager,
        scheduler: Scheduler,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        vocab_size: int = 0,
        speculation: Speculation | None = None,
    ) -> None:
        self.dp_rank = dp_rank
        self.runner = runner
        self.blocks = block_manager
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.speculation = speculation
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self._requests: dict[str, Request] = {}  # every request not yet fully gone
        self._tickets: dict[str, Request] = {}  # DECODE_REMOTE requests waiting for KV
        self._handles: dict[str, OutputHandle] = {}  # requests whose terminal output is unsent
        self._aborts: list[Request] = []
        # requests waiting for the draft model's proposals this step, with how many they want
        self._draft_wants: list[tuple[Request, int]] = []
        self._next_seq = 0
        self._spec_stats = SpecStats()
        # what a step's cost is measured with (spec/calibrate.py): on a CPU the step thread's
        # CPU time, i.e. what its tokens cost without the time other processes took the cores
        # (wall-clock on a shared machine is mostly their noise)
        self._cost_clock = step_clock(runner.device)
        self._stopping = False
        self._thread: threading.Thread | None = None

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

    # ---- admission -----------------------------------------------------------------------
    def _check_fits(self, req: Request) -> None:
        n = req.num_prompt_tokens
        if self.blocks.blocks_needed(n + 1) > self.blocks.num_blocks:
            raise ResourceExhausted(
                f"prompt of {n} tokens exceeds the KV pool of rank {self.dp_rank} "
                f"({self.blocks.num_blocks * self.blocks.block_size} tokens)"
            )

    def _register(self, req: Request, handle: OutputHandle) -> None:
        if req.request_id in self._requests:
            raise AlreadyExists(f"request {req.request_id!r} already exists")
        self._next_seq += 1
        req.arrival_seq = self._next_seq
        self._requests[req.request_id] = req
        self._handles[req.request_id] = handle

    def has_request(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self._requests

    def add(self, req: Request, handle: OutputHandle) -> None:
        """Admit a FULL or PREFILL_ONLY request: it queues for prefill."""
        self._check_fits(req)
        with self.lock:
            self._register(req, handle)
            self.scheduler.add(req)
            self._wake.notify_all()

    def admit_remote(self, req: Request, handle: OutputHandle) -> Admission:
        """Admit a DECODE_REMOTE request: reserve its blocks, look up the prefix cache, issue
        its transfer ticket."""
        self._check_fits(req)
        with self.lock:
            if req.request_id in self._requests:
                raise AlreadyExists(f"request {req.request_id!r} already exists")
            num_cached_blocks = self.scheduler.reserve_remote(req)
            ticket = f"{self.dp_rank}-{uuid.uuid4().hex}"
            req.transfer_ticket = ticket
            self._register(req, handle)
            self._tickets[ticket] = req
            return Admission(
                request_id=req.request_id,
                transfer_ticket=ticket,
                num_cached_blocks=num_cached_blocks,
                num_local_cached_tokens=req.num_local_cached_tokens,
                num_trim_blocks=req.num_trimmed_blocks,
            )

    # ---- the step loop -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                if not self._step():
                    return
            except Exception:  # a bug must not leave callers waiting forever
                log.exception("step loop failed on rank %d; aborting its requests", self.dp_rank)
                with self.lock:
                    outputs: Outputs = []
                    for req in [*self.scheduler.running, *self.scheduler.waiting]:
                        self._finish(req, FinishReason.ABORT, outputs)
                    for req, _ in self._draft_wants:  # handoffs waiting for draft proposals
                        if req.kind is RequestKind.PREFILL_ONLY:
                            self._emit(req, self._output(req, finished=True), outputs)
                    self._draft_wants = []
                deliver_batch(outputs)

    def _step(self) -> bool:
        """One iteration: schedule, forward, post-process. False once stopped."""
        with self.lock:
            outputs: Outputs = []
            self._process_aborts(outputs)
            if self._stopping:
                deliver_batch(outputs)
                return False
            sched = self.scheduler.schedule()
            if self._draft is not None:
                self._draft.drop_unless_running()  # preempted requests recompute their draft KV
            for req in sched.unfittable:
                log.warning("request %s outgrew the KV pool; aborting it", req.request_id)
                self._finish(req, FinishReason.ABORT, outputs)
            scheduled = sched.scheduled
            seqs = [self._snapshot(s) for s in scheduled]
            if not scheduled:
                deliver_batch(outputs)
                # woken by add/finish_import/abort/release; the timeout covers waiting
                # requests blocked on blocks that free up without a notification
                self._wake.wait(timeout=0.05)
                return True
        deliver_batch(outputs)
        t0 = time.perf_counter_ns()
        cost_clock, cost_sync = self._cost_clock
        c0 = cost_clock()
        try:
            sampled = self.runner.execute(seqs)
        except Exception:
            log.exception("forward pass failed on rank %d; aborting its batch", self.dp_rank)
            with self.lock:
                outputs = []
                for s in scheduled:
                    self._finish(s.request, FinishReason.ABORT, outputs)
            deliver_batch(outputs)
            return True
        elapsed_ns = time.perf_counter_ns() - t0
        if self.scheduler.step_cost is not None:
            cost_sync()
        cost_ns = cost_clock() - c0
        with self.lock:
            outputs = []
            self._observe_step_cost(scheduled, cost_ns)
            self._postprocess(scheduled, sampled, elapsed_ns, outputs, seqs)
            jobs: list[DraftJob] = []
            if self._draft is not None and self._draft_wants:
                # the next step verifies one token per running request plus proposals, at most
                # max_spec_batch_tokens in all
                room = self.scheduler.max_spec_batch_tokens - len(self.scheduler.running)
                self._draft_wants = fit_to_room(self._draft_wants, room)
                jobs = self._draft.plan([w for w in self._draft_wants if w[1] > 0])
        deliver_batch(outputs)
        if self._draft_wants:
            self._draft_round(jobs)
        return True

    def _observe_step_cost(self, scheduled: list[ScheduledRequest], cost_ns: int) -> None:
        """Teach the step-cost model the time of a decode step (one new token per sequence,
        with or without proposals); prefill chunks, whose attention grows with their length,
        are left out."""
        cost = self.scheduler.step_cost
        if cost is None or any(s.num_new_tokens != 1 for s in scheduled):
            return
        num_tokens = sum(1 + s.num_draft_tokens for s in scheduled)
        cost.observe(num_tokens, len(scheduled), cost_ns / 1e6)

    @property
    def _draft(self) -> DraftProposer | None:
        spec = self.speculation
        return spec.proposer if spec is not None and isinstance(spec.proposer, DraftProposer) else None

    def _draft_round(self, jobs: list[DraftJob]) -> None:
        """The draft model's forward passes (unlocked), then the proposals handed out: decoding
        requests verify them next step, PREFILL_ONLY requests send them with their output."""
        draft = self._draft
        assert draft is not None
        try:
            draft.run(jobs)
        except Exception:  # proposals are an optimization: never fail a request over them
            log.exception("draft model failed on rank %d; proposing nothing this step", self.dp_rank)
            for job in jobs:
                job.proposals = []
        with self.lock:
            outputs: Outputs = []
            proposals = draft.apply(jobs)
            for req, _ in self._draft_wants:
                props = proposals.get(req, [])
                if req.kind is RequestKind.PREFILL_ONLY:
                    draft.drop(req)  # it decodes elsewhere
                    self._emit(req, self._output(req, finished=True, drafts=props), outputs)
                elif req.status is RequestStatus.RUNNING:
                    req.spec_token_ids = props
            self._draft_wants = []
        deliver_batch(outputs)

    def _snapshot(self, s: ScheduledRequest) -> ScheduledSeq:
        r = s.request
        start = r.num_computed_tokens
        drafts = r.spec_token_ids[: s.num_draft_tokens]
        num_logits = 1 + len(drafts) if s.samples else 0
        prompt_offset, prompt_targets = r.prompt_targets(start, s.num_new_tokens)
        return ScheduledSeq(
            token_ids=r.token_ids[start : start + s.num_new_tokens] + drafts,
            start_pos=start,
            block_ids=list(r.block_ids),
            sample=s.samples,
            sampling=r.sampling,
            generator=r.generator,
            num_logits=max(1, num_logits),
            draw_seeds=tuple(r.draw_seed(j) for j in range(num_logits)),
            history=r.token_history(self.eos_token_ids) if s.samples else None,
            allowed=r.grammar.masks(drafts) if r.grammar is not None and s.samples else None,
            prompt_targets=prompt_targets,
            prompt_offset=prompt_offset,
        )

    def _postprocess(
        self,
        scheduled: list[ScheduledRequest],
        sampled: list[list[int]],
        elapsed_ns: int,
        outputs: Outputs,
        seqs: list[ScheduledSeq],
    ) -> None:
        runs = iter(sampled)
        for s, seq in zip(scheduled, seqs, strict=True):
            req = s.request
            if req.num_computed_tokens < req.num_prompt_tokens:
                req.num_prefill_chunks += 1
                req.prefill_ns += elapsed_ns
            req.prompt_logprobs.extend(seq.prompt_logprobs)
            if not s.samples:
                self.scheduler.on_computed(req, s.num_new_tokens)
                continue
            targets = next(runs)
            if req.sampling.max_tokens <= 0:
                # prompt logprobs only (max_tokens 0): the prompt is computed, nothing is drawn
                targets = []
            proposals = req.spec_token_ids[: s.num_draft_tokens]
            run = accept_run(proposals, targets) if targets else []
            if proposals:
                accepted = len(run) - 1
                self._spec_stats.record(len(proposals), accepted)
                req.spec = policy.after_verify(req.spec, len(proposals), accepted)
            req.spec_token_ids = []
            if run:
                _, reason = req.append_output_tokens(
                    run, self.eos_token_ids, self.max_model_len, seq.logprobs
                )
            else:
                reason = finish_rule(req.num_counted_towards_max, req.sampling.max_tokens, None)
            # K/V is valid for the step's tokens and the accepted proposals (the last token of
            # the run is new); a run cut short by a stop has every appended token computed
            computed = min(req.num_computed_tokens + s.num_new_tokens + max(0, len(run) - 1), req.num_tokens)
            self.scheduler.on_computed(req, computed - req.num_computed_tokens)
            if proposals:
                self.scheduler.rollback(req)
            if req.kind is RequestKind.PREFILL_ONLY:
                self.scheduler.remove(req, keep_blocks=True)
                req.hold(reason)
                drafts = self._propose(req) if reason is None else []
                if drafts is None:
                    continue  # its output leaves with the draft model's proposals (_draft_round)
                self._emit(req, self._output(req, finished=True, drafts=drafts), outputs)
            elif reason is not None:
                self._finish(req, reason, outputs)
            else:
                req.spec_token_ids = self._propose(req) or []
                out = self._output(req, finished=False)
                if out.new_token_ids or out.text_delta or out.prompt_logprobs:
                    self._emit(req, out, outputs)

    def _propose(self, req: Request) -> list[int] | None:
        """Proposals for the tokens after req.token_ids (none without speculation or while the
        request backs off); None when the draft model proposes them after this phase."""
        spec = self.speculation
        if spec is None:
            return []
        n = policy.proposal_budget(
            req.spec,
            spec.num_tokens,
            tokens_left=req.sampling.max_tokens - req.num_counted_towards_max,
            context_left=self.max_model_len - req.num_tokens,
        )
        if n == 0:
            req.spec = policy.after_skipped_step(req.spec)
            return []
        if isinstance(spec.proposer, DraftProposer):
            self._draft_wants.append((req, n))
            return None
        return spec.proposer.propose(req.token_ids, n, owner=req)

    def _output(self, req: Request, finished: bool, drafts: list[int] | None = None) -> RequestOutput:
        first = req.num_prompt_tokens + req.num_handoff_tokens + req.num_reported_tokens
        new_ids = tuple(req.token_ids[first:])
        new_logprobs = tuple(
            req.output_logprobs[req.num_reported_tokens : req.num_reported_tokens + len(new_ids)]
        )
        req.num_reported_tokens += len(new_ids)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            # a PREFILL_ONLY handoff (finished here, no reason) is not the end of the text: keep
            # back what may start a stop string; the decode worker replays the same state
            text_delta=req.text.take(final=finished and req.finish_reason is not None),
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            num_generated_tokens=req.num_generated_tokens,
            num_prompt_tokens=req.num_prompt_tokens,
            num_local_cached_tokens=req.num_local_cached_tokens,
            num_transferred_tokens=req.num_transferred_tokens,
            num_prefill_chunks=req.num_prefill_chunks,
            prefill_ns=req.prefill_ns,
            draft_token_ids=tuple(drafts or ()),
            new_logprobs=new_logprobs,
            prompt_logprobs=req.take_prompt_logprobs(),
        )

    def _emit(self, req: Request, out: RequestOutput, outputs: Outputs) -> None:
        """Queue an output for the request's handle; the terminal one closes it."""
        handle = (
            self._handles.pop(req.request_id, None) if out.finished else self._handles.get(req.request_id)
        )
        if handle is not None:
            outputs.append((handle, out))

    def _finish(self, req: Request, reason: FinishReason, outputs: Outputs) -> None:
        """End a request that is not HELD: free its blocks (after a direct import that still
        writes them), send its terminal output."""
        self.scheduler.remove(req, keep_blocks=req.kv_import_in_flight)
        if self._draft is not None:
            self._draft.drop(req)
        req.finish(reason)
        self._requests.pop(req.request_id, None)
        if req.transfer_ticket is not None:
            self._tickets.pop(req.transfer_ticket, None)
        if req.request_id in self._handles:
            self._emit(req, self._output(req, finished=True), outputs)

    # ---- aborts and release --------------------------------------------------------------
    def _abort_locked(self, req: Request) -> None:
        # a HELD request whose output still waits for draft proposals is released after it
        if req.status is RequestStatus.HELD and req.request_id not in self._handles:
            self._release_locked(req)
        elif req.status is RequestStatus.WAITING_FOR_KV:
            outputs: Outputs = []
            self._finish(req, FinishReason.ABORT, outputs)
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
                self._finish(req, FinishReason.ABORT, outputs)
        self._aborts.clear()

    def abort(self, request_id: str) -> bool:
        with self.lock:
            req = self._requests.get(request_id)
            if req is None:
                return False
            self._abort_locked(req)
            return True

    def _release_locked(self, req: Request) -> None:
        self.scheduler.remove(req)  # frees the blocks; they stay in the prefix cache
        if self._draft is not None:
            self._draft.drop(req)
        req.release()
        self._requests.pop(req.request_id, None)
        self._wake.notify_all()

    def release(self, request_id: str) -> None:
        with self.lock:
            req = self._requests.get(request_id)
            if req is None:
                raise NotFound(f"unknown request {request_id!r}")
            if req.status is not RequestStatus.HELD:
                raise InvalidArgument(f"request {request_id!r} holds no exportable KV")
            self._release_locked(req)

    # ---- KV export (PREFILL_ONLY) --------------------------------------------------------
    def export_blocks(self, request_id: str, skip_blocks: int) -> list[int]:
        with self.lock:
            req = self._held(request_id)
            num_blocks = self.blocks.blocks_needed(req.num_prompt_tokens)
            if skip_blocks < 0 or skip_blocks > num_blocks:
                raise InvalidArgument(f"skip_blocks {skip_blocks} out of range 0..{num_blocks}")
            return list(range(skip_blocks, num_blocks))

    def export_block_ids(self, request_id: str, skip_blocks: int) -> list[int]:
        """Pool block ids of the held request's prompt blocks from skip_blocks on."""
        indices = self.export_blocks(request_id, skip_blocks)
        with self.lock:
            req = self._held(request_id)
            return [req.block_ids[i] for i in indices]

    def export_parts(
        self, request_id: str, skip_blocks: int, trim_blocks: int
    ) -> list[tuple[list[int], tuple[int, ...]]]:
        """The prompt blocks from skip_blocks on as (block indices, layers; () = every layer):
        of the first trim_blocks (the decode side's kv_trim) only the full-attention layers, none
        when every layer is windowed. A model without windows sends everything."""
        indices = self.export_blocks(request_id, skip_blocks)
        trim = self.scheduler.kv_trim
        if trim.window is None or trim_blocks <= 0:
            return [(indices, ())]
        trimmed = [i for i in indices if i < trim_blocks]
        parts = [(trimmed, trim.full_layers)] if trimmed and trim.full_layers else []
        return [*parts, ([i for i in indices if i >= trim_blocks], ())]

    def _held(self, request_id: str) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise NotFound(f"unknown request {request_id!r}")
        if req.status is not RequestStatus.HELD:
            raise InvalidArgument(f"request {request_id!r} has no finished prefill to export")
        return req

    def iter_export(
        self, request_id: str, indices: list[int], blocks_per_chunk: int, layers: tuple[int, ...] = ()
    ) -> Iterator[KvBlocksChunk]:
        for start in range(0, len(indices), blocks_per_chunk):
            part = indices[start : start + blocks_per_chunk]
            with self.lock:
                req = self._held(request_id)
                data = self.runner.read_blocks([req.block_ids[i] for i in part], layers or None)
            yield KvBlocksChunk(first_block=part[0], num_blocks=len(part), data=data, layers=layers)

    # ---- KV import (DECODE_REMOTE) -------------------------------------------------------
    def _ticket(self, ticket: str) -> Request:
        req = self._tickets.get(ticket)
        if req is None or req.status is not RequestStatus.WAITING_FOR_KV:
            raise NotFound(f"unknown transfer ticket {ticket!r}")
        return req

    def import_kv(self, ticket: str, chunk: KvBlocksChunk) -> None:
        with self.lock:
            req = self._ticket(ticket)
            num_prompt_blocks = self.blocks.blocks_needed(req.num_prompt_tokens)
            end = chunk.first_block + chunk.num_blocks
            if chunk.first_block < 0 or chunk.num_blocks < 0 or end > num_prompt_blocks:
                raise InvalidArgument(
                    f"blocks [{chunk.first_block}, {end}) outside the prompt's {num_prompt_blocks} blocks"
                )
            self._check_layers(req, chunk.layers, end)
            num_layers = self.runner.layout.num_layers
            bpb = self.runner.bytes_per_block // num_layers * len(chunk.layers or range(num_layers))
            if len(chunk.data) != chunk.num_blocks * bpb:
                raise InvalidArgument(f"chunk has {len(chunk.data)} bytes, expected {chunk.num_blocks * bpb}")
            # leading blocks that came from our own prefix cache are shared: never overwrite;
            # blocks released at admission (behind every window) are not ours: their data is
            # dropped (an older prefill worker sends them)
            start = max(chunk.first_block, req.num_hashed_blocks, req.num_released_blocks)
            if start >= end:
                return
            skip = start - chunk.first_block
            self.runner.write_blocks(req.block_ids[start:end], chunk.data[skip * bpb :], chunk.layers or None)

    def _check_layers(self, req: Request, layers: tuple[int, ...], end: int) -> None:
        """A layer subset is only for trimmed blocks, and holds every full-attention layer."""
        if not layers:
            return
        full = self.scheduler.kv_trim.full_layers
        if list(layers) != sorted(set(layers)) or layers[-1] >= self.runner.layout.num_layers:
            raise InvalidArgument(f"chunk layers {list(layers)} are not ascending layer indices")
        if end > req.num_trimmed_blocks or not set(full) <= set(layers):
            raise InvalidArgument(
                f"chunk carries layers {list(layers)} of blocks up to {end}: only the first "
                f"{req.num_trimmed_blocks} blocks may leave out layers, never layers {list(full)}"
            )

    def import_kv_direct(
        self,
        ticket: str,
        first_block: int,
        num_blocks: int,
        read: Callable[[int, int, list[int], int, tuple[int, ...]], int],
    ) -> int:
        """The reserved blocks [first_block, first_block + num_blocks) filled by `read` (a NIXL
        READ: read(source_offset, dp_rank, block_ids, num_trimmed, layers), the first
        num_trimmed of block_ids only in `layers`), outside the lock so the step loop and aborts
        never wait for a transfer; an abort meanwhile ends the request at once but its blocks are
        freed only after `read` returns, so a freed (and reused) block is never written."""
        with self.lock:
            req = self._ticket(ticket)
            num_prompt_blocks = self.blocks.blocks_needed(req.num_prompt_tokens)
            end = first_block + num_blocks
            if first_block < 0 or num_blocks < 0 or end > num_prompt_blocks:
                raise InvalidArgument(
                    f"blocks [{first_block}, {end}) outside the prompt's {num_prompt_blocks} blocks"
                )
            if req.kv_import_in_flight:
                raise InvalidArgument(f"a KV import of request {req.request_id!r} is already under way")
            # leading blocks that came from our own prefix cache are shared: never overwrite;
            # released ones (behind every window) are not read at all; trimmed ones only in
            # their full-attention layers
            start = min(max(first_block, req.num_hashed_blocks, req.num_released_blocks), end)
            targets = req.block_ids[start:end]
            num_trimmed = max(0, min(req.num_trimmed_blocks, end) - start)
            layers = self.scheduler.kv_trim.full_layers if num_trimmed else ()
            req.kv_import_in_flight = True
        try:
            return read(start - first_block, self.dp_rank, targets, num_trimmed, layers)
        finally:
            with self.lock:
                req.kv_import_in_flight = False
                if req.status.is_finished:  # aborted meanwhile: its blocks were kept for us
                    self.scheduler.remove(req)

    def finish_import(
        self,
        ticket: str,
        num_tokens: int,
        first_token_id: int | None,
        prefill_generated_tokens: int,
        draft_token_ids: tuple[int, ...] = (),
        recompute: bool = False,
    ) -> None:
        with self.lock:
            req = self._ticket(ticket)
            if num_tokens != req.num_prompt_tokens:
                raise InvalidArgument(
                    f"KV covers {num_tokens} tokens, the prompt has {req.num_prompt_tokens}"
                )
            self._tickets.pop(ticket, None)
            req.transfer_ticket = None
            req.num_prior_generated_tokens = max(0, prefill_generated_tokens)
            req.num_transferred_tokens = req.num_prompt_tokens - req.num_local_cached_tokens
            outputs: Outputs = []
            ended = first_token_id is None or (
                first_token_id in self.eos_token_ids and not req.sampling.ignore_eos
            )
            reason = finish_rule(
                req.num_prior_generated_tokens, req.sampling.max_tokens, FinishReason.STOP if ended else None
            )
            if reason is None and first_token_id is not None:
                reason = req.start_from_handoff(first_token_id)
            if reason is not None:
                self._finish(req, reason, outputs)
            elif recompute:  # the KV never arrived: prompt + first token are computed here
                req.num_transferred_tokens = 0
                self.scheduler.recompute_remote(req)
                self._wake.notify_all()
            else:
                req.spec_token_ids = self._handoff_drafts(req, draft_token_ids)
                self.scheduler.start_remote(req)
                self._wake.notify_all()
            deliver_batch(outputs)

    def _handoff_drafts(self, req: Request, draft_token_ids: tuple[int, ...]) -> list[int]:
        """The prefill worker's proposals, when this rank speculates: capped like its own, and
        only token ids of this vocabulary (anything else is dropped, never an error)."""
        if self.speculation is None or not draft_token_ids:
            return []
        n = policy.proposal_budget(
            req.spec,
            self.speculation.num_tokens,
            tokens_left=req.sampling.max_tokens - req.num_counted_towards_max,
            context_left=self.max_model_len - req.num_tokens,
        )
        drafts = list(draft_token_ids[:n])
        if any(not 0 <= t < self.vocab_size for t in drafts):
            return []
        return drafts

    # ---- loads and stats -----------------------------------------------------------------
    def num_waiting_prompt_tokens(self) -> int:
        with self.lock:
            return self.scheduler.num_waiting_prompt_tokens

    def num_free_blocks(self) -> int:
        with self.lock:
            return self.blocks.num_free_blocks

    def num_preemptions(self) -> int:
        with self.lock:
            return self.scheduler.num_preemptions

    def draft_blocks(self) -> tuple[int, int]:
        """(free, total) blocks of the draft model's KV pool; (0, 0) without a draft model."""
        with self.lock:
            draft = self._draft
            return (draft.blocks.num_free_blocks, draft.blocks.num_blocks) if draft is not None else (0, 0)

    def spec_stats(self) -> SpecStats:
        with self.lock:
            stats = self._spec_stats.copy()
            cost = self.scheduler.step_cost
            if cost is not None:
                c = cost.cost
                stats.step_cost_ms = c.terms()
            return stats

    def load(self) -> RankLoad:
        with self.lock:
            return RankLoad(
                dp_rank=self.dp_rank,
                num_used_tokens=self.blocks.num_used_blocks * self.blocks.block_size,
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting) + len(self._tickets),
                kv_capacity_tokens=self.blocks.num_blocks * self.blocks.block_size,
                prefix_cache_queries_tokens=self.blocks.prefix_queries_tokens,
                prefix_cache_hits_tokens=self.blocks.prefix_hits_tokens,
                spec_draft_tokens=self._spec_stats.num_draft_tokens,
                spec_accepted_tokens=self._spec_stats.num_accepted_tokens,
            )
