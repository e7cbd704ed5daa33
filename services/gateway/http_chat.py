"""Chat-specific conversion of the OpenAI HTTP face: messages (roles, content parts, earlier
tool calls and their results) as the domain's ChatTurns, `tools` / `tool_choice` as the Tools
offered and the parsing of the model's output (`ToolParsing`), and `chat_template_kwargs` as the
template's extra variables. Each problem is a 400 naming its field (`validation.InvalidField`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.gateway import http_models as m
from services.gateway import tool_calls
from services.gateway.inputs import ChatCallTurn, ChatTurn
from services.gateway.tokenization import RESERVED_TEMPLATE_KWARGS
from services.gateway.tool_calls import Format, Tool
from services.gateway.validation import InvalidField
from shared.structured_output import InvalidStructuredOutput, StructuredOutput, grammar_of


@dataclass(frozen=True)
class ToolParsing:
    """How a chat request's outputs are split into content and tool calls."""

    fmt: Format
    forced: bool  # tool_choice required / a named function: the output is one call's JSON body
    tools: tuple[Tool, ...] = ()  # those offered (Qwen3-Coder's values are typed by their schemas)

    def parser(self) -> tool_calls.ToolCallParser:
        return tool_calls.ToolCallParser(self.fmt, self.forced, self.tools)


def message_text(i: int, msg: m.ChatMessage) -> str:
    if msg.content is None:
        if msg.role == "assistant" or msg.tool_calls:
            return ""
        raise InvalidField(f"messages[{i}].content is missing", "messages")
    if isinstance(msg.content, str):
        return msg.content
    texts = []
    for j, part in enumerate(msg.content):
        if part.type != "text" or part.text is None:
            raise InvalidField(
                f"messages[{i}].content[{j}] has type {part.type!r}; pdserve serves text only "
                '({"type": "text", "text": "..."})',
                "messages",
            )
        texts.append(part.text)
    return "\n".join(texts)


def reply_role(req: m.ChatCompletionRequest) -> str:
    """vLLM's role of the reply: assistant after a generation prompt; without one (the reply
    continues the last message, or follows it with no new turn) the last message's role."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def echo(req: m.ChatCompletionRequest, role: str) -> str | None:
    """vLLM's chat `echo`: the reply starts with the last message's text when that message has
    the reply's role (with continue_final_message, the message the model continues); "" when it
    has another role; None without echo."""
    if not req.echo:
        return None
    last = req.messages[-1]
    if last.role != role or last.content is None:
        return ""
    return message_text(len(req.messages) - 1, last)


def tools(req: m.ChatCompletionRequest) -> tuple[Tool, ...]:
    """`tools` as Tools; each problem a 400 naming `tools` (a parameters schema must compile)."""
    tools: list[Tool] = []
    for i, raw in enumerate(req.tools or ()):
        fn = raw.get("function")
        if raw.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidField(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                "tools",
            )
        name, description = fn.get("name"), fn.get("description", "")
        if not isinstance(name, str) or not tool_calls.valid_name(name):
            raise InvalidField(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                "tools",
            )
        if any(t.name == name for t in tools):
            raise InvalidField(f"tools[{i}]: a function named {name!r} is already in tools", "tools")
        if not isinstance(description, str):
            raise InvalidField(f"tools[{i}].function.description must be a string", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidField(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        try:
            grammar_of(StructuredOutput("json_schema", json.dumps(params)))
        except InvalidStructuredOutput as exc:
            raise InvalidField(f"tools[{i}].function.parameters: {exc}", "tools") from None
        tools.append(Tool(name, description, json.dumps(params)))
    return tuple(tools)


def tool_choice(req: m.ChatCompletionRequest, tools: tuple[Tool, ...]) -> tuple[Tool, ...] | str:
    """ "none" / "auto", or the tools one of which must be called (required: all; named: one)."""
    choice = req.tool_choice
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto"):
        return choice
    if choice == "required":
        if not tools:
            raise InvalidField('tool_choice "required" needs tools', "tool_choice")
        return tools
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise InvalidField(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    named = [t for t in tools if t.name == fn.get("name")]
    if not named:
        raise InvalidField(
            f"tool_choice names function {fn.get('name')!r}, which is not in tools "
            f"({', '.join(t.name for t in tools) or 'none given'})",
            "tool_choice",
        )
    return (named[0],)


def template_kwargs(req: m.ChatCompletionRequest) -> tuple[tuple[str, Any], ...]:
    """chat_template_kwargs (an object, checked by the schema) as the template's extra variables,
    with reasoning_effort's; a name pdserve passes itself (the conversation, tools,
    add_generation_prompt, ...) is a 400."""
    given = req.chat_template_kwargs or {}
    taken = sorted(RESERVED_TEMPLATE_KWARGS.intersection(given))
    if taken:
        raise InvalidField(
            f"chat_template_kwargs may not set {', '.join(taken)}: pdserve passes "
            f"{'it' if len(taken) == 1 else 'them'} to the chat template itself",
            "chat_template_kwargs",
        )
    return tuple((given | _effort_kwargs(req.reasoning_effort, given)).items())


def _effort_kwargs(effort: str | None, given: dict[str, Any]) -> dict[str, Any]:
    """reasoning_effort as vLLM passes it: the template's `reasoning_effort` (over one in
    chat_template_kwargs) and, unless the client set `enable_thinking`, thinking off for "none"
    and on otherwise (templates that declare neither ignore both)."""
    if effort is None:
        return {}
    kept: dict[str, Any] = {"reasoning_effort": effort}
    if "enable_thinking" not in given:
        kept["enable_thinking"] = effort != "none"
    return kept


def turn(i: int, msg: m.ChatMessage) -> ChatTurn:
    role = "system" if msg.role == "developer" else msg.role  # OpenAI's newer name for system
    if role == "tool" and not msg.tool_call_id:
        raise InvalidField(f"messages[{i}] has role tool but no tool_call_id", "messages")
    calls = []
    for j, call in enumerate(msg.tool_calls or ()):
        if role != "assistant":
            raise InvalidField(f"messages[{i}] has tool_calls; only assistant messages may", "messages")
        try:
            args = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            args = None
        if call.type != "function" or not isinstance(args, dict):
            raise InvalidField(
                f"messages[{i}].tool_calls[{j}] must be a function call whose arguments are a JSON object",
                "messages",
            )
        calls.append(ChatCallTurn(call.id, call.function.name, call.function.arguments))
    return ChatTurn(role, message_text(i, msg), tuple(calls), msg.tool_call_id or "")
