"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: a Responses request becomes a
chat completion request (`chat_request`: `instructions` a system message first, `input` items
messages, function tools and `tool_choice` in chat's spelling, `text.format` the response_format,
`max_output_tokens` the completion's limit), so validation, templates, structured output, tool
parsing, accounting and finish reasons are the chat face's; its result becomes a Response object
(`response_body`: with --reasoning-parser a `reasoning` item first, a `message` output item with
the text, one `function_call` item per tool call, the status, usage in the Responses names), and,
streamed, the chat stream's chunks become the Responses events (`events`: response.created ...
reasoning_text and output_text deltas ... response.completed, each with its sequence_number).

Stored responses (`store`, `previous_response_id`, `background`, and the routes that read them)
are http_stored_responses': a follow-up's conversation (`context`, input items) comes before its
own input here. What is not served gets 400 naming the field: input items other than messages,
function calls and their outputs (images, files), and tools other than functions. Chat's sampling
fields that the Responses API lacks (`seed`, `top_k`, `stop`, `ignore_eos`, penalties, ...) may come
as extra fields, as vLLM takes them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import Field, ValidationError

from services.gateway import http_models as m
from services.gateway.http_routes import metadata
from services.gateway.validation import InvalidField


class ResponsesRequest(m._Request):
    """The Responses request fields this server reads; the rest land in model_extra."""

    model: str = ""
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, description="most tokens to generate (tokens)")
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None  # an id, or {"id": ...}
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ..., "summary": ...}; effort is served
    # "message.output_text.logprobs" returns the output tokens' logprobs (others: not served,
    # ignored: they name tools' outputs this server has no tools for)
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, description="0-20 alternatives per output token")
    # "auto": a conversation (previous_response_id) too long for the context loses its oldest
    # turns first (`without_oldest_turn`); "disabled" (OpenAI's default): it is a 400
    truncation: Literal["auto", "disabled"] | None = None


def response_id(request_id: str) -> str:
    return f"resp_{request_id}"


def _message_id(request_id: str) -> str:
    return f"msg_{request_id}"


def _text_of(content: Any, where: str) -> str:
    """An input message's content: a string, or parts of type input_text / output_text / text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidField(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidField(
                f"{where}.content[{k}] has type {kind!r}: only text parts (input_text, output_text) "
                "are served",
                "input",
            )
        texts.append(part["text"])
    return "".join(texts)


def _input(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return req.input


# an input item's id prefix by its type, as OpenAI's input_items list shows them
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(req: ResponsesRequest, response_id: str) -> tuple[dict[str, Any], ...]:
    """The request's input as OpenAI lists it (`GET /v1/responses/{id}/input_items`)."""
    return with_ids(_input(req), response_id.removeprefix("resp_"))


def with_ids(items: Sequence[dict[str, Any]], suffix: str) -> tuple[dict[str, Any], ...]:
    """Items as OpenAI lists them: each with its type and an id (the given one, else one made
    from `suffix`), a message's string content as one text part."""
    out = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        made_id = f"{_ID_PREFIXES.get(kind, 'item')}_{suffix}_{i}"
        shown = {**item, "type": kind, "id": item.get("id") or made_id}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            shown["content"] = [{"type": part, "text": item["content"]}]
        out.append(shown)
    return tuple(out)


def without_oldest_turn(context: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """The conversation without its oldest turn: its items up to the second user message (a
    turn's calls and their outputs go together); none left when it has one turn."""
    users = [i for i, item in enumerate(context) if _is_user_message(item)]
    return tuple(context[users[1] :]) if len(users) > 1 else ()


def _is_user_message(item: dict[str, Any]) -> bool:
    return item.get("type", "message") == "message" and item.get("role") == "user"


def _messages(req: ResponsesRequest, context: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """instructions + the earlier conversation (`context`: a previous response's input and output
    items) + input -> chat messages (an assistant turn's text and function calls in one assistant
    message)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return system + as_chat_messages([*context, *_input(req)], len(context))


def as_chat_messages(
    items: Sequence[dict[str, Any]], given_from: int = 0, name: str = "input"
) -> list[dict[str, Any]]:
    """Responses items as chat messages; items from `given_from` on are the request's own
    (`name`[k] in a refusal), those before it the conversation's."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        k = i - given_from
        where = f"{name}[{k}]" if k >= 0 else f"the conversation's item {i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidField(
                    f"{where}.role must be user, assistant, system or developer, got {role!r}", "input"
                )
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _field(item, "name", where),
                    "arguments": _field(item, "arguments", where),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the turn's text, or calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise InvalidField(f"{where}.output must be a string", "input")
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": output})
        elif kind == "reasoning":
            continue  # a reasoning model's summary of an earlier turn: nothing to condition on here
        else:
            raise InvalidField(
                f"{where} has type {kind!r}: input items are message, function_call and function_call_output",
                "input",
            )
    return out


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidField(f"{where}.{name} must be a non-empty string", "input")
    return value


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' function tools ({"type": "function", "name", "description", "parameters"})
    in chat's spelling ({"type": "function", "function": {...}})."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise InvalidField(
                f"tools[{i}] has type {tool.get('type')!r}: only function tools are served", "tools"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format -> chat's response_format (json_schema's fields sit one level deeper there)."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return dict(fmt)  # json_object, or a type chat's check refuses by name


# chat's sampling fields that a Responses request may carry as extras (the openai SDK's
# extra_body, as vLLM reads them): passed on as they are, checked by chat's own validation
_CHAT_EXTRAS = (
    "seed",
    "top_k",
    "min_p",
    "priority",
    "structured_outputs",
    "cache_salt",
    "skip_special_tokens",
    "stop",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "chat_template_kwargs",
    "thinking_token_budget",
)


def _effort(reasoning: dict[str, Any] | None) -> str | None:
    """reasoning.effort (the chat API's reasoning_effort); the summary is not written (none is)."""
    effort = (reasoning or {}).get("effort")
    if effort is not None and effort not in get_args(m.ReasoningEffort):
        raise InvalidField(
            f"reasoning.effort must be one of {', '.join(get_args(m.ReasoningEffort))}, got {effort!r}",
            "reasoning",
        )
    return effort


def conversation_id(req: ResponsesRequest) -> str | None:
    """The conversation a request names (`conversation`: an id or {"id": ...})."""
    given = req.conversation
    if given is None:
        return None
    value = given.get("id") if isinstance(given, dict) else given
    if not isinstance(value, str) or not value:
        raise InvalidField('conversation must be a conversation id or {"id": ...}', "conversation")
    return value


LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for them


def _logprobs_asked(req: ResponsesRequest) -> bool:
    """Logprobs are returned when `include` asks for them, or alternatives are asked for."""
    return LOGPROBS in (req.include or ()) or bool(req.top_logprobs)


def chat_request(req: ResponsesRequest, context: Sequence[dict[str, Any]] = ()) -> m.ChatCompletionRequest:
    """The chat completion request that serves `req` after the conversation `context` (one
    choice; usage always streamed)."""
    metadata(req.metadata)  # echoed (and stored) as given, within OpenAI's limits
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req, context),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        # a background response is run streamed (its events are logged, http_stored_responses)
        "stream": req.stream or bool(req.background),
        "stream_options": {"include_usage": True} if req.stream or req.background else None,
        "response_format": _response_format(req.text),
        "tools": _tools(req.tools),
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user,
        "reasoning_effort": _effort(req.reasoning),
        "logprobs": True if _logprobs_asked(req) else None,
        "top_logprobs": (req.top_logprobs or 0) if _logprobs_asked(req) else None,
        **{k: v for k, v in (req.model_extra or {}).items() if k in _CHAT_EXTRAS},
    }
    try:
        return m.ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # a shape the request's own types let through
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidField(f"{where}: {first['msg']}", "input") from None


# --- the Response object ---
def _usage(usage: m.Usage | dict[str, Any]) -> dict[str, Any]:
    u = usage.model_dump() if isinstance(usage, m.Usage) else usage
    details = u.get("completion_tokens_details") or {}  # with --reasoning-parser
    return {
        "input_tokens": u["prompt_tokens"],
        # no cache write is billed separately: every prompt block goes to the prefix cache as a
        # side effect of computing it
        "input_tokens_details": {
            "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": u["total_tokens"],
    }


def _message_item(
    request_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The message item; `logprobs`: one entry per output token, as chat's (`token`, `logprob`,
    `bytes`, `top_logprobs`), empty unless asked for."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "type": "message",
        "id": _message_id(request_id),
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def _reasoning_id(request_id: str) -> str:
    return f"rs_{request_id}"


def _reasoning_item(request_id: str, text: str, status: str) -> dict[str, Any]:
    """The reasoning (--reasoning-parser) as OpenAI's reasoning item: the text as one
    `reasoning_text` content part, no summary (none is written)."""
    return {
        "type": "reasoning",
        "id": _reasoning_id(request_id),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call_id}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


@dataclass(frozen=True)
class Kept:
    """How a Response is shown when it is stored: its id (stored ids are the store's), and
    whether it runs in the background."""

    id: str
    background: bool = False


def _response(
    req: ResponsesRequest,
    request_id: str,
    created: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    kept: Kept | None = None,
) -> dict[str, Any]:
    return {
        "id": kept.id if kept else response_id(request_id),
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "text": req.text or {"format": {"type": "text"}},
        "truncation": req.truncation or "disabled",
        "store": kept is not None,
        "background": kept.background if kept else False,
        "previous_response_id": req.previous_response_id,
        "conversation": {"id": conversation_id(req)} if req.conversation is not None else None,
        "metadata": req.metadata or {},
        "user": req.user,
        "usage": usage,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def queued_body(req: ResponsesRequest, request_id: str, created: int, kept: Kept) -> dict[str, Any]:
    """A background Response as its create call answers it: queued, no output yet."""
    return _response(req, request_id, created, req.model, "queued", [], None, kept)


def response_body(
    req: ResponsesRequest,
    chat: m.ChatCompletion,
    request_id: str,
    created: int,
    kept: Kept | None = None,
) -> dict[str, Any]:
    """The Response of a finished chat completion (one choice)."""
    choice = chat.choices[0]
    output = []
    if isinstance(choice.message, m.ReasoningMessage) and choice.message.reasoning_content:
        output.append(_reasoning_item(request_id, choice.message.reasoning_content, "completed"))
    if choice.message.content:
        entries = choice.logprobs.content if choice.logprobs is not None else None
        logprobs = [e.model_dump() for e in entries or ()]
        output.append(_message_item(request_id, choice.message.content, "completed", logprobs))
    for call in choice.message.tool_calls or []:
        output.append(_call_item(call.id, call.function.name, call.function.arguments, "completed"))
    status = _status(choice.finish_reason)
    return _response(req, request_id, created, chat.model, status, output, _usage(chat.usage), kept)


# --- streamed ---
class _TextItem:
    """One streamed output item holding one text part: the reasoning (`reasoning_text`) or the
    message (`output_text`). Added at its first text, a delta event per piece, done at the end;
    `part_extra` goes into its part (output_text's annotations); with `logprobs` its delta and
    done events and its part carry the output tokens' logprobs (each delta its own)."""

    def __init__(
        self,
        items: list[dict[str, Any]],
        event: Callable[..., dict[str, Any]],
        item_id: str,
        part_type: str,
        new_item: Callable[[], dict[str, Any]],
        part_extra: dict[str, Any] | None = None,
        logprobs: bool = False,
    ) -> None:
        self._items, self._event, self._id, self._type = items, event, item_id, part_type
        self._new_item = new_item
        self._part_extra = part_extra or {}
        self._logprobs: list[dict[str, Any]] | None = [] if logprobs else None  # all so far
        self._index: int | None = None  # its output_index, once added

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._id, "output_index": self._index, "content_index": 0}

    def _with_logprobs(self, entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if self._logprobs is None:
            return {}
        self._logprobs.extend(entries)
        return {"logprobs": list(entries)}

    def add(self, text: str, logprobs: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        out = []
        if self._index is None:
            self._index = len(self._items)
            self._items.append(self._new_item())
            opened = {**self._items[self._index], "content": []}
            out.append(self._event("response.output_item.added", output_index=self._index, item=opened))
            part = {"type": self._type, "text": "", **self._part_extra}
            out.append(self._event("response.content_part.added", **self._where(), part=part))
        self._items[self._index]["content"][0]["text"] += text
        extra = self._with_logprobs(logprobs)
        out.append(self._event(f"response.{self._type}.delta", **self._where(), delta=text, **extra))
        return out

    def close(self, logprobs: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """The done events; `logprobs`: entries that came after the last text (tokens without
        text of their own)."""
        if self._index is None:
            return []
        item = self._items[self._index]
        item["status"] = "completed"
        part = item["content"][0]
        self._with_logprobs(logprobs)
        extra = {} if self._logprobs is None else {"logprobs": self._logprobs}
        part.update(extra)
        return [
            self._event(f"response.{self._type}.done", **self._where(), text=part["text"], **extra),
            self._event("response.content_part.done", **self._where(), part=part),
            self._event("response.output_item.done", output_index=self._index, item=item),
        ]


def sse(payload: dict[str, Any]) -> str:
    """One Responses event as server-sent event text (`event:` + `data:`)."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {payload['type']}\ndata: {data}\n\n"


async def as_sse(payloads: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Events (`event_payloads`) as server-sent event text."""
    async for payload in payloads:
        yield sse(payload)


async def event_payloads(
    req: ResponsesRequest,
    chat_events: AsyncIterator[str],
    request_id: str,
    created: int,
    model: str,
    kept: Kept | None = None,
    on_done: Callable[[dict[str, Any]], None] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """The Responses events of a streamed chat completion (its SSE body, one choice, usage last):
    response.created and .in_progress; the reasoning item (--reasoning-parser; opened at its
    first text) with its reasoning_text deltas; the message item (opened at its first text) with
    its output_text deltas; each function call's item with its arguments deltas; the items' .done
    events (at the end: the reasoning's, the message's, the calls'); then response.completed (or
    .incomplete at max_output_tokens), whose Response goes to `on_done` first (the store). An
    error event of the chat stream ends this one with an `error` event."""
    seq = 0

    def event(kind: str, **body: Any) -> dict[str, Any]:
        nonlocal seq
        payload = {"type": kind, "sequence_number": seq, **body}
        seq += 1
        return payload

    shell = _response(req, request_id, created, model, "in_progress", [], None, kept)
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    items: list[dict[str, Any]] = []  # output items in order, each as it will be when done
    calls: dict[int, int] = {}  # chat's tool call index -> output_index
    finish: str | None = None
    usage: dict[str, Any] | None = None
    thought = _TextItem(
        items,
        event,
        _reasoning_id(request_id),
        "reasoning_text",
        lambda: _reasoning_item(request_id, "", "in_progress"),
    )
    message = _TextItem(
        items,
        event,
        _message_id(request_id),
        "output_text",
        lambda: _message_item(request_id, "", "in_progress"),
        part_extra={"annotations": []},
        logprobs=True,
    )
    pending: list[dict[str, Any]] = []  # logprobs of tokens whose text has not come yet

    async for raw in chat_events:
        for line in raw.split("\n"):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                error = chunk["error"]
                yield event(
                    "error", code=error.get("code"), message=error.get("message"), param=error.get("param")
                )
                return
            if chunk.get("usage"):
                usage = _usage(chunk["usage"])
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                finish = choice.get("finish_reason") or finish
                pending.extend((choice.get("logprobs") or {}).get("content") or ())
                if delta.get("reasoning_content"):
                    for piece in thought.add(delta["reasoning_content"]):
                        yield piece
                if delta.get("content"):
                    for piece in message.add(delta["content"], pending):
                        yield piece
                    pending = []
                for call in delta.get("tool_calls") or []:
                    k = call["index"]
                    function = call.get("function", {})
                    if k not in calls:
                        calls[k] = len(items)
                        items.append(_call_item(call["id"], function.get("name", ""), "", "in_progress"))
                        yield event("response.output_item.added", output_index=calls[k], item=dict(items[-1]))
                    if function.get("arguments"):
                        item = items[calls[k]]
                        item["arguments"] += function["arguments"]
                        yield event(
                            "response.function_call_arguments.delta",
                            item_id=item["id"],
                            output_index=calls[k],
                            delta=function["arguments"],
                        )
    for piece in thought.close() + message.close(pending):
        yield piece
    for index in calls.values():
        item = items[index]
        item["status"] = "completed"
        yield event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            arguments=item["arguments"],
        )
        yield event("response.output_item.done", output_index=index, item=item)
    status = _status(finish)
    done = _response(req, request_id, created, model, status, items, usage, kept)
    if on_done is not None:
        on_done(done)
    yield event(f"response.{status}", response=done)
