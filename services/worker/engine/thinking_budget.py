"""vLLM's thinking_token_budget on the worker: the per-request state machine that counts the tokens
generated inside a reasoning model's thinking section and, once the budget is spent, names the
token of the closing tag each next draw must produce. Pure (no torch): the sampler forces what
`forced_token` says (sampler.py), batched over the rows.

The state is derived from the request's generated ids alone, so a prefill worker (the first
token), a decode worker (after the handoff), a speculative verify row (the history extended by
the proposals before it) and a migrated request (its generated tokens in its prompt tail) all see
the same state at the same output index. `ThinkingTracker` advances it incrementally over a
request's append-only output, so each draw costs the tokens added since the last one.

States, in output order:
- BEFORE: thinking not open yet; it opens when the output ends with the start tag.
- THINKING: open; every token generated counts (the closing tag's too, as they come); the output
  ending with the end tag closes it. Once `count` reaches the budget, FORCING begins, from the
  part of the end tag the output already ends with (a tag the model was writing is finished, not
  written twice).
- FORCING: the next draw must be end_token_ids[forced]; after the last one thinking is closed.
- DONE: closed (by the model or by forcing); only the first section counts, as the gateway's
  reasoning parser reads it (after the reasoning everything is content).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingBudget:
    """A request's budget and tags (SamplingParams.thinking_budget), tokenized by the gateway."""

    max_tokens: int  # tokens generated inside the thinking section at most (>= 0)
    start_token_ids: tuple[int, ...]  # the opening tag (at least one id)
    end_token_ids: tuple[int, ...]  # the closing tag, forced once the budget is spent (>= 1 id)
    open_at_start: bool = False  # the prompt opened thinking (deepseek_r1 templates)


class Phase(enum.Enum):
    BEFORE = "before"
    THINKING = "thinking"
    FORCING = "forcing"
    DONE = "done"


@dataclass(frozen=True)
class ThinkingState:
    """Where a request is after `num_output` generated tokens."""

    phase: Phase
    num_output: int = 0  # generated tokens this state has seen
    count: int = 0  # THINKING / FORCING: tokens generated inside the section so far
    forced: int = 0  # FORCING: index into end_token_ids of the next forced token


def initial(budget: ThinkingBudget) -> ThinkingState:
    """The state before the first generated token (a budget of 0 with thinking open at the
    prompt's end forces the closing tag from the first draw)."""
    if not budget.open_at_start:
        return ThinkingState(Phase.BEFORE)
    return _maybe_force(budget, ThinkingState(Phase.THINKING), _Head((), 0))


def advance(budget: ThinkingBudget, state: ThinkingState, output_ids: Sequence[int]) -> ThinkingState:
    """The state once the output is `output_ids` (the whole output: `state` covered its first
    state.num_output ids, which must not have changed)."""
    for n in range(state.num_output, len(output_ids)):
        state = _step(budget, state, output_ids, n + 1)
    return state


def forced_token(budget: ThinkingBudget, state: ThinkingState) -> int | None:
    """The token the next draw must produce, or None (draw freely)."""
    if state.phase is Phase.FORCING:
        return budget.end_token_ids[state.forced]
    return None


def _step(budget: ThinkingBudget, state: ThinkingState, output_ids: Sequence[int], n: int) -> ThinkingState:
    """The state after output_ids[n - 1], the n-th generated token."""
    head = _Head(output_ids, n)
    phase = state.phase
    if phase is Phase.BEFORE:
        if head.ends_with(budget.start_token_ids):
            return _maybe_force(budget, ThinkingState(Phase.THINKING, n), head)
        return ThinkingState(Phase.BEFORE, n)
    if phase is Phase.FORCING:
        forced = state.forced + 1
        if forced >= len(budget.end_token_ids):
            return ThinkingState(Phase.DONE, n, state.count + 1)
        return ThinkingState(Phase.FORCING, n, state.count + 1, forced)
    if phase is Phase.THINKING:
        if head.ends_with(budget.end_token_ids):
            return ThinkingState(Phase.DONE, n, state.count + 1)
        return _maybe_force(budget, ThinkingState(Phase.THINKING, n, state.count + 1), head)
    return ThinkingState(Phase.DONE, n, state.count)


def _maybe_force(budget: ThinkingBudget, state: ThinkingState, head: _Head) -> ThinkingState:
    """THINKING with the budget spent -> FORCING, from the longest proper start of the end tag the
    section's tokens already end with."""
    if state.count < budget.max_tokens:
        return state
    end = budget.end_token_ids
    written = 0
    for k in range(min(len(end) - 1, state.count), 0, -1):
        if head.ends_with(end[:k]):
            written = k
            break
    return ThinkingState(Phase.FORCING, state.num_output, state.count, written)


@dataclass(frozen=True)
class _Head:
    """The first n ids of an output, without copying them."""

    ids: Sequence[int]
    n: int

    def ends_with(self, tag: Sequence[int]) -> bool:
        k = len(tag)
        return 0 < k <= self.n and all(self.ids[self.n - k + j] == tag[j] for j in range(k))


class ThinkingTracker:
    """One request's state, advanced over its append-only output (Request.token_history)."""

    def __init__(self, budget: ThinkingBudget) -> None:
        self.budget = budget
        self._state = initial(budget)

    def state(self, output_ids: Sequence[int]) -> ThinkingState:
        """The state after `output_ids`, the request's whole output so far."""
        if len(output_ids) < self._state.num_output:  # never expected: recount from the start
            self._state = initial(self.budget)
        self._state = advance(self.budget, self._state, output_ids)
        return self._state
