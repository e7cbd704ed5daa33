"""Pydantic v2 models of the OpenAI-compatible HTTP API (requests and responses, as JSON).

Requests are validated strictly (a string is not a number, a float is not an integer); fields this
API does not declare land in `model_extra`, where `http_convert` refuses the known-unsupported ones
(functions, ...) and ignores vendor fields with a debug log.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    model_serializer,
)

# the efforts OpenAI and vLLM accept ("max": DeepSeek's); "none" turns a template's thinking off
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

# vLLM's stop_reason: the stop string or stop token id that ended a choice, None otherwise
StopReason = int | str | None


def _unless_none(value: Any) -> bool:
    """exclude_if of vLLM's extra fields: left out of the JSON unless asked for."""
    return value is None


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ContentPart(_Request):
    """One part of a message's content; only {"type": "text", "text": ...} is served."""

    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str = Field(description="a JSON object, as text")


class MessageToolCall(_Request):
    """A call an earlier assistant message made."""

    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far
    continuous_usage_stats: bool = False


class _GenerationRequest(_Request):
    """Fields chat and completions share. None = not set (the gateway's default applies)."""

    model: str = ""
    max_tokens: int | None = Field(default=None, description="most tokens to generate (tokens)")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, description="-1 or 0 disables top-k (vLLM convention)")
    min_p: float | None = Field(default=None, description="[0, 1]; 0 = off (vLLM's min-p)")
    priority: int = Field(default=0, description="lower is served first (vLLM's convention)")
    seed: int | None = Field(default=None, description="0 .. 2**64-1; choice i > 0 gets a derived seed")
    stop: str | list[str] | None = None
    # vLLM's: token ids that end generation too; the stop string or token kept in the output
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # vLLM's: keep only k of the prompt's tokens (after the chat template); None = all
    truncate_prompt_tokens: int | None = Field(default=None, description="keep k of the prompt's tokens")
    # vLLM's: which k, "left" (cut on the left: the last k; the default) or "right" (the first k)
    truncation_side: str | None = None
    # vLLM's: the generated token ids per choice and the prompt's (RL and agent frameworks)
    return_token_ids: bool | None = None
    # vLLM's: the prompt is cached and found only under this salt (per-tenant cache isolation)
    cache_salt: str | None = None
    # vLLM's: false shows the text of special tokens the model writes (never a terminating EOS)
    skip_special_tokens: bool = True
    # vLLM's: each prompt token's logprob and this many alternatives (0-20; unary only)
    prompt_logprobs: int | None = Field(default=None, description="alternatives per prompt token")
    # vLLM's: logprobs name tokens "token_id:<id>" instead of by their text (RL frameworks)
    return_tokens_as_token_ids: bool = False
    n: int = Field(default=1, description="choices per prompt")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: float | None = Field(default=None, description="[-2, 2]; 0 = off")
    frequency_penalty: float | None = Field(default=None, description="[-2, 2]; 0 = off")
    repetition_penalty: float | None = Field(default=None, description="(0, 2]; 1 = off (vLLM)")
    logit_bias: dict[str, float] | None = Field(default=None, description="token id (a string) -> bias")
    min_tokens: int | None = Field(default=None, description="no EOS / stop token before this many tokens")
    # vLLM's: only these token ids may be generated ([] is refused, as vLLM does)
    allowed_token_ids: list[int] | None = None
    # vLLM's: text never generated (each word as written and after a space)
    bad_words: list[str] | None = None
    # structured outputs: OpenAI's response_format, or vLLM's guided_json / guided_regex / guided_choice
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # GBNF or Lark
    # vLLM's current form (guided_* were removed in vLLM 0.12): exactly one of json, json_object,
    # regex, choice, grammar
    structured_outputs: dict[str, Any] | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    # vLLM's: continue the last (assistant) message instead of starting a new reply
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the reply starts with the last message's text when it has the reply's role
    echo: bool = False
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, description="0-20 alternatives per token; needs logprobs")
    # [{"type": "function", "function": {"name", "description", "parameters": JSON schema}}]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = Field(
        default=None, description='"none", "auto" (default with tools), "required" or a named function'
    )
    parallel_tool_calls: bool | None = None
    # extra variables for the chat template, e.g. {"enable_thinking": false} (Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's, served as vLLM does: the chat template's `reasoning_effort` variable, and its
    # `enable_thinking` (false for "none") unless chat_template_kwargs sets that one
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: tokens generated inside the reasoning at most, then </think> is forced (needs
    # --reasoning-parser); -1 or unset = no limit
    thinking_token_budget: int | None = None


class TokenizeRequest(_Request):
    """vLLM's POST /tokenize: a completions prompt or chat messages (with tools and template
    variables), tokenized as the gateway would run them."""

    model: str = ""
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # only the values generation uses are accepted (the count must be the request's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # prompts: True; chat: False (the template writes them)
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """vLLM's POST /detokenize."""

    model: str = ""
    tokens: list[int]


class LoadLoraAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's replacement of a loaded adapter: refused (unload first)
    model: str = ""  # the base model; "" = the served one (pdserve's, not vLLM's)


class UnloadLoraAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter (its lora_int_id is accepted and unused)."""

    lora_name: str
    lora_int_id: int | None = None
    model: str = ""  # the base model; "" = the served one (pdserve's, not vLLM's)


class CompletionRequest(_GenerationRequest):
    # a string, several strings (one set of choices each), token ids, or several lists of token ids
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, description="0-20 alternatives per token")
    # the prompt's text before the completion; with logprobs, the prompt tokens' logprobs first
    # (the first token's null); with max_tokens 0 only the prompt is scored
    echo: bool = False


# --- responses ---
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # generated tokens of the reasoning, its tags included


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # with --reasoning-parser only (left out otherwise, so other responses stay as they were)
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, exclude_if=lambda details: details is None
    )


class PromptLogprob(BaseModel):
    """vLLM's Logprob of a prompt position's token or alternative (raw model distribution)."""

    logprob: float
    # 1 = most likely: 1 + the tokens with a greater logprob; None only for a prompt token outside
    # the alternatives from a worker older than 1.18 (which sends no rank)
    rank: int | None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token (the first null: nothing precedes it) its token id ->
# entry, the prompt token first, then the alternatives most likely first
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    role: str = "assistant"  # vLLM's: without a generation prompt, the last message's role
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ReasoningMessage(AssistantMessage):
    """The message with --reasoning-parser: the reasoning (the text between the think tags; null
    when the output had none) beside the content."""

    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: SerializeAsAny[AssistantMessage]  # a ReasoningMessage keeps its reasoning_content
    finish_reason: str
    logprobs: ChatLogprobs | None = None
    stop_reason: StopReason = None  # vLLM's, always there
    # vLLM's return_token_ids: the generated ids (as many as the choice's completion tokens)
    token_ids: list[int] | None = Field(default=None, exclude_if=_unless_none)


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's, with prompt_logprobs (left out otherwise)
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)
    # vLLM's return_token_ids: the prompt's ids (every choice's; left out otherwise)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_unless_none)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None
    # vLLM's, with prompt_logprobs or echo + logprobs (left out otherwise)
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)
    stop_reason: StopReason = None  # vLLM's, always there
    # vLLM's return_token_ids: this choice's prompt and generated ids (left out otherwise)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_unless_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_unless_none)


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class _FinishedChunkChoice(BaseModel):
    """A streamed choice whose chunk with finish_reason carries vLLM's stop_reason (null or
    not); other chunks have no stop_reason key (the per-token chunks stay as they were)."""

    @model_serializer(mode="wrap")
    def _stop_reason_when_finished(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if getattr(self, "finish_reason", None) is None:
            data.pop("stop_reason", None)
        return data


class ChatChunkChoice(_FinishedChunkChoice):
    index: int
    # {"role": "assistant", "content": ""} first, then {"content": text}, {"tool_calls": [...]} or {}
    delta: dict[str, Any]
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    stop_reason: StopReason = None  # with finish_reason only
    # vLLM's return_token_ids: the ids generated since the choice's previous chunk
    token_ids: list[int] | None = Field(default=None, exclude_if=_unless_none)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # vLLM's return_token_ids: on each choice's first (role) chunk
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_unless_none)


class CompletionChunkChoice(_FinishedChunkChoice):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    stop_reason: StopReason = None  # with finish_reason only
    # vLLM's return_token_ids: the prompt's ids on the choice's first chunk, and the ids generated
    # since its previous chunk
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_unless_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_unless_none)


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str  # vLLM's: what the model was loaded from (here its id)
    parent: str | None = None  # vLLM's: a LoRA adapter's base model id; None for a base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
