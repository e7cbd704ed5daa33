"""vLLM's thinking_token_budget at the gateway: the client's budget checked and resolved into what
the workers need (inputs.ThinkingBudget): the reasoning parser's tags as the served model's token
ids and whether the prompt left thinking open. Pure: the tokenizer's calls are passed in.

As in vLLM, a budget needs a reasoning parser (the gateway's --reasoning-parser) to know where
thinking starts and ends. What counts is what the parser calls reasoning (reasoning.py):
- `qwen3`: only from a `<think>` the model writes (the prompt is not read);
- `deepseek_r1`: from the first token when the prompt's end is inside `<think>` (the template
  opened it, as DeepSeek-R1 templates do), else from a `<think>` the model writes.
"""

from __future__ import annotations

from collections.abc import Callable

from services.gateway.inputs import ThinkingBudget
from services.gateway.reasoning import THINK_END, THINK_START
from services.gateway.reasoning import Kind as ReasoningKind
from services.gateway.validation import InvalidField

# the largest budget (tokens): above any model's context, so a larger one means "no limit" to the
# client too, but a typo of a negative number in an unsigned field is refused
MAX_THINKING_TOKEN_BUDGET = 1 << 20
# prompt tokens decoded to find whether the prompt ends inside <think> (the template writes the
# tag at the very end, after the generation prompt's few tokens)
PROMPT_TAIL_TOKENS = 32


def check(budget: int | None) -> int | None:
    """A client's thinking_token_budget: None (unset) or an integer in [0, 1048576]; vLLM's -1
    means no limit (None)."""
    if budget is None or budget == -1:
        return None
    if (
        isinstance(budget, bool)
        or not isinstance(budget, int)
        or not 0 <= budget <= MAX_THINKING_TOKEN_BUDGET
    ):
        raise InvalidField(
            f"thinking_token_budget must be an integer in [0, {MAX_THINKING_TOKEN_BUDGET}] (or -1 for no "
            f"limit), got {budget!r}",
            "thinking_token_budget",
        )
    return budget


def resolve(
    budget: int | None,
    kind: ReasoningKind | None,
    tags: Callable[[], tuple[tuple[int, ...], tuple[int, ...]]],
    prompt_tail_text: Callable[[], str],
) -> ThinkingBudget | None:
    """The budget as the workers get it (None: no limit). `tags`: the ids of THINK_START and
    THINK_END (PromptTokenizer.think_tag_ids, tokenized once); `prompt_tail_text`: the text of
    the prompt's last PROMPT_TAIL_TOKENS tokens."""
    budget = check(budget)
    if budget is None:
        return None
    if kind is None:
        raise InvalidField(
            "thinking_token_budget needs a reasoning parser to know where thinking starts and ends; "
            "start the gateway with --reasoning-parser deepseek_r1 or qwen3",
            "thinking_token_budget",
        )
    start, end = tags()
    open_at_start = False
    if kind == "deepseek_r1":
        tail = prompt_tail_text()
        open_at_start = tail.rfind(THINK_START) > tail.rfind(THINK_END)
    return ThinkingBudget(budget, start, end, open_at_start)
