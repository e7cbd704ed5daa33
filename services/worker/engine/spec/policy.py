"""Each request's speculation record (`SpecRecord`), how many tokens to propose for it, and how
many of them a step verifies (pure functions of the record and of a step-cost model; nothing
here reads a clock).

Per request: a moving average of its acceptance; when it stays low the request proposes nothing
for a while (doubling back-off up to MAX_BACKOFF_STEPS), then probes again.

Per step: verification is not free once a step is compute-bound (SmolLM2 fp32 on one CPU core:
a step costs ~23 ms + ~2.2 ms per sequence + ~1.35 ms per extra token, so 8 proposals add a
third to a step of 8 sequences). Nor is it free on an accelerator, where the cost comes in one
lump instead: a decode step replayed as a CUDA graph pads every sequence of a verify step to
k + 1 rows (decode_graphs.py): on an H200 the lump was ~0.35 ms of a ~3.3 ms step (a CPU
rank has one too, where a step outgrows the row copy's 16 rows: cpu_linear.py).
`StepCostModel` learns fixed + per_seq * sequences + per_token * extra tokens + verify once for
a step that verifies anything (calibrated at start-up, spec/calibrate.py, then online from the
rank's decode steps). `token_savings_ms` says what one more accepted token of each sequence
saves, and `plan_drafts` verifies proposal j of a request only when a**j (a: the request's
per-position acceptance, `position_acceptance`) times that saving exceeds per_token, and a
step's proposals only when together they are expected to save more than verify. Speculation
also applies a hard cap (Speculation.max_spec_batch_tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SpecRecord:
    """One request's speculative-decoding record, for its back-off (Request.spec; replaced by
    the functions below, never mutated)."""

    num_draft_tokens: int = 0  # proposals verified (count)
    num_accepted_tokens: int = 0  # of which accepted (count)
    recent_acceptance: float = 1.0  # moving average of accepted / proposed per verify (ratio)
    skip_steps: int = 0  # steps left without proposals (back-off)
    backoff_steps: int = 0  # length of the last back-off (steps; doubles while acceptance stays low)
    # decayed counts of accepted and of tried proposal positions (policy.position_acceptance)
    accept_weight: float = 0.0
    trial_weight: float = 0.0


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
# per-position acceptance estimate: decayed counts of accepted / tried positions, per verify
# (ratio; about the last 1 / (1 - ACCEPT_DECAY) verifies count), starting from a prior of
# PRIOR_ACCEPTANCE worth PRIOR_TRIALS positions
ACCEPT_DECAY = 0.8
PRIOR_ACCEPTANCE = 0.5
PRIOR_TRIALS = 2.0
# requests within this many tokens of the longest remaining one count as the ones that decide
# when a draining batch ends (tokens)
CRITICAL_SLACK_TOKENS = 8


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
    # the run is verified position by position until the first rejection: `accepted`
    # successes out of accepted (+1 for the rejected one, unless all were accepted) trials
    trials = accepted + (1 if accepted < proposed else 0)
    rec = dataclasses.replace(
        record,
        num_draft_tokens=drafts,
        num_accepted_tokens=record.num_accepted_tokens + accepted,
        recent_acceptance=ema,
        accept_weight=ACCEPT_DECAY * record.accept_weight + accepted,
        trial_weight=ACCEPT_DECAY * record.trial_weight + trials,
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


def position_acceptance(record: SpecRecord) -> float:
    """Estimated probability that a proposal is accepted given the ones before it were (ratio)."""
    return (record.accept_weight + PRIOR_ACCEPTANCE * PRIOR_TRIALS) / (record.trial_weight + PRIOR_TRIALS)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Time of one step (ms) = fixed_ms + per_seq_ms * sequences + per_token_ms * tokens beyond
    each sequence's first (proposals verified, or the rest of a prefill chunk) + verify_ms once
    if the step verifies proposals (a CUDA graph's padding to k + 1 rows per sequence; on a CPU
    the switch from the panel kernel for up to 16 rows to oneDNN's)."""

    fixed_ms: float
    per_seq_ms: float
    per_token_ms: float
    verify_ms: float = 0.0

    def step_ms(self, num_tokens: int, num_seqs: int, verifies: bool = False) -> float:
        extra = max(0, num_tokens - num_seqs)
        return (
            self.fixed_ms
            + self.per_seq_ms * num_seqs
            + self.per_token_ms * extra
            + (self.verify_ms if verifies else 0.0)
        )

    def terms(self) -> tuple[float, float, float, float]:
        """(fixed, per_seq, per_token, verify) in ms."""
        return (self.fixed_ms, self.per_seq_ms, self.per_token_ms, self.verify_ms)


class StepCostModel:
    """Online least squares of step time on (1, sequences, extra tokens, verifies), old steps
    fading by `decay` per observation, with a weak ridge pull toward `prior`.

    The extra tokens of a decode step are its proposals, so their cost is learned only from the
    variation in proposals at a given batch size, never confused with the per-sequence cost, and
    the lump of a verify step only from steps with and without proposals; what the steps do not
    show (say, every step verifies) stays with the prior's split, which is the start-up
    calibration's (or, with no prior given, says verification is free: that lets proposals
    through, and their variation corrects it)."""

    def __init__(
        self, prior: StepCost | None = None, decay: float = 0.99, prior_weight: float = 1e-3
    ) -> None:
        self.prior = prior or StepCost(fixed_ms=10.0, per_seq_ms=0.0, per_token_ms=0.0)
        self.decay = decay
        self.prior_weight = prior_weight
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        self.num_observations = 0
        self._cost = self.prior

    def observe(self, num_tokens: int, num_seqs: int, elapsed_ms: float) -> None:
        """One decode step: num_tokens in all (one per sequence + proposals), elapsed_ms long."""
        extra = max(0, num_tokens - num_seqs)
        x = np.array([1.0, float(num_seqs), float(extra), 1.0 if extra else 0.0])
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * elapsed_ms
        self.num_observations += 1
        p = self.prior
        theta0 = np.array(p.terms())
        # the prior counts as prior_weight observations of each of the four terms
        reg = self.prior_weight * np.eye(4)
        theta = np.linalg.solve(self._xtx + reg, self._xty + reg @ theta0)
        # a cost is never negative (noise can tilt a fit of few points)
        self._cost = StepCost(*(float(max(t, 0.0)) for t in theta))

    @property
    def cost(self) -> StepCost:
        return self._cost


def token_savings_ms(
    cost: StepCost, num_step_tokens: int, tokens_left: Sequence[int], saturated: bool
) -> list[float]:
    """What one more token accepted now saves, per sequence that samples this step (ms).

    tokens_left[i]: tokens sequence i may still generate (max_tokens - generated). A request
    that finishes a step earlier frees its slot for the rest of the run:
    - saturated (requests wait for a slot): the slot is taken at once, so a token is worth its
      share of the step, step_ms / sequences;
    - draining (nobody waits): the batch runs until its longest request ends, so only a token of
      the requests with the most tokens left (within CRITICAL_SLACK_TOKENS; they share the step)
      shortens the run; any other request's token only saves its own per-sequence cost later.
    """
    n = len(tokens_left)
    if n == 0:
        return []
    step_ms = cost.step_ms(num_step_tokens, n)
    if saturated:
        return [step_ms / n] * n
    longest = max(tokens_left)
    critical = [left >= longest - CRITICAL_SLACK_TOKENS for left in tokens_left]
    share = step_ms / sum(critical)
    return [share if c else cost.per_seq_ms for c in critical]


def plan_drafts(
    per_token_ms: float, offers: Sequence[tuple[int, float, float]], room: int, verify_ms: float = 0.0
) -> list[int]:
    """How many proposals each offer verifies this step.

    offers[i] = (proposals available, per-position acceptance a, what an accepted token saves in
    ms); room: at most this many proposals in all. Proposal j (1-based) is accepted with
    probability a**j (it and every one before it), so it is worth a**j * saving and costs
    per_token_ms to verify: it is verified iff it is worth more, best first while there is room
    (within an offer in order, as a**j falls with j). verify_ms is paid once by a step that
    verifies anything: the plan stands only if its expected net saving exceeds it, else the step
    verifies nothing (the best plan either way: the chosen proposals are every one that pays
    for itself)."""
    counts = [0] * len(offers)
    worth = sorted(
        (
            (a**j * saving, j, i)
            for i, (n, a, saving) in enumerate(offers)
            for j in range(1, n + 1)
            if a**j * saving > per_token_ms
        ),
        key=lambda c: (-c[0], c[1]),
    )
    chosen = worth[: max(room, 0)]
    if sum(w - per_token_ms for w, _, _ in chosen) <= verify_ms:
        return counts
    for _, _, i in chosen:
        counts[i] += 1
    return counts
