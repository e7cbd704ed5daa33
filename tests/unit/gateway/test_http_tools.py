"""Tools on chat requests: tools / tool_choice / tool messages become the domain input (a forced
call is a JSON-schema constraint), every bad input is a 400 naming its field, and the prompt
offers the tools through the template or a Hermes preamble."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from services.gateway import http_convert as conv
from services.gateway import http_models as m
from services.gateway.http_chat import ToolParsing
from services.gateway.inputs import ChatCallTurn, ChatTurn
from services.gateway.service import GatewayService
from services.gateway.settings import GatewaySettings
from services.gateway.tokenization import PromptTokenizer
from services.gateway.tool_calls import Tool
from services.gateway.validation import InvalidField

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(fmt: str = "hermes", **kw: Any) -> conv.Plan:
    body = {"messages": [{"role": "user", "content": "hi"}], **kw}
    return conv.chat_plan(m.ChatCompletionRequest.model_validate(body, strict=False), "rid", fmt)  # type: ignore[arg-type]


def test_auto_offers_the_tools_and_parses_freely() -> None:
    plan = chat(tools=[WEATHER, TIME])
    inp = plan.inputs[0]
    assert [t.name for t in inp.tools] == ["get_weather", "get_time"]
    assert json.loads(inp.tools[0].parameters) == PARAMS and inp.tools[0].description == "d"
    assert json.loads(inp.tools[1].parameters) == {"type": "object", "properties": {}}
    assert inp.structured is None
    assert plan.tools == ToolParsing("hermes", forced=False, tools=inp.tools)
    auto = chat(tools=[WEATHER], tool_choice="auto")
    assert auto.tools == ToolParsing("hermes", forced=False, tools=auto.inputs[0].tools)


def test_none_leaves_tools_out() -> None:
    plan = chat(tools=[WEATHER], tool_choice="none")
    assert plan.inputs[0].tools == () and plan.tools is None
    assert chat().tools is None and chat(tool_choice="auto").tools is None  # no tools: nothing to parse


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "pythonic", "qwen3_coder"])
def test_required_and_named_force_a_call_with_a_schema(fmt: str) -> None:
    key = "parameters" if fmt == "llama3_json" else "arguments"
    required = chat(fmt, tools=[WEATHER, TIME], tool_choice="required")
    assert required.tools == ToolParsing(fmt, forced=True, tools=required.inputs[0].tools)  # type: ignore[arg-type]
    spec = required.inputs[0].structured
    assert spec is not None and spec.kind == "json_schema"
    assert [v["properties"]["name"]["const"] for v in json.loads(spec.spec)["anyOf"]] == [
        "get_weather",
        "get_time",
    ]
    named = chat(
        fmt, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    schema = json.loads(named.inputs[0].structured.spec)  # type: ignore[union-attr]
    assert schema["properties"] == {"name": {"const": "get_weather"}, key: PARAMS}
    assert chat(fmt, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).tools is not None


def test_tool_messages_and_assistant_calls_are_accepted() -> None:
    plan = chat(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    )
    turns = plan.inputs[0].messages
    assert turns[1] == ChatTurn("assistant", "", (ChatCallTurn("c1", "get_weather", '{"city": "Oslo"}'),))
    assert turns[2] == ChatTurn("tool", "sunny", (), "c1")


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
        "tools",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    ({"tools": [WEATHER], "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}],
                }
            ]
        },
        "messages",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        },
        "messages",
    ),
]


@pytest.mark.parametrize(("kw", "param"), BAD)
def test_bad_tool_inputs_name_the_field(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidField) as err:
        chat(**kw)
    assert err.value.param == param


def test_tools_on_completions_are_refused() -> None:
    with pytest.raises(InvalidField) as err:
        conv.unsupported_and_unknown({"tools": [WEATHER]})
    assert err.value.param == "tools"


class _Template:
    """Records what apply_chat_template got; renders role: content lines."""

    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template
        self.calls: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kw: Any) -> str:
        self.calls.append((conversation, kw))
        return "\n".join(f"{t['role']}: {t['content']}" for t in conversation)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


HISTORY = (
    ChatTurn("user", "weather?"),
    ChatTurn("assistant", "", (ChatCallTurn("c1", "get_weather", '{"city": "Oslo"}'),)),
    ChatTurn("tool", "sunny", (), "c1"),
)
TOOLS = (Tool("get_weather", "d", json.dumps(PARAMS)),)


def test_a_template_without_tools_gets_the_hermes_preamble() -> None:
    fake = _Template("{{ message['content'] }}")
    text = "".join(map(chr, PromptTokenizer(fake, "m", 100).encode_chat(HISTORY, TOOLS, "hermes")))
    conversation, kw = fake.calls[0]
    assert "tools" not in kw
    assert conversation[0]["role"] == "system" and "<tools>" in conversation[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_a_template_with_tools_renders_them_itself() -> None:
    fake = _Template("{% for tool in tools %}...{{ message.tool_calls }}{% endfor %}")
    PromptTokenizer(fake, "m", 100).encode_chat(HISTORY, TOOLS, "hermes")
    conversation, kw = fake.calls[0]
    assert kw["tools"] == [t.as_openai() for t in TOOLS]
    assert conversation[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Oslo"},
    }
    assert conversation[2]["tool_call_id"] == "c1" and conversation[2]["content"] == "sunny"


def test_the_parser_setting_beats_the_template() -> None:
    async def formats() -> list[str]:
        none: Any = None
        llama = PromptTokenizer(_Template("{{ '<|python_tag|>' }}"), "m", 100)
        detected = GatewayService(GatewaySettings(), none, none, llama)
        configured = GatewayService(GatewaySettings(tool_call_parser="hermes"), none, none, llama)
        loading = GatewayService(GatewaySettings(), none, none)
        return [detected.tool_call_format, configured.tool_call_format, loading.tool_call_format]

    assert asyncio.run(formats()) == ["llama3_json", "hermes", "hermes"]


def test_mistral_asks_the_workers_to_show_its_call_marker() -> None:
    """Mistral's calls open with the special token [TOOL_CALLS]: an auto request asks for special
    tokens to be shown (a hint), so a call after some content is found; other formats, and a
    forced call (its grammar writes the bare body), do not."""
    assert chat("mistral", tools=[WEATHER]).inputs[0].show_tool_markers
    assert not chat("hermes", tools=[WEATHER]).inputs[0].show_tool_markers
    forced = chat("mistral", tools=[WEATHER], tool_choice="required").inputs[0]
    assert not forced.show_tool_markers
