"""How many tokens to propose for a request this step (pure functions of its record).

Per request: a moving average of its acceptance; when it stays low the request proposes nothing
for a while (doubling back-off up to MAX_BACKOFF_STEPS), then probes again. Per step, the scheduler
caps the step's tokens (Scheduler.max_spec_batch_tokens): beyond that verification is no longer
free.
"""

from __future__ import annotations

import dataclasses

from services.worker.engine.request import SpecRecord

# below this moving-average acceptance (ratio) a request backs off
LOW_ACCEPTANCE = 0.3
# weight of the newest verify in the moving average (ratio)
EMA_WEIGHT = 0.3
# proposals verified before a request may back off (count)
MIN_DRAFTS_BEFORE_BACKOFF = 8
FIRST_BACKOFF_STEPS = 4
# the moving average a request restarts from after a back-off (ratio; (1 - EMA_WEIGHT) * it
# is below LOW_ACCEPTANCE)
PROBE_ACCEPTANCE = 0.4
MAX_BACKOFF_STEPS = 64


def proposal_budget(record: SpecRecord, k: int, tokens_left: int, context_left: int) -> int:
    """Tokens to propose now: k, no more than the request may still generate after the bonus
    token (tokens_left - 1) or the model's context holds (context_left), none while backing off."""
    if record.skip_steps > 0:
        return 0
    return max(0, min(k, tokens_left - 1, context_left))


def after_skipped_step(record: SpecRecord) -> SpecRecord:
    return dataclasses.replace(record, skip_steps=max(0, record.skip_steps - 1))


def after_verify(record: SpecRecord, proposed: int, accepted: int) -> SpecRecord:
    """The record after one verification of `proposed` tokens, `accepted` of them accepted."""
    if proposed <= 0:
        return record
    rate = accepted / proposed
    ema = (1 - EMA_WEIGHT) * record.recent_acceptance + EMA_WEIGHT * rate
    drafts = record.num_draft_tokens + proposed
    rec = dataclasses.replace(
        record,
        num_draft_tokens=drafts,
        num_accepted_tokens=record.num_accepted_tokens + accepted,
        recent_acceptance=ema,
    )
    if ema < LOW_ACCEPTANCE and drafts >= MIN_DRAFTS_BEFORE_BACKOFF:
        backoff = min(MAX_BACKOFF_STEPS, max(FIRST_BACKOFF_STEPS, 2 * record.backoff_steps))
        # after the back-off one probe decides: restart the average just above the threshold,
        # where a probe with nothing accepted falls below it again
        return dataclasses.replace(
            rec, skip_steps=backoff, backoff_steps=backoff, recent_acceptance=PROBE_ACCEPTANCE
        )
    if rate >= 0.5:
        rec = dataclasses.replace(rec, backoff_steps=0)
    return rec
