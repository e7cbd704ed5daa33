"""The pythonic and qwen3_coder tool-call formats through the `openai` client against a real
gateway and real workers: a tiny random model with a Qwen3-Coder-style chat template (tools
listed, calls rendered as <tool_call><function=...><parameter=...>, results as <tool_response>),
from which the format is detected, and a second gateway on the same workers started with
--tool-call-parser pythonic. A regex constraint makes even the random model write a known output
(as the reasoning tests do): with tool_choice auto it is read as content and parallel calls (the
Qwen3-Coder values typed by the tools' schemas), the stream's deltas reassemble to the unary
answer, and the next turn, sending the calls and their results back, is accepted by the template.
A forced call (tool_choice named) works in both formats."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from .http_stack import HttpStack, client_of, gateway_on, http_stack, model_with_template, reassembled

pytestmark = pytest.mark.asyncio(loop_scope="module")

QWEN3_CODER_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools>\nTo call a function reply:\n<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% for call in message.tool_calls %}\n<tool_call>\n<function={{ call.function.name }}>\n"
    "{% for name, value in call.function.arguments | items %}<parameter={{ name }}>\n"
    "{{ value if value is string else value | tojson }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"enum": ["UTC", "CET"]}},
                "required": ["tz"],
                "additionalProperties": False,
            },
        },
    },
]
CHAT: Any = [{"role": "user", "content": "Weather in Paris, and the time?"}]
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]
QWEN_OUTPUT = (
    "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
    "<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"
)
PYTHONIC_OUTPUT = '[get_weather(city="Paris", days=3), get_time(tz="UTC")]'


def literal_regex(text: str) -> str:
    """A regex matching exactly `text` (line breaks as \\n, which the grammar's syntax reads)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[HttpStack]:
    folder = model_with_template(
        tmp_path_factory.mktemp("tool-formats") / "tiny-qwen3-coder", QWEN3_CODER_TEMPLATE
    )
    async with http_stack(folder) as served:
        yield served


def calls_of(chunks: list[Any]) -> tuple[str, list[tuple[str, str]], str | None]:
    """A chat stream's content, calls (name, arguments), finish_reason; every call has an id."""
    content, calls, reason = reassembled(chunks)
    assert all(c[0].startswith("call_") for c in calls)
    return content, [(c[1], c[2]) for c in calls], reason


async def known_output(client: openai.AsyncOpenAI, output: str) -> tuple[Any, tuple[Any, ...]]:
    """The unary answer and the reassembled stream of a request whose output is `output`."""
    kw: dict[str, Any] = dict(
        model="",
        messages=CHAT,
        tools=TOOLS,
        max_tokens=400,
        temperature=0,
        extra_body={"guided_regex": literal_regex(output)},
    )
    unary = await client.chat.completions.create(**kw)
    stream = await client.chat.completions.create(**kw, stream=True)
    return unary.choices[0], calls_of([chunk async for chunk in stream])


def summary(choice: Any) -> tuple[str | None, list[tuple[str, dict[str, Any]]], str]:
    calls = choice.message.tool_calls or []
    return (
        choice.message.content,
        [(c.function.name, json.loads(c.function.arguments)) for c in calls],
        choice.finish_reason,
    )


async def test_qwen3_coder_calls_are_read_streamed_and_sent_back(stack: HttpStack) -> None:
    assert stack.gateway.service.tool_call_format == "qwen3_coder"  # detected from the template
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
    choice, streamed = await known_output(client, QWEN_OUTPUT)
    assert summary(choice) == ("Checking.", EXPECTED_CALLS, "tool_calls")  # days typed: 3
    calls = choice.message.tool_calls
    assert streamed == (
        "Checking.",
        [(c.function.name, c.function.arguments) for c in calls],
        "tool_calls",
    )
    history: Any = [
        *CHAT,
        {
            "role": "assistant",
            "content": choice.message.content,
            "tool_calls": [
                {"id": c.id, "type": "function", "function": c.function.model_dump()} for c in calls
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
        {"role": "tool", "tool_call_id": calls[1].id, "content": "12:00"},
        {"role": "user", "content": "Thanks"},
    ]
    answer = await client.chat.completions.create(model="", messages=history, tools=TOOLS, max_tokens=4)
    assert answer.usage is not None and answer.usage.prompt_tokens > 0
    # malformed: the block stays content, as written
    broken = "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</tool_call>"
    choice, streamed = await known_output(client, broken)
    assert summary(choice)[:2] == (broken, []) and streamed[:2] == (broken, [])


async def test_pythonic_calls_are_read_and_streamed(stack: HttpStack) -> None:
    async with gateway_on(stack, tool_call_parser="pythonic") as gateway:
        assert gateway.service.tool_call_format == "pythonic"
        client = client_of(gateway.http_url)
        try:
            choice, streamed = await known_output(client, PYTHONIC_OUTPUT)
            assert summary(choice) == (None, EXPECTED_CALLS, "tool_calls")
            calls = choice.message.tool_calls
            assert streamed == (
                "",
                [(c.function.name, c.function.arguments) for c in calls],
                "tool_calls",
            )
            text = "[1, 2] are numbers"  # not a call list: content
            choice, streamed = await known_output(client, text)
            assert summary(choice) == (text, [], "stop") and streamed == (text, [], "stop")
        finally:
            await client.close()


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic"])
async def test_a_named_tool_choice_forces_the_call(stack: HttpStack, parser: str) -> None:
    async with gateway_on(stack, tool_call_parser=parser) as gateway:
        client = client_of(gateway.http_url)
        try:
            got = await client.chat.completions.create(
                model="",
                messages=CHAT,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_time"}},
                max_tokens=100,
                temperature=0,
            )
            (call,) = got.choices[0].message.tool_calls or []
            assert (
                call.type == "function"
                and call.function.name == "get_time"
                and json.loads(call.function.arguments)["tz"]
                in (
                    "UTC",
                    "CET",
                )
            )
            assert got.choices[0].finish_reason == "tool_calls"
        finally:
            await client.close()
