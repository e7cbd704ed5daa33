"""A rank's speculative decoding as one object its step calls (engine/step.py): the proposer
(n-gram lookup or a draft model), k, the per-step room for verification (the step cap and the
step-cost model), acceptance of verified runs, per-request back-off, the proposals a handoff
carries, and the acceptance stats. `NoSpeculation` is the same interface doing nothing: turning
speculation off is choosing that object, not a branch in the step.

Per step, under the rank's lock unless said otherwise:
- `propose(plan)`: before the forward, the proposals each decoding request verifies (room left
  by the plan's token budget, at most max_spec_batch_tokens in all, and with a cost model only
  those whose expected yield pays for their verification); a draft model forgets the KV of
  requests no longer running.
- `after_verify(plan, output)`: after it, each sampling request's samples cut to the accepted
  run (spec/verify.py), stats and back-off recorded, the step cost observed.
- `after_update(updates)`: after scheduler.update, the next proposals of each request that goes
  on (decoding ones verify them next step, a PREFILL_ONLY handoff sends them); with a draft model
  they are computed by `draft_round` (its forward passes run unlocked) and a handoff's output
  waits for it: `after_update` returns those handoffs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.worker.engine.api import RequestKind
from services.worker.engine.request import Request, RequestStatus
from services.worker.engine.spec import policy
from services.worker.engine.spec.draft import DraftJob, DraftProposer, fit_to_room
from services.worker.engine.spec.ngram import NgramProposer
from services.worker.engine.spec.stats import SpecStats
from services.worker.engine.spec.verify import accept_run
from services.worker.engine.step import StepOutput, StepUpdate

if TYPE_CHECKING:
    from services.worker.engine.scheduler import Scheduler, StepPlan

log = logging.getLogger(__name__)


class NoSpeculation:
    """Speculation off: no proposals, nothing verified, nothing to record."""

    proposer: NgramProposer | DraftProposer | None = None
    num_tokens = 0  # k
    step_cost: policy.StepCostModel | None = None

    def propose(self, plan: StepPlan) -> None:
        pass

    def after_verify(self, plan: StepPlan, output: StepOutput) -> None:
        pass

    def after_update(self, updates: list[StepUpdate]) -> set[Request]:
        return set()

    def has_round(self) -> bool:
        """A draft round is due after this step (the step loop runs `draft_round`)."""
        return False

    def draft_round(self, lock: threading.Lock, emit: Callable[[Request, list[int]], None]) -> None:
        pass

    def abandon_round(self) -> list[Request]:
        """The step loop failed: forget the round; the handoffs that waited for it."""
        return []

    def handoff_drafts(self, req: Request, draft_token_ids: tuple[int, ...]) -> list[int]:
        """What a DECODE_REMOTE request verifies first of the prefill worker's proposals."""
        return []

    def drop(self, req: Request) -> None:
        """The request ended, was released or aborted: forget its state (draft KV)."""

    def stats(self) -> SpecStats:
        return SpecStats()

    def draft_blocks(self) -> tuple[int, int]:
        """(free, total) blocks of the draft model's KV pool; (0, 0) without one."""
        return 0, 0


class Speculation(NoSpeculation):
    """Speculative decoding of one rank (every call under the rank's lock but draft_round's
    forward passes)."""

    def __init__(
        self,
        proposer: NgramProposer | DraftProposer,
        num_tokens: int,
        scheduler: Scheduler,
        max_spec_batch_tokens: int,
        max_model_len: int,
        vocab_size: int,
        dp_rank: int = 0,
    ) -> None:
        self.proposer = proposer
        self.num_tokens = num_tokens  # k
        self.scheduler = scheduler
        # per-step back-off: proposals are verified only while the step has at most this many
        # tokens in all (beyond it verification is no longer free); 0 = never
        self.max_spec_batch_tokens = max_spec_batch_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size  # a handoff's proposals must be ids of this vocabulary
        self.dp_rank = dp_rank
        # the rank's learned step time (spec/policy.py); None = proposals fill the cap, best
        # recent acceptance first
        self.step_cost: policy.StepCostModel | None = None
        self._stats = SpecStats()
        # requests waiting for the draft model's proposals this step, with how many they want
        self._draft_wants: list[tuple[Request, int]] = []
        self._jobs: list[DraftJob] = []

    @property
    def draft(self) -> DraftProposer | None:
        return self.proposer if isinstance(self.proposer, DraftProposer) else None

    # ---- before the forward --------------------------------------------------------------
    def propose(self, plan: StepPlan) -> None:
        """Give decoding requests room to verify their proposals: no more than what is left of
        the token budget, capped per step by max_spec_batch_tokens, and with a step-cost model
        only the proposals whose expected yield pays for their verification (policy.plan_drafts);
        without one, best recent acceptance first. Proposals never preempt anything and never
        delay a prefill: without room they are dropped."""
        if self.draft is not None:
            self.draft.drop_unless_running()  # preempted requests recompute their draft KV
        scheduled = plan.scheduled
        step_tokens = sum(s.num_new_tokens for s in scheduled)
        room = min(plan.budget_left, self.max_spec_batch_tokens - step_tokens)
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
                saturated=bool(self.scheduler.waiting),
            )
            saving_of = {id(s): v for s, v in zip(sampling, savings, strict=True)}
            room_plan = policy.plan_drafts(
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
            room_plan = []
            for s in candidates:
                d = min(len(s.request.spec_token_ids), max(room, 0))
                room_plan.append(d)
                room -= d
        for s, d in zip(candidates, room_plan, strict=True):
            req = s.request
            if d > 0 and self.scheduler.grow(req, req.num_computed_tokens + s.num_new_tokens + d):
                s.num_draft_tokens = d
            else:
                req.spec_token_ids = []  # no room this step: proposed again after it

    # ---- after the forward ---------------------------------------------------------------
    def after_verify(self, plan: StepPlan, output: StepOutput) -> None:
        """Cut each sampling request's samples to the accepted run: its proposals up to the
        first mismatch plus the target's own token there; record acceptance and back-off, and
        teach the step-cost model a decode step's time."""
        self._observe_step_cost(plan, output.cost_ns)
        sampling = [s for s in plan.scheduled if s.samples]
        for i, s in enumerate(sampling):
            req = s.request
            proposals = req.spec_token_ids[: s.num_draft_tokens]
            if not proposals or req.sampling.max_tokens <= 0:  # max_tokens 0: nothing is drawn
                continue
            run = accept_run(proposals, output.runs[i])
            accepted = len(run) - 1
            self._stats.record(len(proposals), accepted)
            req.spec = policy.after_verify(req.spec, len(proposals), accepted)
            output.runs[i] = run

    def _observe_step_cost(self, plan: StepPlan, cost_ns: int) -> None:
        """A decode step (one new token per sequence, with or without proposals); prefill
        chunks, whose attention grows with their length, are left out."""
        cost = self.step_cost
        if cost is None or any(s.num_new_tokens != 1 for s in plan.scheduled):
            return
        num_tokens = sum(1 + s.num_draft_tokens for s in plan.scheduled)
        cost.observe(num_tokens, len(plan.scheduled), cost_ns / 1e6)

    def after_update(self, updates: list[StepUpdate]) -> set[Request]:
        """The next proposals (req.spec_token_ids) of every request that goes on: a decoding
        request verifies them next step, a PREFILL_ONLY handoff sends them. With a draft model
        they come from `draft_round`: returns the handoffs whose output waits for it."""
        deferred: set[Request] = set()
        for u in updates:
            if u.reason is not None:
                continue
            req = u.request
            n = self._budget(req)
            if n == 0:
                req.spec = policy.after_skipped_step(req.spec)
            elif self.draft is not None:
                self._draft_wants.append((req, n))
                if req.kind is RequestKind.PREFILL_ONLY:
                    deferred.add(req)
            else:
                assert isinstance(self.proposer, NgramProposer)
                req.spec_token_ids = self.proposer.propose(req.token_ids, n, owner=req)
        if self.draft is not None and self._draft_wants:
            # the next step verifies one token per running request plus proposals, at most
            # max_spec_batch_tokens in all
            room = self.max_spec_batch_tokens - len(self.scheduler.running)
            self._draft_wants = fit_to_room(self._draft_wants, room)
            self._jobs = self.draft.plan([w for w in self._draft_wants if w[1] > 0])
        return deferred

    def _budget(self, req: Request) -> int:
        """Proposals wanted for the tokens after req.token_ids (0 while the request backs off)."""
        return policy.proposal_budget(
            req.spec,
            self.num_tokens,
            tokens_left=req.sampling.max_tokens - req.num_counted_towards_max,
            context_left=self.max_model_len - req.num_tokens,
        )

    # ---- the draft model's round (between steps) -----------------------------------------
    def has_round(self) -> bool:
        return bool(self._draft_wants)

    def draft_round(self, lock: threading.Lock, emit: Callable[[Request, list[int]], None]) -> None:
        """The draft model's forward passes (without `lock`), then under it the proposals handed
        out: decoding requests verify them next step, each waiting handoff is passed to `emit`
        with its proposals."""
        draft = self.draft
        assert draft is not None
        jobs, self._jobs = self._jobs, []
        try:
            draft.run(jobs)
        except Exception:  # proposals are an optimization: never fail a request over them
            log.exception("draft model failed on rank %d; proposing nothing this step", self.dp_rank)
            for job in jobs:
                job.proposals = []
        with lock:
            proposals = draft.apply(jobs)
            for req, _ in self._draft_wants:
                props = proposals.get(req, [])
                if req.kind is RequestKind.PREFILL_ONLY:
                    draft.drop(req)  # it decodes elsewhere
                    emit(req, props)
                elif req.status is RequestStatus.RUNNING:
                    req.spec_token_ids = props
            self._draft_wants = []

    def abandon_round(self) -> list[Request]:
        handoffs = [req for req, _ in self._draft_wants if req.kind is RequestKind.PREFILL_ONLY]
        self._draft_wants, self._jobs = [], []
        return handoffs

    # ---- handoffs, leaving, stats --------------------------------------------------------
    def handoff_drafts(self, req: Request, draft_token_ids: tuple[int, ...]) -> list[int]:
        """The prefill worker's proposals: capped like this rank's own, and only token ids of
        this vocabulary (anything else is dropped, never an error)."""
        if not draft_token_ids:
            return []
        drafts = list(draft_token_ids[: self._budget(req)])
        if any(not 0 <= t < self.vocab_size for t in drafts):
            return []
        return drafts

    def drop(self, req: Request) -> None:
        if self.draft is not None:
            self.draft.drop(req)

    def stats(self) -> SpecStats:
        stats = self._stats.copy()
        if self.step_cost is not None:
            stats.step_cost_ms = self.step_cost.cost.terms()
        return stats

    def draft_blocks(self) -> tuple[int, int]:
        draft = self.draft
        return (draft.blocks.num_free_blocks, draft.blocks.num_blocks) if draft is not None else (0, 0)
