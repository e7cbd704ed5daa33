"""One rank's side of the prefill -> decode handoff: transfer tickets of DECODE_REMOTE requests
waiting for their KV, KV import (gRPC chunks, or a direct NIXL READ into the reserved blocks),
the end of an import (decoding starts from the prefill worker's first token and proposals), and
the KV export of a finished PREFILL_ONLY request's held prompt blocks.

Every method takes the rank's lock (rank.py) for the request state it touches; a direct import
runs its READ outside it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from services.worker.engine.api import Admission, FinishReason, KvBlocksChunk, KvReadUnsettled, RequestKind
from services.worker.engine.handle import OutputHandle, deliver_batch
from services.worker.engine.outputs import Outputs
from services.worker.engine.request import Request, RequestStatus, finish_rule
from shared.errors import AlreadyExists, InvalidArgument, NotFound

if TYPE_CHECKING:
    from services.worker.engine.rank import Rank


class Handoff:
    """A rank's transfer tickets and KV import/export."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self.tickets: dict[str, Request] = {}  # DECODE_REMOTE requests waiting for KV
        # blocks a failed direct import's transfer may still write (held until it settles)
        self.num_quarantined_blocks = 0

    # ---- admission (DECODE_REMOTE) -------------------------------------------------------
    def admit_remote(self, req: Request, handle: OutputHandle, ticket: str | None = None) -> Admission:
        """Reserve the request's blocks, look up the prefix cache, register its transfer ticket
        (`ticket`, the gateway's choice, checked unused; None: a new one)."""
        rank = self.rank
        rank.check_fits(req)
        with rank.lock:
            if rank.has_request_locked(req.request_id):
                raise AlreadyExists(f"request {req.request_id!r} already exists")
            if ticket is not None and ticket in self.tickets:
                raise AlreadyExists(f"transfer ticket {ticket!r} is already in use")
            num_cached_blocks = rank.scheduler.reserve_remote(req)
            ticket = ticket or f"{rank.dp_rank}-{uuid.uuid4().hex}"
            req.transfer_ticket = ticket
            rank.register(req, handle)
            self.tickets[ticket] = req
            return Admission(
                request_id=req.request_id,
                transfer_ticket=ticket,
                num_cached_blocks=num_cached_blocks,
                num_local_cached_tokens=req.num_local_cached_tokens,
                num_trim_blocks=req.num_trimmed_blocks,
            )

    def forget(self, req: Request) -> None:
        """The request ended: its ticket is void (under the rank's lock)."""
        if req.transfer_ticket is not None:
            self.tickets.pop(req.transfer_ticket, None)

    def waiting(self, ticket: str) -> Request | None:
        """The request waiting for its KV under this ticket (None: none; under the rank's lock)."""
        req = self.tickets.get(ticket)
        if req is None or req.status is not RequestStatus.WAITING_FOR_KV:
            return None
        return req

    def _ticket(self, ticket: str) -> Request:
        req = self.waiting(ticket)
        if req is None:
            raise NotFound(f"unknown transfer ticket {ticket!r}")
        return req

    # ---- KV import -----------------------------------------------------------------------
    def import_kv(self, ticket: str, chunk: KvBlocksChunk) -> None:
        rank = self.rank
        with rank.lock:
            req = self._ticket(ticket)
            num_prompt_blocks = rank.blocks.blocks_needed(req.num_prompt_tokens)
            end = chunk.first_block + chunk.num_blocks
            if chunk.first_block < 0 or chunk.num_blocks < 0 or end > num_prompt_blocks:
                raise InvalidArgument(
                    f"blocks [{chunk.first_block}, {end}) outside the prompt's {num_prompt_blocks} blocks"
                )
            self._check_layers(req, chunk.layers, end)
            num_layers = rank.runner.layout.num_layers
            bpb = rank.runner.bytes_per_block // num_layers * len(chunk.layers or range(num_layers))
            if len(chunk.data) != chunk.num_blocks * bpb:
                raise InvalidArgument(f"chunk has {len(chunk.data)} bytes, expected {chunk.num_blocks * bpb}")
            # leading blocks that came from our own prefix cache are shared: never overwrite;
            # blocks released at admission (behind every window) are not ours: their data is
            # dropped (an older prefill worker sends them)
            start = max(chunk.first_block, req.num_hashed_blocks, req.num_released_blocks)
            if start >= end:
                return
            skip = start - chunk.first_block
            rank.runner.write_blocks(req.block_ids[start:end], chunk.data[skip * bpb :], chunk.layers or None)

    def _check_layers(self, req: Request, layers: tuple[int, ...], end: int) -> None:
        """A layer subset is only for trimmed blocks, and holds every full-attention layer."""
        if not layers:
            return
        full = self.rank.scheduler.kv_trim.full_layers
        if list(layers) != sorted(set(layers)) or layers[-1] >= self.rank.runner.layout.num_layers:
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
        freed only after `read` returns, so a freed (and reused) block is never written. A read
        that gives up on a transfer it could not cancel (KvReadUnsettled) leaves its targets
        quarantined until that transfer settles."""
        rank = self.rank
        with rank.lock:
            req = self._ticket(ticket)
            num_prompt_blocks = rank.blocks.blocks_needed(req.num_prompt_tokens)
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
            layers = rank.scheduler.kv_trim.full_layers if num_trimmed else ()
            req.kv_import_in_flight = True
        try:
            return read(start - first_block, rank.dp_rank, targets, num_trimmed, layers)
        except KvReadUnsettled as exc:
            self._quarantine(req, targets, exc)
            raise
        finally:
            with rank.lock:
                req.kv_import_in_flight = False
                if req.status.is_finished:  # aborted meanwhile: its blocks were kept for us
                    rank.scheduler.remove(req)

    def _quarantine(self, req: Request, targets: list[int], unsettled: KvReadUnsettled) -> None:
        """The READ may still write `targets`: one extra reference keeps them out of the free
        pool, whatever becomes of the request, until the transfer settles."""
        rank = self.rank
        with rank.lock:
            rank.blocks.take(targets)
            self.num_quarantined_blocks += len(targets)
            req.kv_import_unsettled = True

        def settled() -> None:
            with rank.lock:
                rank.blocks.free(targets)
                self.num_quarantined_blocks -= len(targets)
                rank.wake()

        unsettled.on_settled(settled)

    def finish_import(
        self,
        ticket: str,
        num_tokens: int,
        first_token_id: int | None,
        prefill_generated_tokens: int,
        draft_token_ids: tuple[int, ...] = (),
        recompute: bool = False,
    ) -> None:
        rank = self.rank
        with rank.lock:
            req = self._ticket(ticket)
            if num_tokens != req.num_prompt_tokens:
                raise InvalidArgument(
                    f"KV covers {num_tokens} tokens, the prompt has {req.num_prompt_tokens}"
                )
            self.tickets.pop(ticket, None)
            req.transfer_ticket = None
            req.num_prior_generated_tokens = max(0, prefill_generated_tokens)
            req.num_transferred_tokens = req.num_prompt_tokens - req.num_local_cached_tokens
            outputs: Outputs = []
            ended = first_token_id is None or (
                first_token_id in rank.eos_token_ids and not req.sampling.ignore_eos
            )
            reason = finish_rule(
                req.num_prior_generated_tokens, req.sampling.max_tokens, FinishReason.STOP if ended else None
            )
            if reason is None and first_token_id is not None:
                reason = req.start_from_handoff(first_token_id)
            if reason is not None:
                rank.finish(req, reason, outputs)
            elif recompute:  # the KV never arrived: prompt + first token are computed here
                req.num_transferred_tokens = 0
                rank.scheduler.recompute_remote(req)
                rank.wake()
            else:
                req.spec_token_ids = rank.speculation.handoff_drafts(req, draft_token_ids)
                rank.scheduler.start_remote(req)
                rank.wake()
            deliver_batch(outputs)

    # ---- KV export (PREFILL_ONLY) --------------------------------------------------------
    def _held(self, request_id: str) -> Request:
        req = self.rank.request(request_id)
        if req.status is not RequestStatus.HELD:
            raise InvalidArgument(f"request {request_id!r} has no finished prefill to export")
        return req

    def _ready(self, request_id: str, end_block: int | None) -> Request:
        """The held request (end_block None), or a PREFILL_ONLY one whose blocks before
        end_block are computed (a computed block never changes: the prefill writes later ones)."""
        if end_block is None:
            return self._held(request_id)
        req = self.rank.request(request_id)
        if req.status is RequestStatus.HELD:
            return req
        bs = self.rank.blocks.block_size
        if req.kind is not RequestKind.PREFILL_ONLY or req.status is not RequestStatus.RUNNING:
            raise InvalidArgument(f"request {request_id!r} is not a prefill under way")
        if end_block * bs > req.num_computed_tokens:
            raise InvalidArgument(
                f"blocks up to {end_block} of request {request_id!r} are not computed "
                f"({req.num_computed_tokens} tokens are)"
            )
        return req

    def export_blocks(self, request_id: str, skip_blocks: int, end_block: int | None = None) -> list[int]:
        """Indices of the held request's prompt blocks from skip_blocks on (before end_block,
        when set: the computed blocks of a prefill under way)."""
        with self.rank.lock:
            req = self._ready(request_id, end_block)
            num_blocks = self.rank.blocks.blocks_needed(req.num_prompt_tokens)
            end = num_blocks if end_block is None else min(end_block, num_blocks)
            if skip_blocks < 0 or skip_blocks > num_blocks:
                raise InvalidArgument(f"skip_blocks {skip_blocks} out of range 0..{num_blocks}")
            return list(range(skip_blocks, max(skip_blocks, end)))

    def export_block_ids(self, request_id: str, skip_blocks: int, end_block: int | None = None) -> list[int]:
        """Pool block ids of the held request's prompt blocks from skip_blocks on (before
        end_block, when set: the computed blocks of a prefill under way)."""
        indices = self.export_blocks(request_id, skip_blocks, end_block)
        with self.rank.lock:
            req = self._ready(request_id, end_block)
            return [req.block_ids[i] for i in indices]

    def export_parts(
        self, request_id: str, skip_blocks: int, trim_blocks: int, end_block: int | None = None
    ) -> list[tuple[list[int], tuple[int, ...]]]:
        """The prompt blocks from skip_blocks on (before end_block, when set) as (block indices,
        layers; () = every layer): of the first trim_blocks (the decode side's kv_trim) only the
        full-attention layers, none when every layer is windowed. A model without windows sends
        everything."""
        indices = self.export_blocks(request_id, skip_blocks, end_block)
        trim = self.rank.scheduler.kv_trim
        if trim.window is None or trim_blocks <= 0:
            return [(indices, ())]
        trimmed = [i for i in indices if i < trim_blocks]
        parts = [(trimmed, trim.full_layers)] if trimmed and trim.full_layers else []
        return [*parts, ([i for i in indices if i >= trim_blocks], ())]

    def iter_export(
        self,
        request_id: str,
        indices: list[int],
        blocks_per_chunk: int,
        layers: tuple[int, ...] = (),
        end_block: int | None = None,
    ) -> Iterator[KvBlocksChunk]:
        for start in range(0, len(indices), blocks_per_chunk):
            part = indices[start : start + blocks_per_chunk]
            with self.rank.lock:
                req = self._ready(request_id, end_block)
                data = self.rank.runner.read_blocks([req.block_ids[i] for i in part], layers or None)
            yield KvBlocksChunk(first_block=part[0], num_blocks=len(part), data=data, layers=layers)
