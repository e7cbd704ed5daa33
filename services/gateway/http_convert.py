"""OpenAI HTTP requests -> the gateway's domain input: one request becomes the same `GenerateInput`s
the gRPC servicer builds (one per choice, `Plan`). Validation, tokenization, accounting and
finish_reason stay in the domain, shared with the gRPC face; only what the OpenAI schema adds (n,
several prompts, unsupported fields, structured-output spellings, field names) is checked here,
with the domain's field error (`validation.InvalidField`). Chat messages and tools: http_chat.py;
responses: http_responses.py / http_stream.py; errors: http_errors.py."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from services.gateway import http_chat, http_prompt_logprobs, thinking_budget, tool_calls
from services.gateway import http_models as m
from services.gateway.http_chat import ToolParsing
from services.gateway.inputs import GenerateInput
from services.gateway.reasoning import Kind as ReasoningKind
from services.gateway.tool_calls import Format
from services.gateway.validation import MAX_LOGPROBS, InvalidField
from shared.structured_output import InvalidStructuredOutput, StructuredOutput, grammar_of
from shared.structured_output import Kind as StructuredKind

MAX_TOP_LOGPROBS = MAX_LOGPROBS  # OpenAI's limit, the gRPC API's logprobs limit too
MAX_CHOICES = 64  # prompts x n of one HTTP request (each choice is one request on the workers)
SEED_RANGE = 2**64  # the gRPC API's seed is a uint64
_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: choice j's seed = seed + j * stride (mod 2**64), distinct per j

# Known OpenAI (and common vendor) fields pdserve does not implement, with the values that mean
# "not used": a request setting any other value gets 400 naming the field, never silent ignoring.
# (tools, tool_choice and parallel_tool_calls are chat fields; on completions they land here.)
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),  # the Responses API's: chat and completions implement it
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),  # completions only: chat serves it
    "web_search_options": (None,),
    # vLLM's extras that change the output and are not served (ignoring them would change it
    # silently): special tokens' text is never spaced apart; no beam search, logits processors
    # or RAG documents
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "logits_processors": (None, []),
    "documents": (None, []),
}


@dataclass(frozen=True)
class Plan:
    """One HTTP request as domain requests: choice i runs `inputs[i]`; choices of the same prompt
    share a group (usage counts a prompt once per group)."""

    inputs: tuple[GenerateInput, ...]
    groups: tuple[int, ...]  # choice index -> prompt index
    stream: bool
    include_usage: bool
    tools: ToolParsing | None = None  # chat with tools: how every choice's output is read
    # chat with --reasoning-parser: how every choice's output is split into reasoning and content
    reasoning: ReasoningKind | None = None
    echo: bool = False  # completions: each choice's text (and logprobs) starts with its prompt
    # vLLM's prompt_logprobs: alternatives the response shows per prompt token (None: no field)
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>"
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk carries usage
    role: str = "assistant"  # chat: the reply's role (vLLM's, http_chat.reply_role)
    chat_echo: str | None = None  # chat's echo: the text every choice's content starts with
    return_token_ids: bool = False  # vLLM's: the prompt's and every choice's ids are shown


# --- requests ---
def unsupported_and_unknown(extra: Mapping[str, Any] | None) -> list[str]:
    """Raises InvalidField for an unsupported field set to a value that matters; returns the names
    of unknown (vendor) fields, which the caller ignores with a debug log."""
    unknown = []
    for name, value in (extra or {}).items():
        defaults = UNSUPPORTED_FIELDS.get(name)
        if defaults is None:
            unknown.append(name)
        elif value not in defaults:
            raise InvalidField(f"{name} is not supported by pdserve; remove it from the request", name)
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
    """response_format (OpenAI), vLLM's structured_outputs or its older guided_json /
    guided_regex / guided_choice / guided_grammar, at most one; each refusal names its field.
    The constraint itself is checked here too (same grammar as the workers'), so a bad schema,
    regex or grammar is a 400 naming the field the client sent."""
    given = [
        name
        for name, value in (
            ("response_format", req.response_format not in (None, {"type": "text"})),
            ("structured_outputs", req.structured_outputs is not None),
            ("guided_json", req.guided_json is not None),
            ("guided_regex", req.guided_regex is not None),
            ("guided_choice", req.guided_choice is not None),
            ("guided_grammar", req.guided_grammar is not None),
        )
        if value
    ]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidField(f"set one of {' and '.join(given)}, not several", given[1])
    name = given[0]
    spec: StructuredOutput
    if name == "response_format":
        spec = _response_format(req.response_format or {})
    elif name == "structured_outputs":
        spec = _structured_outputs(req.structured_outputs or {})
    elif name == "guided_grammar":
        spec = StructuredOutput("grammar", req.guided_grammar or "")
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
        raise InvalidField(f"{name}: {exc}", name) from None
    return spec


# vLLM's StructuredOutputsParams keys this gateway serves -> the constraint's kind
_STRUCTURED_OUTPUTS_KINDS = {
    "json": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
# keys that change nothing when left at these values (vLLM's defaults)
_STRUCTURED_OUTPUTS_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "disable_fallback": (False, True),  # one backend here: nothing to fall back to
    "disable_any_whitespace": (False, True),  # JSON is always written compactly
    "disable_additional_properties": (False,),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}


def _structured_outputs(so: dict[str, Any]) -> StructuredOutput:
    """vLLM's `structured_outputs`: one of json (a schema, as an object or JSON text),
    json_object (true), regex, choice (strings), grammar (GBNF or Lark)."""
    where = "structured_outputs"
    if not isinstance(so, dict):
        raise InvalidField(f"{where} must be an object with one of json, regex, choice, grammar", where)
    for key, value in so.items():
        neutral = _STRUCTURED_OUTPUTS_NEUTRAL.get(key, (None,))
        if key not in _STRUCTURED_OUTPUTS_KINDS and value not in neutral:
            raise InvalidField(
                f"{where}.{key} is not supported by pdserve; use one of "
                f"{', '.join(_STRUCTURED_OUTPUTS_KINDS)}",
                where,
            )
    set_keys = [k for k in _STRUCTURED_OUTPUTS_KINDS if so.get(k) not in (None, False)]
    if len(set_keys) != 1:
        raise InvalidField(
            f"{where} must set exactly one of {', '.join(_STRUCTURED_OUTPUTS_KINDS)}; "
            f"it sets {' and '.join(set_keys) or 'none'}",
            where,
        )
    key = set_keys[0]
    value = so[key]
    if key == "json":
        return StructuredOutput("json_schema", value if isinstance(value, str) else json.dumps(value))
    if key == "json_object":
        return StructuredOutput("json_object")
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidField(f"{where}.choice must be a list of strings", where)
        return StructuredOutput("choice", choices=tuple(value))
    if not isinstance(value, str):
        raise InvalidField(f"{where}.{key} must be a string", where)
    return StructuredOutput(cast(StructuredKind, _STRUCTURED_OUTPUTS_KINDS[key]), value)


def _response_format(rf: dict[str, Any]) -> StructuredOutput:
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise InvalidField(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format"
        )
    body = rf.get("json_schema")
    schema = body.get("schema") if isinstance(body, dict) else None
    if not isinstance(schema, dict):
        raise InvalidField(
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
            raise InvalidField(
                f"logit_bias keys must be token ids (integers as strings), got {key!r}", "logit_bias"
            ) from None
        pairs.append((token_id, value))
    return tuple(pairs)


def _common(req: m._GenerationRequest, max_tokens: int | None) -> dict[str, Any]:
    if not 1 <= req.n <= MAX_CHOICES:
        raise InvalidField(f"n must be between 1 and {MAX_CHOICES}, got {req.n}", "n")
    if req.seed is not None and not 0 <= req.seed < SEED_RANGE:
        raise InvalidField(f"seed must be in [0, 2**64 - 1], got {req.seed}", "seed")
    if req.top_k is not None and req.top_k < -1:
        raise InvalidField(f"top_k must be >= 1, or -1 / 0 to disable it; got {req.top_k}", "top_k")
    if req.stream_options is not None and not req.stream:
        raise InvalidField("stream_options is only allowed with stream: true", "stream_options")
    return dict(
        model=req.model,
        structured=_structured(req),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        min_tokens=req.min_tokens,
        allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
        bad_words=tuple(req.bad_words or ()),
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        # vLLM's -1 (or 0) is "no top-k", set explicitly: the model's default does not apply
        top_k=None if req.top_k is None else max(req.top_k, 0),
        min_p=req.min_p,
        priority=req.priority,
        stop=_stop(req.stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_in_output=req.include_stop_str_in_output,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        truncation_side="left" if req.truncation_side is None else req.truncation_side,  # vLLM's default
        cache_salt=req.cache_salt or "",
        skip_special_tokens=req.skip_special_tokens,
        ignore_eos=req.ignore_eos,
        return_token_ids=bool(req.return_token_ids or req.stop or req.stop_token_ids),  # stop_reason's too
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
        raise InvalidField(
            f"{len(per_prompt)} prompts x n={req.n} is {total} choices; the limit is {MAX_CHOICES}", "n"
        )
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    # vLLM's condition: continuous usage only with include_usage
    continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
    inputs, groups = [], []
    for p, prompt_fields in enumerate(per_prompt):
        for j in range(req.n):
            i = p * req.n + j
            inputs.append(
                GenerateInput(
                    **common,
                    **prompt_fields,
                    seed=_seed(req.seed, j),
                    continuous_usage=continuous_usage,
                    request_id=request_id if total == 1 else f"{request_id}-{i}",
                )
            )
            groups.append(p)
    return Plan(
        tuple(inputs),
        tuple(groups),
        req.stream,
        include_usage,
        tools,
        return_tokens_as_token_ids=req.return_tokens_as_token_ids,
        continuous_usage=continuous_usage,
        return_token_ids=bool(req.return_token_ids),
    )


def chat_plan(
    req: m.ChatCompletionRequest,
    request_id: str,
    tool_format: Format = "hermes",
    reasoning_parser: ReasoningKind | None = None,
) -> Plan:
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise InvalidField(
            "max_tokens and max_completion_tokens differ; set one of them", "max_completion_tokens"
        )
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    common = _common(req, max_tokens)
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidField(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    if top and not req.logprobs:
        raise InvalidField("top_logprobs needs logprobs: true", "top_logprobs")
    common["logprobs"] = (top or 0) if req.logprobs else None
    prompt_logprobs = http_prompt_logprobs.chat(req)
    common["prompt_logprobs"] = prompt_logprobs.to_workers
    if not req.messages:
        raise InvalidField("messages is empty; send at least one message", "messages")
    turns = tuple(http_chat.turn(i, msg) for i, msg in enumerate(req.messages))
    common["chat_template_kwargs"] = http_chat.template_kwargs(req)
    common["continue_final_message"] = _continuation(req.add_generation_prompt, req.continue_final_message)
    common["add_generation_prompt"] = req.add_generation_prompt
    common["thinking_token_budget"] = thinking_budget.check(req.thinking_token_budget)
    tools = http_chat.tools(req)
    choice = http_chat.tool_choice(req, tools)
    parsing = None
    if choice == "auto" and tools:
        if req.parallel_tool_calls is False:
            raise InvalidField(
                'parallel_tool_calls: false is supported with tool_choice "required" or a named '
                "function (one call is forced), not with auto",
                "parallel_tool_calls",
            )
        common["tools"] = tools
        # Mistral's calls open with the special token [TOOL_CALLS]: shown, a call after some
        # content is found too (tool_calls.py); vLLM's Mistral parser asks for them the same way
        common["show_tool_markers"] = tool_format == "mistral"
        parsing = ToolParsing(tool_format, forced=False, tools=tools)
    elif not isinstance(choice, str):
        if common["structured"] is not None:
            raise InvalidField(
                "tool_choice forces a call with its own constraint; drop response_format / guided_*",
                "tool_choice",
            )
        common["tools"] = tools
        common["structured"] = tool_calls.forced_call(choice, tool_format)
        parsing = ToolParsing(tool_format, forced=True, tools=tools)
    plan = _plan(req, [{"messages": turns}], common, request_id, parsing)
    role = http_chat.reply_role(req)
    plan = dataclasses.replace(
        plan, prompt_logprobs=prompt_logprobs.shown, role=role, chat_echo=http_chat.echo(req, role)
    )
    return _with_reasoning(plan, reasoning_parser)


def _continuation(add_generation_prompt: bool, continue_final_message: bool) -> bool:
    """vLLM's pair: a new reply (a generation prompt), the last message continued, or (both off)
    the prompt ending after the conversation. Both on is a 400."""
    if continue_final_message and add_generation_prompt:
        raise InvalidField(
            "continue_final_message continues the last message; it cannot follow a generation "
            "prompt: set add_generation_prompt to false with it",
            "continue_final_message",
        )
    return continue_final_message


def _with_reasoning(plan: Plan, kind: ReasoningKind | None) -> Plan:
    """The plan with its outputs split into reasoning and content, and each choice asking for its
    token ids (reasoning_tokens counts tokens). Not when the output is constrained to JSON
    (response_format, guided_json, a forced tool call): the grammar writes JSON from the first
    token, so there is no reasoning to find, and deepseek_r1 would call all of it reasoning. A
    regex or choice constraint may write the tags, and is parsed."""
    structured = plan.inputs[0].structured
    if kind is None or (structured is not None and structured.kind in ("json_schema", "json_object")):
        return plan
    inputs = tuple(dataclasses.replace(inp, return_token_ids=True) for inp in plan.inputs)
    return dataclasses.replace(plan, inputs=inputs, reasoning=kind)


def completion_plan(req: m.CompletionRequest, request_id: str) -> Plan:
    common = _common(req, req.max_tokens)
    common["logprobs"] = req.logprobs  # range checked by the domain (names "logprobs")
    prompt_logprobs = http_prompt_logprobs.completion(req)
    common["prompt_logprobs"] = prompt_logprobs.to_workers
    prompt = req.prompt
    per_prompt: list[dict[str, Any]]
    if isinstance(prompt, str):
        per_prompt = [{"prompt": prompt}]
    elif not prompt:
        raise InvalidField("prompt is empty; send a string, strings, or token ids", "prompt")
    elif all(isinstance(p, str) for p in prompt):
        per_prompt = [{"prompt": p} for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        per_prompt = [{"prompt_token_ids": tuple(prompt)}]
    else:
        per_prompt = [{"prompt_token_ids": tuple(p)} for p in prompt]  # type: ignore[arg-type]
    for k, fields in enumerate(per_prompt):
        if any(t < 0 for t in fields.get("prompt_token_ids", ())):
            raise InvalidField(f"prompt {k} has a negative token id", "prompt")
    plan = _plan(req, per_prompt, common, request_id)
    return dataclasses.replace(plan, echo=req.echo, prompt_logprobs=prompt_logprobs.shown)


def tokenize_input(req: m.TokenizeRequest) -> GenerateInput:
    """POST /tokenize's prompt or messages as the GenerateInput a completion or chat request with
    them becomes (so the count is that request's prompt_tokens); settings that would tokenize
    otherwise than generation does are refused by name."""
    chat = req.messages is not None
    if chat == (req.prompt is not None):
        raise InvalidField("set exactly one of prompt and messages", "messages" if chat else "prompt")
    # generation adds special tokens to a prompt, and a chat template writes its own
    if req.add_special_tokens is not None and req.add_special_tokens == chat:
        raise InvalidField(
            f"add_special_tokens: {str(req.add_special_tokens).lower()} is not how pdserve tokenizes a "
            f"{'chat' if chat else 'prompt'} for generation; leave it out",
            "add_special_tokens",
        )
    if chat:
        body: dict[str, Any] = {"messages": [msg.model_dump(exclude_none=True) for msg in req.messages or ()]}
        for name in ("tools", "tool_choice", "chat_template_kwargs"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        body["add_generation_prompt"] = req.add_generation_prompt
        body["continue_final_message"] = req.continue_final_message
        plan = chat_plan(m.ChatCompletionRequest.model_validate(body, strict=False), "tokenize")
    else:
        plan = completion_plan(m.CompletionRequest(prompt=req.prompt or ""), "tokenize")
    return dataclasses.replace(plan.inputs[0], model=req.model, structured=None)
