"""A request's max_tokens, owned in one place (`MaxTokens`): what the client asked for (None =
unset) and the gateway's default, from which the request's budget is resolved once, before it is
scheduled, against the smallest max_model_len of the workers serving its model as the gateway
last listed them (`model_cards.py`; 0 = unknown, no limit). So the scheduler is told the real
budget, and a prompt or explicit max_tokens that does not fit is refused (INVALID_ARGUMENT) before
anything starts; `validation.resolve_max_tokens` holds the rule and its errors.

The only re-check (`refit`): when a placement's workers accept fewer tokens than the figure the
budget was resolved against (membership changed in between, or no figure was known), the same
rule is applied to them: an explicit max_tokens that no longer fits is refused the same way, an
unset one is shortened. A placement never lengthens the budget, and a migrated run keeps it.

Where the figure lives afterwards, and nowhere else: `RequestState.max_tokens` holds the budget of
the run's placement (accounting clamps to it, `finish_reason` compares with it); each run's
`WorkerJob` carries what is left of it, so a migrated run never gets more than the request had."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.validation import resolve_max_tokens


@dataclass(frozen=True)
class MaxTokens:
    """The client's max_tokens (validated: >= 1 when set, or 0 to only score the prompt) and the
    default for an unset one."""

    requested: int | None
    default: int

    def resolve(self, prompt_tokens: int, max_model_len: int) -> int:
        """The request's budget (tokens) on workers that accept `max_model_len` tokens of prompt +
        generation (0 = unknown). Raises InvalidArgument when the prompt or an explicit
        max_tokens does not fit; an unset one is shortened to what fits."""
        return resolve_max_tokens(self.requested, self.default, prompt_tokens, max_model_len)

    def refit(self, budget: int, prompt_tokens: int, max_model_len: int) -> int:
        """`budget` (from `resolve`) on the placement's workers, which accept `max_model_len`
        tokens (0 = unknown): unchanged when it fits, else resolved again against them (raises
        like `resolve`)."""
        if max_model_len <= 0 or prompt_tokens + budget <= max_model_len:
            return budget
        return self.resolve(prompt_tokens, max_model_len)
