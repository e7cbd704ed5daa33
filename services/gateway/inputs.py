"""What a gateway request is made of: the client's input (`GenerateInput`, built alike by the gRPC
face, convert.py, and the HTTP face, http_convert.py; None means an optional field was not set),
chat turns, per-token logprobs, and the validated sampling/stop parameters the workers get
(`Sampling`). The request's max_tokens is owned by `budget.MaxTokens`."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from services.gateway.tool_calls import Tool
from shared.structured_output import StructuredOutput


@dataclass(frozen=True)
class ChatCallTurn:
    """A tool call an earlier assistant turn made; `arguments` is a JSON object as text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str
    tool_calls: tuple[ChatCallTurn, ...] = ()  # assistant turns that called tools
    tool_call_id: str = ""  # tool turns: the call this is the result of


@dataclass(frozen=True)
class TokenLogprob:
    """One generated (or prompt) token's log-probability, its rank and the most likely tokens at
    its position (most likely first; natural log; -inf for a token that top-k / top-p ruled out)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob)
    # 1-based rank of token_id in its distribution (1 = most likely; 1 + the tokens with a
    # strictly greater logprob); None: the worker sent none (older than 1.18)
    rank: int | None = None


@dataclass(frozen=True)
class GenerateInput:
    """The client's GenerateRequest, unvalidated; None means the optional field was not set."""

    model: str = ""
    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    messages: tuple[ChatTurn, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    cache_salt: str = ""  # vLLM's: the prompt is cached and found only under it
    # vLLM's: False shows the text of special tokens the model writes (never a terminating EOS)
    skip_special_tokens: bool = True
    # Mistral's tool calls: ask the workers to show special tokens so the parser sees
    # [TOOL_CALLS] wherever it comes (a hint: a worker that hides them serves the request too)
    show_tool_markers: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_token_ids: bool = False
    # every frame carries the tokens generated so far (HTTP's continuous_usage_stats; counting
    # per frame costs a few microseconds, so only when asked)
    continuous_usage: bool = False
    request_id: str = ""
    include_stop_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), in the client's order
    min_tokens: int | None = None
    # vLLM's: only these token ids may be generated; None = unset (an empty list is refused, as
    # vLLM refuses it: it would allow nothing)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()  # vLLM's: text never generated (tokenized by the gateway)
    logprobs: int | None = None  # alternatives per token (0-20); None = no logprobs
    structured: StructuredOutput | None = None  # what the output must match
    tools: tuple[Tool, ...] = ()  # offered to the model in the chat prompt
    # score the prompt: alternatives per prompt token (0-20); None = no prompt logprobs. With it
    # max_tokens may be 0 (only the prompt runs)
    prompt_logprobs: int | None = None
    priority: int = 0  # lower is served first (vLLM's convention); int32
    # chat: extra variables for the chat template (the HTTP face's chat_template_kwargs), in the
    # client's order; names apply_chat_template reserves are refused before this is built
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    # chat: the prompt ends inside the last message (an assistant reply the model continues)
    continue_final_message: bool = False
    # chat: a generation prompt (the opening of the model's reply) follows the conversation;
    # False (and not continue_final_message): the prompt ends after the last message
    add_generation_prompt: bool = True
    # keep only k of the prompt's tokens (after the chat template; vLLM's); None = all of it
    truncate_prompt_tokens: int | None = None
    # vLLM's truncation_side: which of them, "left" (the last k: cut on the left) or "right" (the
    # first k); anything else is refused by validation
    truncation_side: str = "left"
    # vLLM's thinking_token_budget (tokens generated inside the reasoning section at most; needs
    # --reasoning-parser); None = no limit
    thinking_token_budget: int | None = None


@dataclass(frozen=True)
class Sampling:
    """Validated sampling/stop parameters, as the workers get them."""

    # This run's budget (tokens): set only when the dispatcher builds a run's job, from the
    # request's resolved max_tokens (RequestState.max_tokens; budget.py) less the tokens generated
    # before the run. 0 in PreparedRequest.sampling, which holds no budget.
    max_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # 0 = off; ignored by greedy requests (workers too)
    cache_salt: str = ""  # "" = none (shared.block_hash.salt_root)
    # the LoRA adapter serving the request (the model id it named); "" = the base model. Its
    # prefix-cache keys start at shared.block_hash.chain_root(cache_salt, lora_adapter)
    lora_adapter: str = ""
    skip_special_tokens: bool = True  # False: special tokens' text is output (vLLM's)
    # False above only as a hint (Mistral's tool-call markers): no worker capability is needed
    special_tokens_hint: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_in_output: bool = False
    first_output_index: int = 0  # > 0 when a migrated request resumes after that many tokens
    unshown_tail_tokens: int = 0  # of those, the last ones whose text was not shown (held back)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by token id
    min_tokens: int = 0  # counted from output index 0 (unchanged by a migration)
    allowed_token_ids: tuple[int, ...] = ()  # only these may be drawn, sorted; () = all
    # the bad words as token sequences (tokenization.PromptTokenizer.bad_word_sequences)
    bad_words: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None  # alternatives per token (0-20); None = no logprobs
    structured: StructuredOutput | None = None  # what the output must match (validated)
    # alternatives per prompt token (0-20) of the raw model distribution; None = none
    prompt_logprobs: int | None = None
    # the thinking_token_budget with the reasoning tags' ids (thinking_budget.py); None = none
    thinking_budget: ThinkingBudget | None = None


@dataclass(frozen=True)
class ThinkingBudget:
    """vLLM's thinking_token_budget as the workers apply it (common.proto ThinkingBudget): once
    max_tokens tokens were generated inside the thinking section, end_token_ids is forced."""

    max_tokens: int  # tokens inside the thinking section at most (>= 0)
    start_token_ids: tuple[int, ...]  # "<think>" in the served model's tokens
    end_token_ids: tuple[int, ...]  # "</think>" in the served model's tokens
    open_at_start: bool  # the prompt left thinking open (deepseek_r1 templates)


def new_request_id() -> str:
    return uuid.uuid4().hex
