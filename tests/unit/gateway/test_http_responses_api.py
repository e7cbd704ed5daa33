"""The Responses API's conversion (services/gateway/http_responses_api.py): a Responses request
as the chat completion request that serves it, and a chat stream's chunks as Responses events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.gateway import http_models as m
from services.gateway.http_responses_api import (
    Kept,
    ResponsesRequest,
    as_sse,
    chat_request,
    event_payloads,
    input_items,
    queued_body,
    response_body,
    without_oldest_turn,
)
from services.gateway.validation import InvalidField


def _req(**kw: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **kw})


def test_instructions_input_items_tools_and_format_become_the_chat_request() -> None:
    params = {"type": "object", "properties": {"tz": {"type": "string"}}}
    chat = chat_request(
        _req(
            instructions="Be brief.",
            input=[
                {"role": "developer", "content": "Use UTC."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Time?"}]},
                {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "now", "arguments": '{"tz":"CET"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
                {"type": "reasoning", "summary": []},
                {"role": "assistant", "content": [{"type": "output_text", "text": "It is noon."}]},
            ],
            tools=[{"type": "function", "name": "now", "description": "the time", "parameters": params}],
            tool_choice={"type": "function", "name": "now"},
            text={"format": {"type": "json_schema", "name": "t", "schema": params, "strict": True}},
            max_output_tokens=7,
            temperature=0.5,
            stream=True,
        )
    )
    assert [(msg.role, msg.content) for msg in chat.messages] == [
        ("system", "Be brief."),
        ("developer", "Use UTC."),
        ("user", "Time?"),
        ("assistant", None),
        ("tool", "12:00"),
        ("assistant", "It is noon."),
    ]
    calls = chat.messages[3].tool_calls
    assert calls is not None and [(c.id, c.function.arguments) for c in calls] == [
        ("c1", "{}"),
        ("c2", '{"tz":"CET"}'),
    ]
    assert chat.messages[4].tool_call_id == "c1"
    assert chat.tools == [
        {"type": "function", "function": {"name": "now", "description": "the time", "parameters": params}}
    ]
    assert chat.tool_choice == {"type": "function", "function": {"name": "now"}}
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "t", "schema": params, "strict": True},
    }
    assert (chat.max_completion_tokens, chat.temperature, chat.stream) == (7, 0.5, True)
    assert chat.stream_options is not None and chat.stream_options.include_usage  # the usage event
    turn = chat_request(
        _req(
            input=[
                {"role": "user", "content": "Time?"},
                {"role": "assistant", "content": "Let me look."},
                {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"},
            ]
        )
    )
    assert [(msg.role, msg.content, len(msg.tool_calls or [])) for msg in turn.messages] == [
        ("user", "Time?", 0),
        ("assistant", "Let me look.", 1),
    ]
    extras = chat_request(_req(input="hi", seed=7, ignore_eos=True, stop=["x"], include=["y"]))
    assert (extras.seed, extras.ignore_eos, extras.stop) == (7, True, ["x"])
    assert "include" not in (extras.model_extra or {})  # a Responses field this server ignores
    banned = chat_request(_req(input="hi", allowed_token_ids=[4, 5], bad_words=["x"]))
    assert (banned.allowed_token_ids, banned.bad_words) == ([4, 5], ["x"])
    plain = chat_request(_req(input="hi", text={"format": {"type": "text"}}))
    assert [(msg.role, msg.content) for msg in plain.messages] == [("user", "hi")]
    assert plain.response_format is None and plain.stream_options is None


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
        ({"input": [{"type": "computer_call"}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),  # no call_id
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input"),
        ({"input": "hi", "tools": [{"type": "file_search"}]}, "tools"),
        ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata"),
    ],
)
def test_what_is_not_served_is_refused_naming_the_field(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidField) as err:
        chat_request(_req(**kw))
    assert err.value.param == param


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _chunk(delta: dict[str, Any] | None = None, reason: str | None = None, usage: Any = None) -> str:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": reason}]
    return "data: " + json.dumps({"choices": choices, "usage": usage}) + "\n\n"


def _events(chunks: list[str], **req: Any) -> list[dict[str, Any]]:
    async def source() -> AsyncIterator[str]:
        for c in chunks:
            yield c

    async def collect() -> list[str]:
        return [e async for e in as_sse(event_payloads(_req(input="hi", **req), source(), "r1", 5, "m"))]

    out = []
    for raw in asyncio.run(collect()):
        kind, data = raw.split("\n")[:2]
        payload = json.loads(data[len("data: ") :])
        assert kind == f"event: {payload['type']}"
        out.append(payload)
    return out


def test_a_streamed_chat_completion_becomes_the_responses_events() -> None:
    got = _events(
        [
            _chunk({"role": "assistant", "content": ""}),
            _chunk({"content": "Hel"}) + _chunk({"content": "lo"}),
            _chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": ""},
                        }
                    ]
                }
            ),
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, reason="tool_calls"),
            _chunk(usage=_usage(4, 6, 2)),
            "data: [DONE]\n\n",
        ]
    )
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e["type"] for e in got] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = got[-1]["response"]
    assert final["status"] == "completed" and final["id"] == "resp_r1" and final["model"] == "m"
    message, call = final["output"]
    assert message["content"][0]["text"] == "Hello" and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == (
        "call_1",
        "f",
        '{"a":1}',
        "completed",
    )
    assert final["usage"] == {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
        "output_tokens": 6,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 10,
    }
    assert got[2]["item"]["content"] == [] and got[2]["item"]["status"] == "in_progress"


def test_a_stream_cut_by_the_limit_is_incomplete_and_an_error_ends_it() -> None:
    cut = _events(
        [_chunk({"content": "ab"}, reason="length"), _chunk(usage=_usage(1, 2, 0))], max_output_tokens=2
    )
    assert cut[-1]["type"] == "response.incomplete"
    assert cut[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    failed = _events(
        [_chunk({"content": "a"}), 'data: {"error": {"message": "gone", "code": null, "param": null}}\n\n']
    )
    assert failed[-1]["type"] == "error" and failed[-1]["message"] == "gone"


def test_a_finished_chat_completion_becomes_the_response() -> None:
    chat = m.ChatCompletion(
        id="chatcmpl-r1",
        created=5,
        model="m",
        choices=[
            m.ChatChoice(
                index=0,
                message=m.AssistantMessage(
                    content=None,
                    tool_calls=[
                        m.ResponseToolCall(
                            id="call_9", function=m.ResponseFunctionCall(name="f", arguments="{}")
                        )
                    ],
                ),
                finish_reason="tool_calls",
            )
        ],
        usage=m.Usage(
            prompt_tokens=3,
            completion_tokens=4,
            total_tokens=7,
            prompt_tokens_details=m.PromptTokensDetails(cached_tokens=0),
        ),
    )
    body = response_body(_req(input="hi", tools=[{"type": "function", "name": "f"}]), chat, "r1", 5)
    assert body["status"] == "completed" and body["output"] == [
        {
            "type": "function_call",
            "id": "fc_call_9",
            "call_id": "call_9",
            "name": "f",
            "arguments": "{}",
            "status": "completed",
        }
    ]
    assert body["tools"] == [{"type": "function", "name": "f"}] and body["store"] is False


def test_a_follow_up_continues_the_conversation_and_its_input_items_get_ids() -> None:
    """previous_response_id: the earlier turns (input and output items) come after this
    request's instructions and before its input; the earlier instructions are not carried."""
    first = _req(instructions="Old rules.", input="Time?")
    items = input_items(first, "resp_" + "a" * 32)
    assert items == (
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Time?"}],
            "id": f"msg_{'a' * 32}_0",
        },
    )
    output: list[dict[str, Any]] = [
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Noon"}],
        },
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "now", "arguments": "{}"},
    ]
    follow = _req(
        instructions="Be brief.", input=[{"type": "function_call_output", "call_id": "c1", "output": "12"}]
    )
    chat = chat_request(follow, [*items, *output])
    got = [(msg.role, msg.content) for msg in chat.messages]
    assert got == [("system", "Be brief."), ("user", "Time?"), ("assistant", "Noon"), ("tool", "12")]
    assert chat.messages[2].tool_calls is not None and chat.messages[2].tool_calls[0].id == "c1"
    given = input_items(
        _req(input=[{"role": "assistant", "content": "x", "id": "msg_mine"}]), "resp_" + "b" * 32
    )
    assert given[0]["id"] == "msg_mine" and given[0]["content"] == [{"type": "output_text", "text": "x"}]
    kept = Kept("resp_" + "c" * 32, background=True)
    queued = queued_body(_req(input="hi", previous_response_id="resp_x"), "r", 5, kept)
    assert (queued["id"], queued["status"], queued["store"], queued["background"]) == (
        kept.id,
        "queued",
        True,
        True,
    )
    assert queued["previous_response_id"] == "resp_x" and queued["output"] == []


def test_truncation_drops_the_oldest_turns_whole() -> None:
    def user(text: str) -> dict[str, Any]:
        return {"type": "message", "role": "user", "content": text}

    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c", "output": "1"}
    reply = {"role": "assistant", "content": "ok"}
    context = (user("one"), call, output, reply, user("two"), reply, user("three"))
    once = without_oldest_turn(context)
    assert once == (user("two"), reply, user("three"))  # the call and its output went together
    assert without_oldest_turn(without_oldest_turn(once)) == ()
    assert _req(input="hi", truncation="auto").truncation == "auto"
    with pytest.raises(ValueError):
        _req(input="hi", truncation="middle")
