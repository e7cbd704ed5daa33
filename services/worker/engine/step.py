"""The step contract between a rank's scheduler, model runner and speculation: what one
iteration of the step loop plans, runs and applies.

    plan = scheduler.schedule()                 # StepPlan: who computes how many tokens
    speculation.propose(plan)                   # the proposals this step verifies
    batch = plan_batch(plan, eos_token_ids)     # snapshots: the runner reads no Request
    output = StepOutput(batch, runner.execute(batch), ...)  # samples per sampling sequence
    speculation.after_verify(plan, output)      # sampled targets -> accepted runs
    updates = scheduler.update(plan, output)    # tokens appended, KV progress, finish rule
    # the rank ends what ended, then
    speculation.after_update(updates)           # next proposals of what goes on
    speculation.draft_round(...)                # with a draft model: its passes, unlocked

Everything but `runner.execute` and the draft model's passes runs under the rank's lock
(rank.py). With speculation off, `speculation` is spec/speculation.NoSpeculation.

With async scheduling (rank.py) a decode step runs as `runner.execute_async(batch, input_ids)`
instead: step N+1 is planned and queued before step N's tokens are applied, and its snapshots
hold placeholder tokens (the device copies N's drawn ids into its input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.worker.engine.api import FinishReason
from services.worker.engine.model_runner import ScheduledSeq
from services.worker.engine.request import Request

if TYPE_CHECKING:
    from services.worker.engine.scheduler import ScheduledRequest, StepPlan


@dataclass
class StepOutput:
    """What one forward pass produced, in the plan's order."""

    batch: list[ScheduledSeq]  # the snapshots run (their logprobs filled by the runner)
    # per sampling sequence, the tokens it keeps: the runner's samples at its num_logits
    # positions, cut to the accepted run by speculation.after_verify
    runs: list[list[int]]
    elapsed_ns: int = 0  # wall-clock time of the forward pass (nanoseconds)
    cost_ns: int = 0  # what it cost the step thread (spec/calibrate.step_clock; nanoseconds)


@dataclass(frozen=True)
class StepUpdate:
    """One sampling request after scheduler.update: `reason` set when it ended this step (a
    PREFILL_ONLY request is HELD whether or not it ended)."""

    request: Request
    reason: FinishReason | None


def snapshot(s: ScheduledRequest, eos_token_ids: frozenset[int]) -> ScheduledSeq:
    """One scheduled request's share of the step, copied so the forward pass (unlocked) never
    reads a Request field."""
    r = s.request
    start = r.num_computed_tokens
    samples = s.samples  # a property: once per snapshot
    drafts = r.spec_token_ids[: s.num_draft_tokens]
    num_logits = 1 + len(drafts) if samples else 0
    prompt_offset, prompt_targets = r.prompt_targets(start, s.num_new_tokens)
    return ScheduledSeq(
        token_ids=r.token_ids[start : start + s.num_new_tokens] + drafts,
        start_pos=start,
        block_ids=list(r.block_ids),
        sample=samples,
        sampling=r.sampling,
        generator=r.generator,
        num_logits=max(1, num_logits),
        draw_seeds=tuple(r.draw_seed(j) for j in range(num_logits)),
        history=r.token_history(eos_token_ids) if samples else None,
        allowed=r.grammar.masks(drafts) if r.grammar is not None and samples else None,
        prompt_targets=prompt_targets,
        prompt_offset=prompt_offset,
    )


def plan_batch(plan: StepPlan, eos_token_ids: frozenset[int]) -> list[ScheduledSeq]:
    return [snapshot(s, eos_token_ids) for s in plan.scheduled]
