"""Client libraries people put in front of an OpenAI-compatible server, unchanged, against a real
gateway in front of real workers (tiny model): LangChain's ChatOpenAI (invoke, stream with usage,
tools, structured output, the Responses API path with a stored conversation) and LiteLLM
(completion and streaming, sync and async, chat and text completions). Each answer equals what
the `openai` client gets for the same request (greedy), usage included."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel

from .http_stack import HttpStack, gateway_on, http_stack

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the cost map at import
import langchain_openai
import litellm

pytestmark = pytest.mark.asyncio(loop_scope="module")

QUESTION = "What is the capital of France?"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tiny_model: Path) -> AsyncIterator[HttpStack]:
    async with http_stack(tiny_model) as served:
        yield served


def _direct(stack: HttpStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url, api_key="none", max_retries=0)


async def _reference(stack: HttpStack, **kw: Any) -> Any:
    client = _direct(stack)
    try:
        return await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": QUESTION}], temperature=0.0, **kw
        )
    finally:
        await client.close()


def _chat(base_url: str, **settings: Any) -> Any:
    """LangChain's ChatOpenAI as a user configures it for an OpenAI-compatible server."""
    given: dict[str, Any] = {"model": "tiny", "base_url": base_url, "api_key": "none", "temperature": 0}
    return langchain_openai.ChatOpenAI(**given, **settings)


async def test_langchain_chat_openai_invoke_stream_and_usage(stack: HttpStack) -> None:
    chat = _chat(stack.base_url, max_tokens=8, stream_usage=True)
    reference = await _reference(stack, max_tokens=8)
    said = await chat.ainvoke(QUESTION)
    assert said.content == reference.choices[0].message.content
    assert said.usage_metadata is not None
    assert said.usage_metadata["input_tokens"] == reference.usage.prompt_tokens
    assert said.usage_metadata["output_tokens"] == reference.usage.completion_tokens
    chunks = [c async for c in chat.astream(QUESTION)]
    joined = chunks[0]
    for c in chunks[1:]:
        joined = joined + c
    assert joined.content == said.content
    assert joined.usage_metadata is not None
    assert joined.usage_metadata["output_tokens"] == reference.usage.completion_tokens
    await stack.wait_idle()


class Verdict(BaseModel):
    ok: bool


async def test_langchain_tools_and_structured_output(stack: HttpStack) -> None:
    chat = _chat(stack.base_url, max_tokens=80)

    def get_time(timezone: Literal["UTC", "CET"]) -> str:
        """The time now in a timezone."""
        return "12:00"

    # a named tool is forced by its schema (strict: no other key, so a random model's JSON is
    # short and whole)
    tools = chat.bind_tools([get_time], tool_choice="get_time", strict=True)
    called = await tools.ainvoke("What time is it in Paris?")
    assert [call["name"] for call in called.tool_calls] == ["get_time"]
    assert called.tool_calls[0]["args"]["timezone"] in ("UTC", "CET")
    verdict = await chat.with_structured_output(Verdict, method="json_schema").ainvoke("Is the sky blue?")
    assert isinstance(verdict, Verdict)
    await stack.wait_idle()


async def test_langchain_over_the_responses_api_with_a_stored_conversation(
    stack: HttpStack, tmp_path: Path
) -> None:
    async with gateway_on(stack, response_dir=str(tmp_path)) as gateway:
        base_url = f"{gateway.http_url}/v1"
        chat = _chat(base_url, max_tokens=8, use_responses_api=True, use_previous_response_id=True)
        first = await chat.ainvoke(QUESTION)
        assert first.response_metadata.get("id", "").startswith("resp_")
        assert first.usage_metadata is not None and first.usage_metadata["output_tokens"] > 0
        # the next turn sends only the new message and the previous response's id
        second = await chat.ainvoke([("user", QUESTION), first, ("user", "And of Italy?")])
        assert second.usage_metadata is not None
        assert second.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"]
    await stack.wait_idle()


async def test_litellm_completion_sync_async_and_streamed(stack: HttpStack) -> None:
    reference = await _reference(stack, max_tokens=8)
    common: dict[str, Any] = {
        "model": "hosted_vllm/tiny",
        "api_base": stack.base_url,
        "api_key": "none",
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 8,
    }
    answered = await litellm.acompletion(**common)
    assert answered.choices[0].message.content == reference.choices[0].message.content
    assert answered.usage.prompt_tokens == reference.usage.prompt_tokens
    assert answered.usage.completion_tokens == reference.usage.completion_tokens
    pieces = []
    streamed = await litellm.acompletion(**common, stream=True, stream_options={"include_usage": True})
    async for chunk in streamed:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == reference.choices[0].message.content
    direct = _direct(stack)
    try:
        plain = await direct.completions.create(
            model="tiny", prompt="The sky is", max_tokens=4, temperature=0
        )
    finally:
        await direct.close()
    text = await litellm.atext_completion(
        model="hosted_vllm/tiny",
        api_base=stack.base_url,
        api_key="none",
        prompt="The sky is",
        max_tokens=4,
        temperature=0,
    )
    assert text.choices[0].text == plain.choices[0].text
    assert plain.usage is not None and text.usage.completion_tokens == plain.usage.completion_tokens
    # the sync client too (in a thread: this loop serves the gateway)
    said = await asyncio.to_thread(litellm.completion, **common)
    assert said.choices[0].message.content == reference.choices[0].message.content
    await stack.wait_idle()
