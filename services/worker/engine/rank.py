"""One DP rank: its scheduler, model runner and the background step loop.

Threading: every Request/scheduler/block-manager field is guarded by `self.lock`. The step
thread holds it while scheduling and post-processing, and releases it for the forward pass (torch
releases the GIL), so API calls from the event loop wait at most for one post-processing phase.
Aborts of scheduled requests are deferred to the step thread (their blocks may be in use by the
forward pass in flight).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from services.worker.engine.api import (
    FinishReason,
    KvBlocksChunk,
    RankLoad,
    RequestKind,
    RequestOutput,
)
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.handle import OutputHandle, deliver_batch
from services.worker.engine.model_runner import ModelRunner, ScheduledSeq
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.scheduler import ScheduledRequest, Scheduler
from shared.errors import InvalidArgument, NotFound

log = logging.getLogger(__name__)

Outputs = list[tuple[OutputHandle, RequestOutput]]


class Rank:
    def __init__(self, dp_rank: int, runner: ModelRunner, block_manager: BlockManager,
                 scheduler: Scheduler, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.dp_rank = dp_rank
        self.runner = runner
        self.blocks = block_manager
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self.requests: dict[str, Request] = {}  # every request not yet fully gone
        self.tickets: dict[str, Request] = {}  # DECODE_REMOTE requests waiting for KV
        self._aborts: list[Request] = []
        self._next_seq = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"pdserve-rank-{self.dp_rank}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self.lock:
            for req in list(self.requests.values()):
                self._abort_locked(req)
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def next_seq(self) -> int:
        self._next_seq += 1
        return self._next_seq

    def notify(self) -> None:
        self._wake.notify_all()

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
        with self.lock:
            outputs = []
            self._postprocess(scheduled, sampled, elapsed_ns, outputs)
        deliver_batch(outputs)
        return True

    def _snapshot(self, s: ScheduledRequest) -> ScheduledSeq:
        r = s.request
        start = r.num_computed_tokens
        return ScheduledSeq(
            token_ids=r.token_ids[start : start + s.num_new_tokens], start_pos=start,
            block_ids=list(r.block_ids), sample=s.samples, sampling=r.sampling,
            generator=r.generator_for_next_token() if s.samples else None,
        )

    def _postprocess(self, scheduled: list[ScheduledRequest], sampled: list[int],
                     elapsed_ns: int, outputs: Outputs) -> None:
        tokens = iter(sampled)
        for s in scheduled:
            req = s.request
            samples = s.samples
            if req.num_computed_tokens < req.num_prompt_tokens:
                req.num_prefill_chunks += 1
                req.prefill_ns += elapsed_ns
            self.scheduler.on_computed(req, s.num_new_tokens)
            if not samples:
                continue
            reason = self._on_token(req, next(tokens))
            if req.kind is RequestKind.PREFILL_ONLY:
                self.scheduler.remove(req, keep_blocks=True)
                req.status = RequestStatus.HELD
                req.finish_reason = reason
                outputs.append((req.handle, self._output(req, finished=True)))
            elif reason is not None:
                self._finish(req, reason, outputs)
            else:
                out = self._output(req, finished=False)
                if out.new_token_ids or out.text_delta:
                    outputs.append((req.handle, out))

    def _on_token(self, req: Request, token: int) -> FinishReason | None:
        """Apply the token-accounting and stop rules (api.py docstring) to a sampled token."""
        sp = req.sampling
        reason: FinishReason | None = None
        if token in self.eos_token_ids and not sp.ignore_eos:
            reason = FinishReason.STOP  # not appended, not counted, no text
        else:
            req.token_ids.append(token)
            delta = req.detokenizer.append(token)
            if token in sp.stop_token_ids:
                if sp.include_stop_in_output:
                    req.text.add(delta)
                reason = FinishReason.STOP
            elif req.text.add(delta):
                reason = FinishReason.STOP
            if reason is None and req.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH  # the model's context is full
        if req.num_counted_towards_max >= sp.max_tokens:
            reason = FinishReason.LENGTH
        return reason

    def _output(self, req: Request, finished: bool) -> RequestOutput:
        first = req.num_prompt_tokens + req.num_handoff_tokens + req.num_reported_tokens
        new_ids = tuple(req.token_ids[first:])
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
        )

    def _finish(self, req: Request, reason: FinishReason, outputs: Outputs) -> None:
        """End a request that is not HELD: free its blocks, send its terminal output."""
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
        if req.transfer_ticket is not None:
            self.tickets.pop(req.transfer_ticket, None)
        if not req.handle.closed:
            outputs.append((req.handle, self._output(req, finished=True)))
            req.handle.closed = True

    # ---- aborts and release --------------------------------------------------------------
    def _abort_locked(self, req: Request) -> None:
        if req.status is RequestStatus.HELD:
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
            elif req.status is not RequestStatus.FINISHED:
                self._finish(req, FinishReason.ABORT, outputs)
        self._aborts.clear()

    def abort(self, request_id: str) -> bool:
        with self.lock:
            req = self.requests.get(request_id)
            if req is None:
                return False
            self._abort_locked(req)
            return True

    def _release_locked(self, req: Request) -> None:
        self.scheduler.remove(req)  # frees the blocks; they stay in the prefix cache
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)
        self._wake.notify_all()

    def release(self, request_id: str) -> None:
        with self.lock:
            req = self.requests.get(request_id)
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

    def _held(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise NotFound(f"unknown request {request_id!r}")
        if req.status is not RequestStatus.HELD:
            raise InvalidArgument(f"request {request_id!r} has no finished prefill to export")
        return req

    def iter_export(self, request_id: str, indices: list[int],
                    blocks_per_chunk: int) -> Iterator[KvBlocksChunk]:
        for start in range(0, len(indices), blocks_per_chunk):
            part = indices[start : start + blocks_per_chunk]
            with self.lock:
                req = self._held(request_id)
                data = self.runner.read_blocks([req.block_ids[i] for i in part])
            yield KvBlocksChunk(first_block=part[0], num_blocks=len(part), data=data)

    # ---- KV import (DECODE_REMOTE) -------------------------------------------------------
    def _ticket(self, ticket: str) -> Request:
        req = self.tickets.get(ticket)
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
                    f"blocks [{chunk.first_block}, {end}) outside the prompt's "
                    f"{num_prompt_blocks} blocks")
            if len(chunk.data) != chunk.num_blocks * self.runner.bytes_per_block:
                raise InvalidArgument(
                    f"chunk has {len(chunk.data)} bytes, expected "
                    f"{chunk.num_blocks * self.runner.bytes_per_block}")
            # leading blocks that came from our own prefix cache are shared: never overwrite
            skip = max(0, req.num_hashed_blocks - chunk.first_block)
            if skip >= chunk.num_blocks:
                return
            bpb = self.runner.bytes_per_block
            targets = req.block_ids[chunk.first_block + skip : end]
            self.runner.write_blocks(targets, chunk.data[skip * bpb :])

    def finish_import(self, ticket: str, num_tokens: int, first_token_id: int | None,
                      prefill_generated_tokens: int) -> None:
        with self.lock:
            req = self._ticket(ticket)
            if num_tokens != req.num_prompt_tokens:
                raise InvalidArgument(
                    f"KV covers {num_tokens} tokens, the prompt has {req.num_prompt_tokens}")
            self.tickets.pop(ticket, None)
            req.transfer_ticket = None
            req.num_prior_generated_tokens = max(0, prefill_generated_tokens)
            req.num_transferred_tokens = req.num_prompt_tokens - req.num_local_cached_tokens
            outputs: Outputs = []
            sp = req.sampling
            if first_token_id is None or (first_token_id in self.eos_token_ids
                                          and not sp.ignore_eos):
                reason = (FinishReason.LENGTH if req.num_prior_generated_tokens >= sp.max_tokens
                          else FinishReason.STOP)
                self._finish(req, reason, outputs)
            elif req.num_prior_generated_tokens >= sp.max_tokens:
                self._finish(req, FinishReason.LENGTH, outputs)
            else:
                req.token_ids.append(first_token_id)
                req.num_handoff_tokens = 1
                # Replay the prefill side's text state: stop strings can span the handoff token,
                # and what the prefill worker already sent is marked as emitted, not sent again.
                if req.text.add(req.detokenizer.append(first_token_id)):
                    self._finish(req, FinishReason.STOP, outputs)  # an older prefill worker
                else:
                    req.text.take(final=False)
                    self.scheduler.start_remote(req)
                    self._wake.notify_all()
            deliver_batch(outputs)

    # ---- loads ---------------------------------------------------------------------------
    def num_waiting_prompt_tokens(self) -> int:
        with self.lock:
            return self.scheduler.num_waiting_prompt_tokens

    def load(self) -> RankLoad:
        with self.lock:
            return RankLoad(
                dp_rank=self.dp_rank,
                num_used_tokens=self.blocks.num_used_blocks * self.blocks.block_size,
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting)
                + sum(1 for r in self.tickets.values()),
                kv_capacity_tokens=self.blocks.num_blocks * self.blocks.block_size,
                prefix_cache_queries_tokens=self.blocks.prefix_queries_tokens,
                prefix_cache_hits_tokens=self.blocks.prefix_hits_tokens,
            )
