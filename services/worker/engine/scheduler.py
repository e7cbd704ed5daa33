"""One rank's scheduler: waiting/running queues, the per-step token budget (chunked prefill),
block allocation with prefix-cache lookup, preemption by recompute (newest first), and the room
speculative proposals get in a step.

`schedule()` picks what runs in the next forward pass; `on_computed()` records KV progress,
registers newly full blocks in the prefix cache and, on models whose every layer has a sliding
window, gives back the blocks wholly behind it (`kv_window_tokens`); `rollback()` frees the blocks
only rejected proposals used. All calls happen under the rank's lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.worker.engine.api import RequestKind
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.kv_trim import NO_TRIM, KvTrim
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.spec import policy
from shared.block_hash import chain_hash
from shared.errors import ResourceExhausted

# growth room looked for when placing a request's blocks (tokens of its max_tokens)
_GROWTH_CAP_TOKENS = 512


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
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # requests that cannot fit in the pool even alone (they are finished by the caller)
    unfittable: list[Request]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_tokens: int,
        max_num_seqs: int,
        max_spec_batch_tokens: int = 0,
        kv_window_tokens: int | None = None,
        kv_trim: KvTrim = NO_TRIM,
    ) -> None:
        self.blocks = block_manager
        self.block_size = block_manager.block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        # per-step back-off of speculation: proposals are verified only while the step has at
        # most this many tokens in all (beyond it verification is no longer free); 0 = never
        self.max_spec_batch_tokens = max_spec_batch_tokens
        # every layer's attention window is at most this many tokens (model_variants
        # .kv_window_tokens); None: some layer attends to every token, nothing is given back
        self.kv_window_tokens = kv_window_tokens
        # what of a prompt's KV a DECODE_REMOTE request does not need moved (kv_trim.py)
        self.kv_trim = kv_trim
        # the rank's learned step time (spec/policy.py); None = proposals fill the cap, best
        # recent acceptance first
        self.step_cost: policy.StepCostModel | None = None
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
        self.waiting.append(req)

    # ---- scheduling ----------------------------------------------------------------------
    def _grow(self, req: Request, num_tokens: int) -> bool:
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
        self.waiting.appendleft(req)

    def _drop_blocks(self, req: Request) -> None:
        self.blocks.free(req.block_ids[req.num_released_blocks :])
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_released_blocks = 0
        req.num_trimmed_blocks = 0
        req.num_hashed_blocks = 0
        req.last_block_hash = None

    def schedule(self) -> SchedulerOutput:
        budget = self.max_batch_tokens
        scheduled: list[ScheduledRequest] = []
        unfittable: list[Request] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed_tokens, budget)
            fits = True
            while not self._grow(req, req.num_computed_tokens + n):
                victim = max(self.running[i:], key=lambda r: r.arrival_seq)
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
                break
            self.waiting.popleft()
            self.running.append(req)
            req.mark_running()
            scheduled.append(ScheduledRequest(req, n))
            budget -= n
        self._schedule_drafts(scheduled, budget)
        return SchedulerOutput(scheduled, unfittable)

    def _schedule_drafts(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        """Give decoding requests room to verify their proposals: no more than what is left of
        the token budget, capped per step by max_spec_batch_tokens, and with a step-cost model
        only the proposals whose expected yield pays for their verification (policy.plan_drafts);
        without one, best recent acceptance first. Proposals never preempt anything and never
        delay a prefill: without room they are dropped."""
        step_tokens = sum(s.num_new_tokens for s in scheduled)
        room = min(budget, self.max_spec_batch_tokens - step_tokens)
        candidates = [
            s for s in scheduled if s.request.spec_token_ids and s.samples and s.request.is_decoding
        ]
        if self.step_cost is not None:
            cost = self.step_cost.cost
            sampling = [s for s in scheduled if s.samples]
            savings = policy.token_savings_ms(
                cost,
                step_tokens,
                [s.request.sampling.max_tokens - s.request.num_counted_towards_max for s in sampling],
                saturated=bool(self.waiting),
            )
            saving_of = {id(s): v for s, v in zip(sampling, savings, strict=True)}
            plan = policy.plan_drafts(
                cost.per_token_ms,
                [
                    (
                        len(s.request.spec_token_ids),
                        policy.position_acceptance(s.request.spec),
                        saving_of[id(s)],
                    )
                    for s in candidates
                ],
                room,
                cost.verify_ms,
            )
        else:
            candidates.sort(key=lambda s: -s.request.spec.recent_acceptance)
            plan = []
            for s in candidates:
                d = min(len(s.request.spec_token_ids), max(room, 0))
                plan.append(d)
                room -= d
        for s, d in zip(candidates, plan, strict=True):
            req = s.request
            if d > 0 and self._grow(req, req.num_computed_tokens + s.num_new_tokens + d):
                s.num_draft_tokens = d
            else:
                req.spec_token_ids = []  # no room this step: proposed again after it

    def _admit_waiting(self, req: Request, budget: int) -> int:
        """Give a waiting request blocks (prefix hits first); returns tokens scheduled or 0."""
        bs = self.block_size
        if req.block_ids:  # KV imported (DECODE_REMOTE): blocks already held
            n = min(req.num_uncomputed_tokens, budget)
            return n if self._grow(req, req.num_computed_tokens + n) else 0
        # at least the last token is computed so there are logits to sample from; a request that
        # still needs its prompt logprobs computes the whole prompt (its blocks are cached after)
        max_hit_blocks = 0 if req.wants_prompt_logprobs else (req.num_tokens - 1) // bs
        cached = self.blocks.lookup_prefix(req.token_ids, max_hit_blocks)
        num_cached_tokens = len(cached) * bs
        n = min(req.num_tokens - num_cached_tokens, budget)
        need = self.blocks.blocks_needed(num_cached_tokens + n) - len(cached)
        if not self.blocks.can_allocate(need, cached):
            return 0  # wait for blocks (add-time checks guarantee the prompt fits alone)
        self.blocks.take(cached)
        req.block_ids = list(cached)
        req.block_ids += self.blocks.allocate(need, cached[-1] if cached else None, self._want_blocks(req))
        req.num_computed_tokens = num_cached_tokens
        req.num_hashed_blocks = len(cached)
        req.last_block_hash = self.blocks.block_hash(cached[-1]) if cached else None
        if not req.stats_fixed:
            req.stats_fixed = True
            req.num_local_cached_tokens = num_cached_tokens
            self.blocks.record_query(req.num_prompt_tokens, num_cached_tokens)
        return n

    # ---- after the forward pass ----------------------------------------------------------
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
        """Blocks for the prompt + first token; returns leading prompt blocks found cached.

        Sets req.num_trimmed_blocks (kv_trim.py): the leading blocks wholly behind every window
        at the first decode position. When every layer is windowed they are not held at all
        (released at once, as _release_behind_window would at that position): their entries
        are placeholders, never read unmasked, written, hashed or freed."""
        bs = self.block_size
        n = req.num_prompt_tokens
        cached = self.blocks.lookup_prefix(req.prompt_token_ids, n // bs)
        trim = self.kv_trim.trim_blocks(n, bs)
        released = trim if self.kv_trim.releases else 0
        held_cached = cached[released:]
        head = max(len(cached), released)  # leading entries not newly allocated
        need = self.blocks.blocks_needed(n + 1) - head
        if not self.blocks.can_allocate(need, held_cached):
            raise ResourceExhausted("KV pool full: cannot reserve blocks for the request")
        self.blocks.take(held_cached)
        req.block_ids = list(cached) + [-1] * (head - len(cached))
        req.block_ids += self.blocks.allocate(
            need, held_cached[-1] if held_cached else None, self._want_blocks(req)
        )
        for i in range(len(cached), head):  # released, never held: any valid id, masked out
            req.block_ids[i] = req.block_ids[head]
        req.num_released_blocks = released
        req.num_trimmed_blocks = trim
        req.num_hashed_blocks = len(cached)
        req.last_block_hash = self.blocks.block_hash(cached[-1]) if cached else None
        req.stats_fixed = True
        req.num_local_cached_tokens = len(cached) * bs
        self.blocks.record_query(n, len(cached) * bs)
        return len(cached)

    def recompute_remote(self, req: Request) -> None:
        """Its KV transfer failed: it keeps its reserved blocks and the handoff token, and
        computes everything after its own prefix-cache hits (what the failed import wrote is
        never trusted: only blocks it computes get hashed), chunked like any prompt. Blocks it
        never held (a trimmed handoff on an all-windowed model) are needed again for that: it
        starts over like a preempted request (prefix lookup, fresh blocks)."""
        req.num_trimmed_blocks = 0
        if req.num_released_blocks > 0:
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
