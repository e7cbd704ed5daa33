"""Mistral's tool-call format through the `openai` client against a real gateway and real
workers: a tiny random model with a Mistral-style chat template (tools rendered as
[AVAILABLE_TOOLS], calls as [TOOL_CALLS], results as [TOOL_RESULTS], and, as Mistral's own
templates do, a tool call id of anything but 9 letters and digits refused). The format is
detected from the template; a forced call comes back with such an id, and the next turn, which
sends that call and its result back (and a call of another client with an OpenAI-style id), is
accepted by the template."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from .http_stack import HttpStack, http_stack, model_with_template

pytestmark = pytest.mark.asyncio(loop_scope="module")

MISTRAL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ message['content'] }}[/INST]"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "[TOOL_CALLS] ["
    "{%- for call in message['tool_calls'] %}"
    "{%- if call['id'] | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    '{"name": "{{ call["function"]["name"] }}", "arguments": {{ call["function"]["arguments"] | tojson }},'
    ' "id": "{{ call["id"] }}"}{% if not loop.last %}, {% endif %}'
    "{%- endfor %}]<|im_end|>"
    "{%- elif message['role'] == 'assistant' %}{{ message['content'] }}<|im_end|>"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if message['tool_call_id'] | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    '[TOOL_RESULTS] {"content": {{ message["content"] | tojson }}, '
    '"call_id": "{{ message["tool_call_id"] }}"}'
    "[/TOOL_RESULTS]"
    "{%- endif %}"
    "{%- endfor %}"
)
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
CHAT: Any = [{"role": "user", "content": "Weather in Paris?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[HttpStack]:
    folder = model_with_template(tmp_path_factory.mktemp("mistral") / "tiny-mistral", MISTRAL_TEMPLATE)
    async with http_stack(folder) as served:
        yield served


async def test_a_forced_call_and_the_next_turn_work_with_mistrals_template(stack: HttpStack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
    assert stack.gateway.service.tool_call_format == "mistral"  # detected from [TOOL_CALLS]
    got = await client.chat.completions.create(
        model="", messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0
    )
    (call,) = got.choices[0].message.tool_calls or []
    assert call.type == "function"
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in (
        "Paris",
        "Oslo",
    )
    assert got.choices[0].finish_reason == "tool_calls"
    # the next turn: this call and its result, and an earlier call with another client's id form
    history: Any = [
        *CHAT,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": call.id, "type": "function", "function": call.function.model_dump()},
                {
                    "id": "call_0123456789abcdefghij",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_0123456789abcdefghij", "content": "rain"},
        {"role": "user", "content": "Thanks"},
    ]
    answer = await client.chat.completions.create(model="", messages=history, tools=TOOLS, max_tokens=4)
    assert answer.usage is not None and answer.usage.prompt_tokens > 0
