"""OpenAI HTTP JSON <-> the gateway's domain types: one request becomes the same `GenerateInput`s
the gRPC servicer builds (one per choice), and the domain's frames and completions become OpenAI
responses, chunks, usage and error bodies. Validation, tokenization, accounting and finish_reason
stay in the domain; only what the OpenAI schema adds (n, several prompts, content parts, field
names) is checked here."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from services.gateway import http_models as m
from services.gateway import tool_calls
from services.gateway.accounting import Usage
from services.gateway.ports import ModelCard
from services.gateway.request import ChatCallTurn, ChatTurn, GenerateInput, TokenLogprob
from services.gateway.tool_calls import Format, Tool
from shared.cluster import FinishReason
from shared.errors import InvalidArgument
from shared.grpc_errors import GENERIC_INTERNAL_MESSAGE, status_for
from shared.structured_output import InvalidStructuredOutput, StructuredOutput, grammar_of

MAX_TOP_LOGPROBS = 20  # OpenAI's limit (the gRPC API's logprobs has the same)
# JSON has no -inf: a token top-k / top-p ruled out gets this logprob instead (as in vLLM)
LOGPROB_FLOOR = -9999.0
MAX_CHOICES = 64  # prompts x n of one HTTP request (each choice is one request on the workers)
SEED_RANGE = 2**64  # the gRPC API's seed is a uint64
_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: choice j's seed = seed + j * stride (mod 2**64), distinct per j

# Known OpenAI (and common vendor) fields pdserve does not implement, with the values that mean
# "not used": a request setting any other value gets 400 naming the field, never silent ignoring.
# (tools, tool_choice and parallel_tool_calls are chat fields; on completions they land here.)
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (None, 0),
    "echo": (None, False),  # chat only: completions implement it
    "suffix": (None, ""),
    "best_of": (None, 1),
    "min_p": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "guided_grammar": (None,),
}


class InvalidParam(InvalidArgument):
    """INVALID_ARGUMENT that names the request field at fault (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Plan:
    """One HTTP request as domain requests: choice i runs `inputs[i]`; choices of the same prompt
    share a group (usage counts a prompt once per group)."""

    inputs: tuple[GenerateInput, ...]
    groups: tuple[int, ...]  # choice index -> prompt index
    stream: bool
    include_usage: bool
    tools: ToolParsing | None = None  # chat with tools: how every choice's output is read
    echo: bool = False  # completions: each choice's text (and logprobs) starts with its prompt


@dataclass(frozen=True)
class ToolParsing:
    """How a chat request's outputs are split into content and tool calls."""

    fmt: Format
    forced: bool  # tool_choice required / a named function: the output is one call's JSON body

    def parser(self) -> tool_calls.ToolCallParser:
        return tool_calls.ToolCallParser(self.fmt, self.forced)


# --- requests ---
def unsupported_and_unknown(extra: Mapping[str, Any] | None) -> list[str]:
    """Raises InvalidParam for an unsupported field set to a value that matters; returns the names
    of unknown (vendor) fields, which the caller ignores with a debug log."""
    unknown = []
    for name, value in (extra or {}).items():
        defaults = UNSUPPORTED_FIELDS.get(name)
        if defaults is None:
            unknown.append(name)
        elif value not in defaults:
            raise InvalidParam(f"{name} is not supported by pdserve; remove it from the request", name)
    return unknown


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _seed(seed: int | None, choice: int) -> int | None:
    if seed is None:
        return None
    return (seed + choice * _SEED_STRIDE) % SEED_RANGE


def _structured(req: m._GenerationRequest) -> StructuredOutput | None:
    """response_format (OpenAI) or guided_json / guided_regex / guided_choice (vLLM), at most one;
    each refusal names its field. The constraint itself is checked here too (same grammar as the
    workers'), so a bad schema or regex is a 400 naming the field the client sent."""
    given = [
        name
        for name, value in (
            ("response_format", req.response_format not in (None, {"type": "text"})),
            ("guided_json", req.guided_json is not None),
            ("guided_regex", req.guided_regex is not None),
            ("guided_choice", req.guided_choice is not None),
        )
        if value
    ]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidParam(f"set one of {' and '.join(given)}, not several", given[1])
    name = given[0]
    spec: StructuredOutput
    if name == "response_format":
        spec = _response_format(req.response_format or {})
    elif name == "guided_json":
        schema = req.guided_json
        spec = StructuredOutput("json_schema", schema if isinstance(schema, str) else json.dumps(schema))
    elif name == "guided_regex":
        spec = StructuredOutput("regex", req.guided_regex or "")
    else:
        spec = StructuredOutput("choice", choices=tuple(req.guided_choice or ()))
    try:
        grammar_of(spec)
    except InvalidStructuredOutput as exc:
        raise InvalidParam(f"{name}: {exc}", name) from None
    return spec


def _response_format(rf: dict[str, Any]) -> StructuredOutput:
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise InvalidParam(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format"
        )
    body = rf.get("json_schema")
    schema = body.get("schema") if isinstance(body, dict) else None
    if not isinstance(schema, dict):
        raise InvalidParam(
            'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
            "response_format",
        )
    return StructuredOutput("json_schema", json.dumps(schema))


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (JSON keys are strings); ranges are checked by the domain."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidParam(
                f"logit_bias keys must be token ids (integers as strings), got {key!r}", "logit_bias"
            ) from None
        pairs.append((token_id, value))
    return tuple(pairs)


def _common(req: m._GenerationRequest, max_tokens: int | None) -> dict[str, Any]:
    if not 1 <= req.n <= MAX_CHOICES:
        raise InvalidParam(f"n must be between 1 and {MAX_CHOICES}, got {req.n}", "n")
    if req.seed is not None and not 0 <= req.seed < SEED_RANGE:
        raise InvalidParam(f"seed must be in [0, 2**64 - 1], got {req.seed}", "seed")
    if req.top_k is not None and req.top_k < -1:
        raise InvalidParam(f"top_k must be >= 1, or -1 / 0 to disable it; got {req.top_k}", "top_k")
    if req.stream_options is not None and not req.stream:
        raise InvalidParam("stream_options is only allowed with stream: true", "stream_options")
    return dict(
        model=req.model,
        structured=_structured(req),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        min_tokens=req.min_tokens,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k if req.top_k is not None and req.top_k > 0 else None,
        stop=_stop(req.stop),
        ignore_eos=req.ignore_eos,
    )


def _plan(
    req: m._GenerationRequest,
    per_prompt: Sequence[dict[str, Any]],
    common: dict[str, Any],
    request_id: str,
    tools: ToolParsing | None = None,
) -> Plan:
    total = len(per_prompt) * req.n
    if total > MAX_CHOICES:
        raise InvalidParam(
            f"{len(per_prompt)} prompts x n={req.n} is {total} choices; the limit is {MAX_CHOICES}", "n"
        )
    inputs, groups = [], []
    for p, prompt_fields in enumerate(per_prompt):
        for j in range(req.n):
            i = p * req.n + j
            inputs.append(
                GenerateInput(
                    **common,
                    **prompt_fields,
                    seed=_seed(req.seed, j),
                    request_id=request_id if total == 1 else f"{request_id}-{i}",
                )
            )
            groups.append(p)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return Plan(tuple(inputs), tuple(groups), req.stream, include_usage, tools)


def _message_text(i: int, msg: m.ChatMessage) -> str:
    if msg.content is None:
        if msg.role == "assistant" or msg.tool_calls:
            return ""
        raise InvalidParam(f"messages[{i}].content is missing", "messages")
    if isinstance(msg.content, str):
        return msg.content
    texts = []
    for j, part in enumerate(msg.content):
        if part.type != "text" or part.text is None:
            raise InvalidParam(
                f"messages[{i}].content[{j}] has type {part.type!r}; pdserve serves text only "
                '({"type": "text", "text": "..."})',
                "messages",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _tools(req: m.ChatCompletionRequest) -> tuple[Tool, ...]:
    """`tools` as Tools; each problem a 400 naming `tools` (a parameters schema must compile)."""
    tools: list[Tool] = []
    for i, raw in enumerate(req.tools or ()):
        fn = raw.get("function")
        if raw.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidParam(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                "tools",
            )
        name, description = fn.get("name"), fn.get("description", "")
        if not isinstance(name, str) or not tool_calls.valid_name(name):
            raise InvalidParam(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                "tools",
            )
        if any(t.name == name for t in tools):
            raise InvalidParam(f"tools[{i}]: a function named {name!r} is already in tools", "tools")
        if not isinstance(description, str):
            raise InvalidParam(f"tools[{i}].function.description must be a string", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidParam(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        try:
            grammar_of(StructuredOutput("json_schema", json.dumps(params)))
        except InvalidStructuredOutput as exc:
            raise InvalidParam(f"tools[{i}].function.parameters: {exc}", "tools") from None
        tools.append(Tool(name, description, json.dumps(params)))
    return tuple(tools)


def _tool_choice(req: m.ChatCompletionRequest, tools: tuple[Tool, ...]) -> tuple[Tool, ...] | str:
    """ "none" / "auto", or the tools one of which must be called (required: all; named: one)."""
    choice = req.tool_choice
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto"):
        return choice
    if choice == "required":
        if not tools:
            raise InvalidParam('tool_choice "required" needs tools', "tool_choice")
        return tools
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise InvalidParam(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    named = [t for t in tools if t.name == fn.get("name")]
    if not named:
        raise InvalidParam(
            f"tool_choice names function {fn.get('name')!r}, which is not in tools "
            f"({', '.join(t.name for t in tools) or 'none given'})",
            "tool_choice",
        )
    return (named[0],)


def _turn(i: int, msg: m.ChatMessage) -> ChatTurn:
    role = "system" if msg.role == "developer" else msg.role  # OpenAI's newer name for system
    if role == "tool" and not msg.tool_call_id:
        raise InvalidParam(f"messages[{i}] has role tool but no tool_call_id", "messages")
    calls = []
    for j, call in enumerate(msg.tool_calls or ()):
        if role != "assistant":
            raise InvalidParam(f"messages[{i}] has tool_calls; only assistant messages may", "messages")
        try:
            args = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            args = None
        if call.type != "function" or not isinstance(args, dict):
            raise InvalidParam(
                f"messages[{i}].tool_calls[{j}] must be a function call whose arguments are a JSON object",
                "messages",
            )
        calls.append(ChatCallTurn(call.id, call.function.name, call.function.arguments))
    return ChatTurn(role, _message_text(i, msg), tuple(calls), msg.tool_call_id or "")


def chat_plan(req: m.ChatCompletionRequest, request_id: str, tool_format: Format = "hermes") -> Plan:
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise InvalidParam(
            "max_tokens and max_completion_tokens differ; set one of them", "max_completion_tokens"
        )
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    common = _common(req, max_tokens)
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidParam(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    if top and not req.logprobs:
        raise InvalidParam("top_logprobs needs logprobs: true", "top_logprobs")
    common["logprobs"] = (top or 0) if req.logprobs else None
    if not req.messages:
        raise InvalidParam("messages is empty; send at least one message", "messages")
    turns = tuple(_turn(i, msg) for i, msg in enumerate(req.messages))
    tools = _tools(req)
    choice = _tool_choice(req, tools)
    parsing = None
    if choice == "auto" and tools:
        if req.parallel_tool_calls is False:
            raise InvalidParam(
                'parallel_tool_calls: false is supported with tool_choice "required" or a named '
                "function (one call is forced), not with auto",
                "parallel_tool_calls",
            )
        common["tools"] = tools
        parsing = ToolParsing(tool_format, forced=False)
    elif not isinstance(choice, str):
        if common["structured"] is not None:
            raise InvalidParam(
                "tool_choice forces a call with its own constraint; drop response_format / guided_*",
                "tool_choice",
            )
        common["tools"] = tools
        common["structured"] = tool_calls.forced_call(choice, tool_format)
        parsing = ToolParsing(tool_format, forced=True)
    return _plan(req, [{"messages": turns}], common, request_id, parsing)


def completion_plan(req: m.CompletionRequest, request_id: str) -> Plan:
    common = _common(req, req.max_tokens)
    common["logprobs"] = req.logprobs  # range checked by the domain (names "logprobs")
    common["prompt_logprobs"] = _echo_prompt_logprobs(req)
    prompt = req.prompt
    per_prompt: list[dict[str, Any]]
    if isinstance(prompt, str):
        per_prompt = [{"prompt": prompt}]
    elif not prompt:
        raise InvalidParam("prompt is empty; send a string, strings, or token ids", "prompt")
    elif all(isinstance(p, str) for p in prompt):
        per_prompt = [{"prompt": p} for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        per_prompt = [{"prompt_token_ids": tuple(prompt)}]
    else:
        per_prompt = [{"prompt_token_ids": tuple(p)} for p in prompt]  # type: ignore[arg-type]
    for k, fields in enumerate(per_prompt):
        if any(t < 0 for t in fields.get("prompt_token_ids", ())):
            raise InvalidParam(f"prompt {k} has a negative token id", "prompt")
    return dataclasses.replace(_plan(req, per_prompt, common, request_id), echo=req.echo)


def _echo_prompt_logprobs(req: m.CompletionRequest) -> int | None:
    """echo (as in OpenAI and vLLM, also with n > 1 and stream): with logprobs k the prompt's
    tokens get theirs too (k alternatives each); max_tokens 0 only scores the prompt (then the
    domain needs prompt logprobs, 0 alternatives when logprobs is unset). Without echo,
    max_tokens 0 is refused."""
    if not req.echo:
        if req.max_tokens == 0:
            raise InvalidParam(
                "max_tokens 0 is only allowed with echo: true (to score the prompt); "
                "set max_tokens >= 1 or leave it unset",
                "max_tokens",
            )
        return None
    if req.logprobs is not None:
        return req.logprobs
    return 0 if req.max_tokens == 0 else None


def echo_text(inp: GenerateInput, decode: Callable[[tuple[int, ...]], str]) -> str:
    """The echoed prompt: the string the client sent, or its token ids' text."""
    return inp.prompt if inp.prompt else decode(inp.prompt_token_ids)


# --- responses ---
def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def usage(plan: Plan, usages: Sequence[Usage]) -> m.Usage:
    """OpenAI's usage of all choices: each prompt counted once (its choices share it), completion
    tokens summed; cached_tokens of a prompt = the fewest any of its choices found cached."""
    prompt_tokens = cached = completion = 0
    for group in sorted(set(plan.groups)):
        members = [u for g, u in zip(plan.groups, usages, strict=True) if g == group]
        prompt_tokens += members[0].prompt_tokens
        cached += min(u.cached_tokens for u in members)
    completion = sum(u.completion_tokens for u in usages)
    return m.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=m.PromptTokensDetails(cached_tokens=cached),
    )


def _logprob(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf (and NaN) -> the floor


def chat_logprobs(logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str]) -> m.ChatLogprobs:
    """OpenAI chat's logprobs.content: per token its text, UTF-8 bytes, logprob, alternatives."""

    def entry(token_id: int, value: float) -> m.TopLogprob:
        text = token_text(token_id)
        return m.TopLogprob(token=text, logprob=_logprob(value), bytes=list(text.encode()))

    content = []
    for lp in logprobs:
        chosen = entry(lp.token_id, lp.logprob)
        top = [entry(t, v) for t, v in lp.top]
        content.append(
            m.ChatTokenLogprob(
                token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes, top_logprobs=top
            )
        )
    return m.ChatLogprobs(content=content)


def completion_logprobs(
    logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str], text_offset: int = 0
) -> m.CompletionLogprobs:
    """The legacy completions logprobs: parallel lists; text_offset counts characters of the
    token texts from `text_offset` (where the previous chunk's tokens ended)."""
    tokens = [token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    return m.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[_logprob(lp.logprob) for lp in logprobs],
        top_logprobs=[{token_text(t): _logprob(v) for t, v in lp.top} for lp in logprobs],
        text_offset=offsets,
    )


def prompt_completion_logprobs(
    prompt_token_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str]
) -> m.CompletionLogprobs:
    """Echo's part of the legacy completions logprobs: every prompt token, the first with a null
    logprob and null alternatives (nothing precedes it; as OpenAI and vLLM), the others with
    their logprob and alternatives under the raw model distribution. Empty without them."""
    if not prompt_logprobs:
        return m.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    rest = completion_logprobs(prompt_logprobs, token_text, len(token_text(prompt_token_ids[0])))
    assert rest.top_logprobs is not None
    return m.CompletionLogprobs(
        tokens=[token_text(prompt_token_ids[0]), *rest.tokens],
        token_logprobs=[None, *rest.token_logprobs],
        top_logprobs=[None, *rest.top_logprobs],
        text_offset=[0, *rest.text_offset],
    )


def joined_logprobs(first: m.CompletionLogprobs, then: m.CompletionLogprobs) -> m.CompletionLogprobs:
    """Two runs of completions logprobs as one (echo: the prompt's, then the generated ones)."""
    return m.CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=(first.top_logprobs or []) + (then.top_logprobs or []),
        text_offset=first.text_offset + then.text_offset,
    )


def response_tool_calls(calls: Sequence[tool_calls.ToolCall]) -> list[m.ResponseToolCall]:
    return [
        m.ResponseToolCall(id=c.id, function=m.ResponseFunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def chat_finish_reason(reason: str, called: bool) -> str:
    """OpenAI's finish_reason: tool_calls when the model stopped after calling tools."""
    return "tool_calls" if called and reason == FinishReason.STOP.value else reason


def chat_id(request_id: str) -> str:
    return f"chatcmpl-{request_id}"


def completion_id(request_id: str) -> str:
    return f"cmpl-{request_id}"


def model_list(cards: Sequence[ModelCard], created: int) -> m.ModelList:
    return m.ModelList(
        data=[m.ModelCard(id=c.id, created=created, max_model_len=c.max_model_len or None) for c in cards]
    )


# --- errors ---
# gRPC status (what the domain error maps to, shared.grpc_errors) -> HTTP status, OpenAI error type
HTTP_BY_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
RETRY_AFTER_S = 1  # Retry-After on 429 and 503 (s): capacity frees as requests finish


@dataclass(frozen=True)
class HttpError:
    status: int
    body: m.ErrorResponse
    headers: dict[str, str]
    grpc_code: grpc.StatusCode

    @property
    def is_internal(self) -> bool:
        return self.status >= 500 and self.grpc_code not in HTTP_BY_STATUS


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> m.ErrorResponse:
    return m.ErrorResponse(error=m.ErrorDetail(message=message, type=type_, param=param, code=code))


def http_error(exc: BaseException) -> HttpError:
    """The HTTP status, OpenAI error body and headers for an exception (unknown ones: 500 with a
    generic message; the caller logs the details)."""
    code, message = status_for(exc)
    status, type_ = HTTP_BY_STATUS.get(code, (500, "internal_error"))
    if status == 500:
        message = GENERIC_INTERNAL_MESSAGE
    # An error that knows when to come back (admission's Overloaded) says so; whole seconds, >= 1.
    retry_after_s = getattr(exc, "retry_after_s", None) or RETRY_AFTER_S
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if status in (429, 503) else {}
    param = getattr(exc, "param", None)
    if param is None and code == grpc.StatusCode.NOT_FOUND and "model" in message:
        param = "model"
    return HttpError(status, error_body(message, type_, param, code.name.lower()), headers, code)
