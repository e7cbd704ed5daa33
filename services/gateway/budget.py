"""A request's max_tokens, owned in one place (`MaxTokens`): what the client asked for (None =
unset) and the gateway's default, from which the request's budget is resolved against the chosen
workers' max_model_len (`validation.resolve_max_tokens` holds the rule and its errors).

Where the figure lives afterwards, and nowhere else: `RequestState.max_tokens` holds the resolved
budget (accounting clamps to it, `finish_reason` compares with it); each run's `WorkerJob` carries
what is left of it, so a migrated run never gets more than the request had."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.validation import resolve_max_tokens


@dataclass(frozen=True)
class MaxTokens:
    """The client's max_tokens (validated: >= 1 when set, or 0 to only score the prompt) and the
    default for an unset one."""

    requested: int | None
    default: int

    @property
    def bound(self) -> int:
        """The most the request may generate whatever workers serve it (tokens): what the
        scheduler is told before the workers, and so their max_model_len, are known."""
        return self.requested if self.requested is not None else self.default

    def resolve(self, prompt_tokens: int, max_model_len: int) -> int:
        """The request's budget on workers that accept `max_model_len` tokens of prompt +
        generation (0 = unknown). Raises InvalidArgument when the prompt or an explicit
        max_tokens does not fit; an unset one is shortened to what fits."""
        return resolve_max_tokens(self.requested, self.default, prompt_tokens, max_model_len)
