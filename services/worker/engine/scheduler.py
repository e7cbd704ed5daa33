"""One rank's scheduler: waiting/running queues, the per-step token budget (chunked prefill),
block allocation with prefix-cache lookup, preemption by recompute (newest first).

Priority (Request.priority, vLLM's convention: lower is served first): both queues are kept in
priority order, arrival order among equals, so the running requests with the best priority get
the step's budget and blocks first, the waiting one with the best priority is admitted next,
and preemption takes the worst (the newest among equals). With every priority equal (the
default, 0) this is plain first come first served: `add` appends, a preempted request goes back
to the front, new running requests are appended (`place`, `place_preempted`). With
`priority_preemption` (on by default), a waiting request of strictly better priority than the worst
running one waits neither for a sequence slot nor for KV blocks: the worst is preempted for it
(SGLang's priority preemption; the Batch API's requests make room for interactive ones this way).

`schedule()` plans the next forward pass (a StepPlan); `update(plan, output)` applies what it
produced (engine/step.py has the whole step). `on_computed()` records KV progress,
registers newly full blocks in the prefix cache and, on models whose every layer has a sliding
window, gives back the blocks wholly behind it (`kv_window_tokens`); `rollback()` frees the blocks
only rejected proposals used. All calls happen under the rank's lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.worker.engine.api import RequestKind
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.kv_offload import HostKvCache
from services.worker.engine.kv_trim import NO_TRIM, KvTrim
from services.worker.engine.request import Request, RequestStatus, finish_rule
from services.worker.engine.step import StepOutput, StepUpdate
from shared.block_hash import chain_hash
from shared.errors import ResourceExhausted

if TYPE_CHECKING:
    import torch

# growth room looked for when placing a request's blocks (tokens of its max_tokens)
_GROWTH_CAP_TOKENS = 512


def place(queue: Sequence[Request], priority: int) -> int:
    """Where a newly queued request of `priority` goes: after every request of the same or a
    better (lower) priority, so equals keep their arrival order."""
    i = len(queue)
    while i > 0 and queue[i - 1].priority > priority:
        i -= 1
    return i


def place_preempted(queue: Sequence[Request], priority: int) -> int:
    """Where a preempted request goes back: before every request of its priority (it was
    admitted before them) and after the better ones."""
    i = 0
    while i < len(queue) and queue[i].priority < priority:
        i += 1
    return i


def preemption_victim(candidates: Sequence[Request]) -> Request:
    """The request that gives up its blocks first: the worst priority, the newest among equals."""
    return max(candidates, key=lambda r: (r.priority, r.arrival_seq))


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens of token_ids whose K/V this step computes
    # proposals verified after them (request.spec_token_ids[:num_draft_tokens]); their K/V is
    # written too, but counts as computed only once accepted
    num_draft_tokens: int = 0

    @property
    def samples(self) -> bool:
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class StepPlan:
    """What one step computes, in order (the runner executes it, `update` applies it)."""

    scheduled: list[ScheduledRequest]
    # requests that cannot fit in the pool even alone (they are finished by the caller)
    unfittable: list[Request]
    budget_left: int = 0  # tokens of the step's budget left (room for proposals to verify)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_tokens: int,
        max_num_seqs: int,
        kv_window_tokens: int | None = None,
        kv_trim: KvTrim = NO_TRIM,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int = 0,
        host_cache: HostKvCache | None = None,
        priority_preemption: bool = True,
    ) -> None:
        self.blocks = block_manager
        # a better-priority waiting request takes the worst running one's sequence slot
        self.priority_preemption = priority_preemption
        # the prefix cache's host tier (kv_offload.py): where the pool's hits end, a prompt's
        # next blocks may be copied back from it
        self.host_cache = host_cache
        self.block_size = block_manager.block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        # every layer's attention window is at most this many tokens (model_variants
        # .kv_window_tokens); None: some layer attends to every token, nothing is given back
        self.kv_window_tokens = kv_window_tokens
        # what of a prompt's KV a DECODE_REMOTE request does not need moved (kv_trim.py)
        self.kv_trim = kv_trim
        # the finish rule's inputs (update): the model's EOS ids and longest sequence (tokens)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # since start (count of preempt events)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_prompt_tokens(self) -> int:
        """Tokens still to prefill: every uncomputed token of a waiting request (a preempted one
        recomputes its outputs too) plus the rest of the prompts being prefilled in chunks. The
        prefill backlog an autoscaler watches (pdserve_rank_waiting_prompt_tokens)."""
        queued = sum(r.num_uncomputed_tokens for r in self.waiting)
        chunked = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running)
        return queued + chunked

    def add(self, req: Request) -> None:
        """Queue a WAITING request (new, or DECODE_REMOTE once its KV arrived)."""
        if req.status is not RequestStatus.WAITING:
            raise ValueError(f"only WAITING requests are queued, not {req.status.name}")
        self.waiting.insert(place(self.waiting, req.priority), req)

    # ---- scheduling ----------------------------------------------------------------------
    def grow(self, req: Request, num_tokens: int) -> bool:
        """Give the request the blocks `num_tokens` need (no preemption); False when short."""
        need = self.blocks.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        after = req.block_ids[-1] if req.block_ids else None
        req.block_ids.extend(self.blocks.allocate(need, after, self._want_blocks(req)))
        return True

    def _want_blocks(self, req: Request) -> int:
        """Blocks the request will probably hold in total (prompt + a bounded share of its
        max_tokens): the allocator looks for a free run this long so it can grow in place."""
        growth = min(req.sampling.max_tokens - req.num_counted_towards_max, _GROWTH_CAP_TOKENS)
        return self.blocks.blocks_needed(req.num_tokens + max(0, growth)) - len(req.block_ids)

    def preempt(self, req: Request) -> None:
        """Free the request's blocks; it recomputes everything (prompt + outputs) later."""
        self.running.remove(req)
        self._drop_blocks(req)
        req.preempt()
        self.num_preemptions += 1
        self.waiting.insert(place_preempted(self.waiting, req.priority), req)

    def _drop_blocks(self, req: Request) -> None:
        self.blocks.free(req.block_ids[req.num_released_blocks :])
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_released_blocks = 0
        req.num_trimmed_blocks = 0
        req.num_hashed_blocks = 0
        req.last_block_hash = req.hash_root

    def _make_room_for_better_waiting(self) -> None:
        """Priority preemption: every sequence slot is taken and the best waiting request has a
        strictly better priority than the worst running one, which gives up its slot and blocks
        (it recomputes later). One per step: a slot frees for the next better waiting request
        at the next step."""
        if not (self.priority_preemption and self.waiting and self.running):
            return
        if len(self.running) < self.max_num_seqs:
            return
        victim = preemption_victim(self.running)
        if self.waiting[0].priority < victim.priority:
            self.preempt(victim)

    def _victim_for_blocks(self, req: Request, budget: int) -> Request | None:
        """Priority preemption under KV pressure: the running request that gives its blocks to
        `req`, a waiting one that does not get blocks for its next chunk: the worst running one
        when its priority is strictly worse than `req`'s, and only if the blocks of every such
        request could make room (else none is preempted for nothing)."""
        if not self.priority_preemption:
            return None
        worse = [r for r in self.running if r.priority > req.priority]
        if not worse:
            return None
        need = self.blocks.blocks_needed(min(req.num_uncomputed_tokens, budget))
        held = sum(len(r.block_ids) - r.num_released_blocks for r in worse)
        if self.blocks.num_free_blocks + held < need:
            return None
        return preemption_victim(worse)

    def schedule(self) -> StepPlan:
        budget = self.max_batch_tokens
        scheduled: list[ScheduledRequest] = []
        unfittable: list[Request] = []
        preempted = False
        self._make_room_for_better_waiting()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed_tokens, budget)
            fits = True
            while not self.grow(req, req.num_computed_tokens + n):
                # running is in priority order: those before i are at least as good as req
                victim = preemption_victim(self.running[i:])
                if victim is req and not scheduled and len(self.running) == 1:
                    unfittable.append(req)  # alone and still too big: never fits
                    self.running.pop(i)
                    fits = False
                    break
                self.preempt(victim)
                preempted = True
                if victim is req:
                    fits = False
                    break
            if not fits:
                continue  # req left running; running[i] is now the next request
            scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = self._admit_waiting(req, budget)
            if n == 0:
                giver = self._victim_for_blocks(req, budget)
                if giver is None:
                    break
                # the giver may be in this step already: it leaves it with its budget
                budget += sum(s.num_new_tokens for s in scheduled if s.request is giver)
                scheduled = [s for s in scheduled if s.request is not giver]
                self.preempt(giver)
                continue
            self.waiting.popleft()
            self.running.insert(place(self.running, req.priority), req)
            req.mark_running()
            scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return StepPlan(scheduled, unfittable, budget)

    def _admit_waiting(self, req: Request, budget: int) -> int:
        """Give a waiting request blocks (prefix hits first); returns tokens scheduled or 0."""
        bs = self.block_size
        if req.block_ids:  # KV imported (DECODE_REMOTE): blocks already held
            n = min(req.num_uncomputed_tokens, budget)
            return n if self.grow(req, req.num_computed_tokens + n) else 0
        # at least the last token is computed so there are logits to sample from; a request that
        # still needs its prompt logprobs computes the whole prompt (its blocks are cached after)
        max_hit_blocks = 0 if req.wants_prompt_logprobs else (req.num_tokens - 1) // bs
        cached = self.blocks.lookup_prefix(req.token_ids, max_hit_blocks, req.hash_root)
        last_hash = self.blocks.block_hash(cached[-1]) if cached else req.hash_root
        # the next blocks from the host tier: restored into the first fresh blocks
        restore = self._tier_hits(req.token_ids, last_hash, len(cached), max_hit_blocks)
        num_cached_tokens = (len(cached) + len(restore)) * bs
        n = min(req.num_tokens - num_cached_tokens, budget)
        need = self.blocks.blocks_needed(num_cached_tokens + n) - len(cached)
        if not self.blocks.can_allocate(need, cached):
            return 0  # wait for blocks (add-time checks guarantee the prompt fits alone)
        fetched = self._fetch(restore)
        self.blocks.take(cached)
        req.block_ids = list(cached)
        fresh = self.blocks.allocate(need, cached[-1] if cached else None, self._want_blocks(req))
        req.block_ids += fresh
        if fetched is not None:
            self._restore(fetched, restore, fresh[: len(restore)])
            last_hash = restore[-1]
        req.num_computed_tokens = num_cached_tokens
        req.num_hashed_blocks = len(cached) + len(restore)
        req.last_block_hash = last_hash
        if not req.stats_fixed:
            req.stats_fixed = True
            req.num_local_cached_tokens = num_cached_tokens
            self.blocks.record_query(req.num_prompt_tokens, num_cached_tokens)
        return n

    # ---- the host tier (kv_offload.py) ---------------------------------------------------
    def _tier_hits(self, token_ids: Sequence[int], parent: int | None, start: int, end: int) -> list[int]:
        """Chain hashes of the full blocks start.. (before `end`) of `token_ids` that the host
        tier holds, in a row; `parent`: block start - 1's hash; none without a tier."""
        if self.host_cache is None:
            return []
        return self.host_cache.lookup(token_ids, parent, start, end)

    def _fetch(self, hashes: list[int]) -> torch.Tensor | None:
        """The tier's blocks of `hashes`, copied out before the allocation that gives them
        device blocks: the blocks it evicts go into the tier and may push these out."""
        if self.host_cache is None or not hashes:
            return None
        return self.host_cache.fetch(hashes)

    def _restore(self, fetched: torch.Tensor, hashes: list[int], blocks: list[int]) -> None:
        """Fetched blocks into fresh device `blocks`, registered under their hashes."""
        assert self.host_cache is not None
        self.host_cache.restore(fetched, blocks)
        for block, block_hash in zip(blocks, hashes, strict=True):
            self.blocks.cache_block(block, block_hash)

    # ---- after the forward pass ----------------------------------------------------------
    def update(self, plan: StepPlan, output: StepOutput) -> list[StepUpdate]:
        """Apply a step: prefill progress, each sampling request's accepted run (output.runs)
        through the finish rule, the KV it made valid, the blocks only rejected proposals used;
        a PREFILL_ONLY request leaves the queues HELD with its blocks. Returns the sampling
        requests in order, each with its finish reason (None: it goes on)."""
        updates: list[StepUpdate] = []
        runs = iter(output.runs)
        for s, seq in zip(plan.scheduled, output.batch, strict=True):
            req = s.request
            if req.num_computed_tokens < req.num_prompt_tokens:
                req.num_prefill_chunks += 1
                req.prefill_ns += output.elapsed_ns
            req.prompt_logprobs.extend(seq.prompt_logprobs)
            if not s.samples:
                self.on_computed(req, s.num_new_tokens)
                continue
            run = next(runs)
            if req.sampling.max_tokens <= 0:
                # prompt logprobs only (max_tokens 0): the prompt is computed, nothing is drawn
                run = []
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
            self.on_computed(req, computed - req.num_computed_tokens)
            if s.num_draft_tokens:
                self.rollback(req)
            if req.kind is RequestKind.PREFILL_ONLY:
                self.remove(req, keep_blocks=True)
                req.hold(reason)
            updates.append(StepUpdate(req, reason))
        return updates

    def on_computed(self, req: Request, num_new_tokens: int) -> None:
        req.num_computed_tokens += num_new_tokens
        self.hash_full_blocks(req)
        self._release_behind_window(req)

    def _release_behind_window(self, req: Request) -> None:
        """Give back the blocks no query of the request can read again: the next one is at
        position num_computed_tokens and sees keys from num_computed_tokens - window + 1 on
        (later ones, verify passes included, see fewer). Already hashed, so they stay in the
        prefix cache until reused. Not for PREFILL_ONLY requests: their whole prompt is
        exported."""
        window = self.kv_window_tokens
        if window is None or req.kind is RequestKind.PREFILL_ONLY:
            return
        behind = min((req.num_computed_tokens - window + 1) // self.block_size, req.num_hashed_blocks)
        if behind > req.num_released_blocks:
            self.blocks.free(req.block_ids[req.num_released_blocks : behind])
            req.num_released_blocks = behind

    def rollback(self, req: Request) -> None:
        """Free the tail blocks that only rejected proposals used: a request holds the blocks
        its tokens need (the next step computes its last token), no more. Rejected proposals'
        K/V rows lie beyond num_computed_tokens, so they are never hashed into the prefix cache
        and are overwritten before they are ever read."""
        keep = self.blocks.blocks_needed(req.num_tokens)
        if len(req.block_ids) > keep:
            self.blocks.free(req.block_ids[keep:])
            del req.block_ids[keep:]

    def hash_full_blocks(self, req: Request) -> None:
        """Register every block whose tokens are all computed (prompt or generated)."""
        bs = self.block_size
        while (req.num_hashed_blocks + 1) * bs <= req.num_computed_tokens:
            k = req.num_hashed_blocks
            h = chain_hash(req.last_block_hash, req.token_ids[k * bs : (k + 1) * bs])
            self.blocks.cache_block(req.block_ids[k], h)
            req.last_block_hash = h
            req.num_hashed_blocks = k + 1

    # ---- leaving -------------------------------------------------------------------------
    def remove(self, req: Request, keep_blocks: bool = False) -> None:
        """Take the request out of the queues; free its blocks unless kept (PREFILL_ONLY)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not keep_blocks:
            self._drop_blocks(req)

    # ---- DECODE_REMOTE -------------------------------------------------------------------
    def reserve_remote(self, req: Request) -> int:
        """Blocks for the prompt + first token; returns leading prompt blocks found cached (in the
        pool, or copied back from the host tier: the handoff skips them).

        Sets req.num_trimmed_blocks (kv_trim.py): the leading blocks wholly behind every window
        at the first decode position. When every layer is windowed they are not held at all
        (released at once, as _release_behind_window would at that position): their entries
        are placeholders, never read unmasked, written, hashed or freed."""
        bs = self.block_size
        n = req.num_prompt_tokens
        cached = self.blocks.lookup_prefix(req.prompt_token_ids, n // bs, req.hash_root)
        last_hash = self.blocks.block_hash(cached[-1]) if cached else req.hash_root
        trim = self.kv_trim.trim_blocks(n, bs)
        released = trim if self.kv_trim.releases else 0
        # the next full prompt blocks from the host tier (not where leading blocks are released:
        # then the blocks after the pool's hits are not all held)
        restore = [] if released else self._tier_hits(req.prompt_token_ids, last_hash, len(cached), n // bs)
        held_cached = cached[released:]
        head = max(len(cached), released)  # leading entries not newly allocated
        need = self.blocks.blocks_needed(n + 1) - head
        if not self.blocks.can_allocate(need, held_cached):
            raise ResourceExhausted("KV pool full: cannot reserve blocks for the request")
        fetched = self._fetch(restore)
        self.blocks.take(held_cached)
        req.block_ids = list(cached) + [-1] * (head - len(cached))
        req.block_ids += self.blocks.allocate(
            need, held_cached[-1] if held_cached else None, self._want_blocks(req)
        )
        for i in range(len(cached), head):  # released, never held: any valid id, masked out
            req.block_ids[i] = req.block_ids[head]
        if fetched is not None:
            self._restore(fetched, restore, req.block_ids[len(cached) : len(cached) + len(restore)])
            last_hash = restore[-1]
        num_cached = len(cached) + len(restore)  # the handoff skips them (import_kv)
        req.num_released_blocks = released
        req.num_trimmed_blocks = trim
        req.num_hashed_blocks = num_cached
        req.last_block_hash = last_hash
        req.stats_fixed = True
        req.num_local_cached_tokens = num_cached * bs
        self.blocks.record_query(n, num_cached * bs)
        return num_cached

    def recompute_remote(self, req: Request) -> None:
        """Its KV transfer failed: it keeps its reserved blocks and the handoff token, and
        computes everything after its own prefix-cache hits (what the failed import wrote is
        never trusted: only blocks it computes get hashed), chunked like any prompt. Blocks it
        never held (a trimmed handoff on an all-windowed model) are needed again for that: it
        starts over like a preempted request (prefix lookup, fresh blocks); so does one whose
        failed transfer may still write its blocks (req.kv_import_unsettled: they are
        quarantined, handoff.py)."""
        req.num_trimmed_blocks = 0
        if req.num_released_blocks > 0 or req.kv_import_unsettled:
            self._drop_blocks(req)
        else:
            req.num_computed_tokens = req.num_hashed_blocks * self.block_size
        req.kv_arrived()
        self.add(req)

    def start_remote(self, req: Request) -> None:
        """All prompt KV is in place: decode from the handoff token. Trimmed blocks are passed
        over by the hash chain without being registered: no later request may find them."""
        req.num_computed_tokens = req.num_prompt_tokens
        bs = self.block_size
        while req.num_hashed_blocks < req.num_trimmed_blocks:
            k = req.num_hashed_blocks
            req.last_block_hash = chain_hash(req.last_block_hash, req.token_ids[k * bs : (k + 1) * bs])
            req.num_hashed_blocks = k + 1
        self.hash_full_blocks(req)
        req.kv_arrived()
        self.add(req)
