"""Reasoning models on the OpenAI face: chat_template_kwargs reach the chat template (names pdserve
passes itself are 400s), --reasoning-parser splits chat output into reasoning_content and content
(tool calls read from the content only), streamed deltas reassemble to the unary message, usage
counts reasoning tokens, and the Responses API gets a reasoning item and its events; without the
parser nothing changes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from openai.types.responses import Response, ResponseOutputItem, ResponseReasoningItem, ResponseStreamEvent
from pydantic import TypeAdapter

from services.gateway import http_convert as conv
from services.gateway import http_models as m
from services.gateway.accounting import CacheStats, Usage
from services.gateway.http_responses import completion_body
from services.gateway.http_responses_api import (
    ResponsesRequest,
    as_sse,
    chat_request,
    event_payloads,
    response_body,
)
from services.gateway.http_stream import events
from services.gateway.inputs import ChatTurn
from services.gateway.reasoning import Kind
from services.gateway.request import Completion, OutputFrame, OutputFrameKind
from services.gateway.settings import load_settings
from services.gateway.tokenization import PromptTokenizer
from services.gateway.validation import InvalidField
from shared.cluster import FinishReason

_ITEM: TypeAdapter[Any] = TypeAdapter(ResponseOutputItem)
_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def chat(kind: Kind | None = None, **kw: Any) -> conv.Plan:
    body = {"messages": [{"role": "user", "content": "hi"}], **kw}
    req = m.ChatCompletionRequest.model_validate(body, strict=False)
    return conv.chat_plan(req, "rid", "hermes", kind)


# --- chat_template_kwargs ---
class _Template:
    """Records what apply_chat_template got."""

    chat_template = "{{ messages }}{% if enable_thinking %}<think>{% endif %}"

    def __init__(self) -> None:
        self.kwargs: list[dict[str, Any]] = []

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kw: Any) -> str:
        self.kwargs.append(kw)
        return "x"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_chat_template_kwargs_reach_the_template() -> None:
    plan = chat(chat_template_kwargs={"enable_thinking": False, "custom": [1, {"a": "b"}]})
    assert plan.inputs[0].chat_template_kwargs == (("enable_thinking", False), ("custom", [1, {"a": "b"}]))
    assert chat().inputs[0].chat_template_kwargs == ()
    fake = _Template()
    tok = PromptTokenizer(fake, "m", 100)
    tok.encode_chat((ChatTurn("user", "hi"),), template_kwargs=dict(plan.inputs[0].chat_template_kwargs))
    assert fake.kwargs[0] == {
        "add_generation_prompt": True,
        "continue_final_message": False,
        "tokenize": False,
        "enable_thinking": False,
        "custom": [1, {"a": "b"}],
    }
    # the Responses API passes them on too
    served = chat_request(ResponsesRequest.model_validate({"input": "hi", "chat_template_kwargs": {"x": 1}}))
    assert served.chat_template_kwargs == {"x": 1}


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it() -> None:
    """The template's reasoning_effort, and enable_thinking (off for "none") unless the client's
    chat_template_kwargs set it; the Responses API's reasoning.effort is the same field."""
    assert dict(chat(reasoning_effort="none").inputs[0].chat_template_kwargs) == {
        "reasoning_effort": "none",
        "enable_thinking": False,
    }
    assert dict(chat(reasoning_effort="high").inputs[0].chat_template_kwargs) == {
        "reasoning_effort": "high",
        "enable_thinking": True,
    }
    given = chat(
        reasoning_effort="low", chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "x"}
    )
    assert dict(given.inputs[0].chat_template_kwargs) == {"enable_thinking": False, "reasoning_effort": "low"}
    with pytest.raises(ValueError, match="reasoning_effort"):
        chat(reasoning_effort="extreme")
    served = chat_request(
        ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "minimal"}})
    )
    assert served.reasoning_effort == "minimal"
    with pytest.raises(InvalidField) as err:
        chat_request(ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "extreme"}}))
    assert err.value.param == "reasoning" and "minimal" in str(err.value)
    # completions have no chat template: still a 400 there
    with pytest.raises(InvalidField) as err:
        req = m.CompletionRequest.model_validate({"prompt": "hi", "reasoning_effort": "low"})
        conv.unsupported_and_unknown(req.model_extra)
    assert err.value.param == "reasoning_effort"


@pytest.mark.parametrize("name", ["tools", "add_generation_prompt", "conversation", "messages", "tokenize"])
def test_chat_template_kwargs_may_not_replace_what_pdserve_passes(name: str) -> None:
    with pytest.raises(InvalidField) as err:
        chat(chat_template_kwargs={"enable_thinking": True, name: 1})
    assert err.value.param == "chat_template_kwargs" and name in str(err.value)


def test_the_setting_and_its_env_variable() -> None:
    assert load_settings([], env={}).reasoning_parser == ""
    assert load_settings(["--reasoning-parser", "qwen3"], env={}).reasoning_parser == "qwen3"
    assert (
        load_settings([], env={"PDSERVE_REASONING_PARSER": "deepseek_r1"}).reasoning_parser == "deepseek_r1"
    )
    with pytest.raises(SystemExit):
        load_settings(["--reasoning-parser", "granite"], env={})


# --- the plan ---
def test_the_parser_asks_for_token_ids_except_under_a_json_constraint() -> None:
    plain = chat()
    assert plain.reasoning is None and not plain.inputs[0].return_token_ids
    plan = chat("qwen3", n=2)
    assert plan.reasoning == "qwen3" and all(inp.return_token_ids for inp in plan.inputs)
    assert chat("deepseek_r1", guided_regex="a</think>b").reasoning == "deepseek_r1"
    # JSON from the first token: nothing to split (deepseek_r1 would call it all reasoning)
    assert chat("deepseek_r1", response_format={"type": "json_object"}).reasoning is None
    assert chat("deepseek_r1", tools=[WEATHER], tool_choice="required").reasoning is None
    assert chat("deepseek_r1", tools=[WEATHER]).reasoning == "deepseek_r1"  # auto: parsed after it


# --- responses: a toy tokenizer whose tokens are strings ---
VOCAB = ["<think>", "</think>", "Let", " me", " see", "Paris", ".", "\n", "<tool_call>", "</tool_call>"]
VOCAB += ['{"name": "get_weather", "arguments": {}}']
VOCAB += ["<"]


def _decode(ids: tuple[int, ...]) -> str:
    return "".join(VOCAB[i] for i in ids)


def _usage(completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=5, completion_tokens=completion_tokens, cache=CacheStats())


def _completion(tokens: Sequence[str], reason: FinishReason = FinishReason.STOP) -> Completion:
    ids = tuple(VOCAB.index(t) for t in tokens)
    return Completion("rid", _decode(ids), ids, reason, _usage(len(ids)), "m")


def _frames(tokens: Sequence[str], reason: FinishReason = FinishReason.STOP) -> list[OutputFrame]:
    """One frame per token, the FINAL one with the usage."""
    frames = []
    for k, token in enumerate(tokens):
        last = k == len(tokens) - 1
        frames.append(
            OutputFrame(
                "rid",
                OutputFrameKind.FINAL if last else OutputFrameKind.CONTINUATION,
                token,
                (VOCAB.index(token),),
                5,
                0,
                "m",
                finish_reason=reason if last else None,
                usage=_usage(len(tokens)) if last else None,
            )
        )
    return frames


class _Run:
    """Stands in for ChoiceRun: the frames after the first."""

    def __init__(self, frames: list[OutputFrame]) -> None:
        self._frames = frames

    async def rest(self) -> AsyncIterator[tuple[int, OutputFrame]]:
        for frame in self._frames:
            yield 0, frame


def _stream(plan: conv.Plan, frames: list[OutputFrame]) -> list[dict[str, Any]]:
    async def collect() -> list[str]:
        run: Any = _Run(frames[1:])
        body = events(
            plan,
            run,
            [(0, frames[0])],
            "rid",
            1,
            True,
            lambda t: VOCAB[t],
            None,
            _decode,
            lambda ids, skip: _decode(ids),
        )
        return [event async for event in body]

    raw = "".join(asyncio.run(collect()))
    return [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]


THOUGHT = ["<think>", "Let", " me", " see", "</think>", "\n", "Paris", "."]


@pytest.mark.parametrize(
    ("kind", "tokens", "reasoning", "content", "reasoning_tokens"),
    [
        ("qwen3", THOUGHT, "Let me see", "\nParis.", 5),
        ("deepseek_r1", THOUGHT[1:], "Let me see", "\nParis.", 4),
        ("deepseek_r1", ["Let", " me"], "Let me", None, 2),  # cut short while thinking
        ("qwen3", ["Paris", "."], None, "Paris.", 0),  # enable_thinking: false
    ],
)
def test_unary_and_streamed_messages_and_usage_agree(
    kind: Kind, tokens: list[str], reasoning: str | None, content: str | None, reasoning_tokens: int
) -> None:
    plan = chat(kind, stream=True, stream_options={"include_usage": True})
    body = completion_body(plan, [_completion(tokens)], "rid", 1, True, lambda t: VOCAB[t], None, _decode)
    assert isinstance(body, m.ChatCompletion)
    dumped = body.model_dump()
    assert dumped["choices"][0]["message"] == {
        "role": "assistant",
        "content": content,
        "tool_calls": None,
        "reasoning_content": reasoning,
    }
    assert dumped["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
    chunks = _stream(plan, _frames(tokens))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert all(len(d) == 1 or "role" in d for d in deltas)  # one kind of text per delta
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    assert not any("think>" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
    assert chunks[-1]["usage"] == dumped["usage"]


def test_tool_calls_are_read_from_the_content_only() -> None:
    plan = chat("qwen3", tools=[WEATHER], stream=True, stream_options={"include_usage": True})
    call = '{"name": "get_weather", "arguments": {}}'
    tokens = ["<think>", "<tool_call>", call, "</tool_call>", "</think>", "<tool_call>", call, "</tool_call>"]
    body = completion_body(plan, [_completion(tokens)], "rid", 1, True, lambda t: VOCAB[t], None, _decode)
    assert isinstance(body, m.ChatCompletion)
    choice = body.choices[0]
    message = choice.message
    assert isinstance(message, m.ReasoningMessage)
    assert message.reasoning_content == f"<tool_call>{call}</tool_call>"  # a call it only thought of
    assert message.content is None and message.tool_calls is not None and len(message.tool_calls) == 1
    assert choice.finish_reason == "tool_calls"
    chunks = _stream(plan, _frames(tokens))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message.reasoning_content
    assert [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", []) if "id" in tc] == [
        "get_weather"
    ]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_the_parser_the_tags_are_content_and_usage_has_no_details() -> None:
    plan = chat(stream=True, stream_options={"include_usage": True})
    body = completion_body(plan, [_completion(THOUGHT)], "rid", 1, True, lambda t: VOCAB[t], None, _decode)
    dumped = json.loads(body.model_dump_json())
    assert dumped["choices"][0]["message"] == {
        "role": "assistant",
        "content": "".join(THOUGHT),
        "tool_calls": None,
    }
    assert "completion_tokens_details" not in dumped["usage"]
    chunks = _stream(plan, _frames(THOUGHT))
    assert "completion_tokens_details" not in chunks[-1]["usage"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "".join(
        THOUGHT
    )


# --- the Responses API ---
def test_the_response_has_a_reasoning_item_first_and_reasoning_tokens() -> None:
    plan = chat("qwen3")
    body = completion_body(plan, [_completion(THOUGHT)], "rid", 1, True, lambda t: VOCAB[t], None, _decode)
    assert isinstance(body, m.ChatCompletion)
    req = ResponsesRequest.model_validate({"input": "hi"})
    response = response_body(req, body, "rid", 1)
    # the openai SDK's own types, validated strictly (every field it requires is there)
    parsed = Response.model_validate(response)
    items = [_ITEM.validate_python(item) for item in response["output"]]
    assert [item.type for item in items] == ["reasoning", "message"]
    thought = items[0]
    assert isinstance(thought, ResponseReasoningItem) and thought.summary == [] and thought.content
    assert thought.content[0].text == "Let me see" and thought.content[0].type == "reasoning_text"
    assert parsed.output_text == "\nParis."
    assert parsed.usage is not None and parsed.usage.output_tokens_details.reasoning_tokens == 5


def test_the_streamed_response_has_the_reasoning_events() -> None:
    plan = chat("qwen3", stream=True, stream_options={"include_usage": True})
    chunks = _stream(plan, _frames(THOUGHT))

    async def collect() -> list[str]:
        async def source() -> AsyncIterator[str]:
            for chunk in chunks:
                yield "data: " + json.dumps(chunk) + "\n\n"

        req = ResponsesRequest.model_validate({"input": "hi", "stream": True})
        return [e async for e in as_sse(event_payloads(req, source(), "rid", 1, "m"))]

    got = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(collect())]
    kinds = [e["type"] for e in got]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * kinds.count("response.reasoning_text.delta"),
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * kinds.count("response.output_text.delta"),
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    # every event is the openai SDK's own, validated strictly
    every = [_EVENT.validate_python(e) for e in got]
    assert [e.type for e in every] == kinds
    ours = [e for e in got if e.get("item_id") == "rs_rid" or e.get("item", {}).get("type") == "reasoning"]
    typed = [_EVENT.validate_python(e) for e in ours]
    assert len(typed) == 5 + kinds.count("response.reasoning_text.delta")
    assert isinstance(typed[0].item, ResponseReasoningItem) and typed[0].item.status == "in_progress"
    deltas = "".join(e.delta for e in typed if e.type == "response.reasoning_text.delta")
    assert deltas == "Let me see" == next(e.text for e in typed if e.type == "response.reasoning_text.done")
    final = Response.construct(**got[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == "\nParis." and final.usage is not None
    assert final.usage.output_tokens_details.reasoning_tokens == 5


@pytest.mark.parametrize(
    ("kind", "tokens", "last_delta"),
    [
        ("deepseek_r1", ["Let", "<"], {"reasoning_content": "<"}),  # "<" might have begun </think>
        ("qwen3", ["<think>", "Let", "</think>", "Paris", "<"], {}),  # content: nothing held back
    ],
)
def test_the_last_chunk_carries_the_finish_reason_after_a_held_back_tail(
    kind: Kind, tokens: list[str], last_delta: dict[str, str]
) -> None:
    """A frame with no text (an EOS) ends the choice; text held back as a possible tag start
    comes out with it."""
    plan = chat(kind, stream=True)
    frames = _frames(tokens)
    last = frames[-1]
    frames[-1] = OutputFrame("rid", OutputFrameKind.CONTINUATION, last.text, last.token_ids, 5, 0, "m")
    frames.append(dataclasses.replace(last, text="", token_ids=()))
    chunks = _stream(plan, frames)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") + d.get("content", "") for d in deltas) == "".join(
        t for t in tokens if "think>" not in t
    )
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": last_delta,
        "finish_reason": "stop",
        "logprobs": None,
        "stop_reason": None,  # vLLM's, on the chunk with finish_reason
    }
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)


def test_token_ids_of_held_back_text_ride_on_the_next_chunk() -> None:
    """vLLM's return_token_ids through the reasoning parser: the ids of a frame whose text is
    held back (a tag) come with the next chunk, so the chunks' ids join to every generated id;
    the role chunk carries the prompt's; the last chunk the stop string that ended the choice."""
    plan = chat("qwen3", stream=True, return_token_ids=True, stop=["."])
    frames = _frames(THOUGHT)
    frames[0] = dataclasses.replace(frames[0], prompt_token_ids=(7, 8))
    chunks = _stream(plan, frames)
    assert chunks[0]["prompt_token_ids"] == [7, 8] and "token_ids" not in chunks[0]["choices"][0]
    joined = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    assert joined == [VOCAB.index(t) for t in THOUGHT]
    assert len(chunks) - 1 < len(THOUGHT)  # the tags' frames had no chunk of their own
    assert chunks[-1]["choices"][0]["stop_reason"] == "."
    assert all("stop_reason" not in c["choices"][0] for c in chunks[:-1])
