"""Reasoning models through the `openai` client, against a real gateway in front of real workers:
a tiny random model whose chat template branches on `enable_thinking`; a regex constraint makes
even the random model write the think tags (each in several tokens).
chat_template_kwargs and reasoning_effort reach the template; with --reasoning-parser
(deepseek_r1, qwen3) the output is split into reasoning_content and content, streamed == unary,
disaggregated == unified, and
usage counts the reasoning's tokens exactly (checked against the per-token logprobs); the
Responses API gets the reasoning item."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from tests.support.tiny_models import build_tiny_model

from .http_stack import HttpStack, gateway_on, http_stack

pytestmark = pytest.mark.asyncio(loop_scope="module")

# Qwen3's switch: thinking on, the prompt opens <think> (as DeepSeek-R1's template does); off, the
# prompt holds an empty thought, so the model writes no tags
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)
CHAT: Any = [{"role": "user", "content": "What is the capital of France?"}]
MODES = ["disaggregated", "unified"]


def build_thinking_model(folder: Path) -> Path:
    """The tiny byte-level BPE model with the thinking chat template. Its vocabulary has no
    `<think>` tokens: the tags are written in several tokens each, the case where a tag is split
    across tokens and frames (and the token count maps text back to tokens)."""
    from transformers import AutoTokenizer

    build_tiny_model(folder, "bpe")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.chat_template != THINKING_TEMPLATE:
        tokenizer.chat_template = THINKING_TEMPLATE
        tokenizer.save_pretrained(str(folder))
    return folder


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[HttpStack]:
    model = build_thinking_model(tmp_path_factory.mktemp("reasoning") / "tiny-think")
    async with http_stack(model) as served:
        yield served


def client_of(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def split_by_token(tokens: list[str], end: str = "</think>") -> int:
    """How many of the generated tokens (their texts, from logprobs) it takes to write `end`."""
    text = ""
    for k, token in enumerate(tokens):
        text += token
        if end in text:
            return k + 1
    return len(tokens)


async def test_chat_template_kwargs_reach_the_template(stack: HttpStack) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(stack.model))

    def prompt_tokens(**kw: Any) -> int:
        text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, **kw)
        return len(tokenizer.encode(text, add_special_tokens=False))

    client = client_of(stack.gateway.http_url or "")
    try:
        kw: dict[str, Any] = dict(model="", messages=CHAT, max_tokens=1, temperature=0)
        on = await client.chat.completions.create(**kw)
        off = await client.chat.completions.create(
            **kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        assert on.usage is not None and off.usage is not None
        assert on.usage.prompt_tokens == prompt_tokens()
        assert off.usage.prompt_tokens == prompt_tokens(enable_thinking=False) > on.usage.prompt_tokens
        answer = await client.responses.create(
            model="",
            input=CHAT[0]["content"],
            max_output_tokens=1,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        assert answer.usage is not None and answer.usage.input_tokens == off.usage.prompt_tokens
        # reasoning_effort "none" turns thinking off as vLLM does (chat and Responses API)
        effortless = await client.chat.completions.create(**kw, reasoning_effort="none")
        assert effortless.usage is not None and effortless.usage.prompt_tokens == off.usage.prompt_tokens
        effortful = await client.chat.completions.create(**kw, reasoning_effort="high")
        assert effortful.usage is not None and effortful.usage.prompt_tokens == on.usage.prompt_tokens
        answer = await client.responses.create(
            model="", input=CHAT[0]["content"], max_output_tokens=1, reasoning={"effort": "none"}
        )
        assert answer.usage is not None and answer.usage.input_tokens == off.usage.prompt_tokens
        bads: list[Any] = [{"tools": []}, {"add_generation_prompt": False}, "enable_thinking"]
        for bad in bads:  # names pdserve passes itself, and not an object
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": bad})
            assert err.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
    finally:
        await client.close()


async def _both_ways(client: openai.AsyncOpenAI, **kw: Any) -> tuple[Any, str, str, Any, list[str]]:
    """The unary message and usage, the streamed reasoning and content, the streamed usage, and
    the unary response's per-token texts (logprobs: one per counted token)."""
    got = await client.chat.completions.create(logprobs=True, **kw)
    stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    reasoning = content = ""
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert got.choices[0].logprobs is not None and got.choices[0].logprobs.content is not None
    return got, reasoning, content, usage, [t.token for t in got.choices[0].logprobs.content]


@pytest.mark.parametrize(
    ("parser", "regex"),
    [
        ("deepseek_r1", r"[a-z ]{1,12}</think>[a-z ]{1,8}"),  # its template opened <think>
        ("qwen3", r"<think>[a-z ]{1,12}</think>[a-z ]{1,8}"),
    ],
)
async def test_reasoning_is_split_streamed_and_counted(stack: HttpStack, parser: str, regex: str) -> None:
    results = []
    async with gateway_on(stack, reasoning_parser=parser) as gateway:
        client = client_of(gateway.http_url or "")
        try:
            for mode in MODES:
                stack.router.mode = mode
                kw: dict[str, Any] = dict(
                    model="",
                    messages=CHAT,
                    max_tokens=40,
                    temperature=1.0,
                    seed=7,
                    extra_body={"guided_regex": regex},
                )
                got, reasoning, content, usage, tokens = await _both_ways(client, **kw)
                message = got.choices[0].message.model_dump()
                assert got.choices[0].finish_reason == "stop"
                assert re.fullmatch(r"[a-z ]{1,12}", message["reasoning_content"]), message
                assert re.fullmatch(r"[a-z ]{1,8}", message["content"]), message
                assert (reasoning, content) == (
                    message["reasoning_content"],
                    message["content"],
                )  # streamed == unary
                assert got.usage is not None and usage is not None
                assert got.usage.model_dump() == usage.model_dump() | {
                    "prompt_tokens_details": got.usage.prompt_tokens_details.model_dump()
                }
                details = got.usage.completion_tokens_details
                assert details is not None and details.reasoning_tokens == split_by_token(tokens)
                assert 0 < details.reasoning_tokens < got.usage.completion_tokens == len(tokens)
                results.append((message, got.usage.completion_tokens, details.reasoning_tokens))
            # qwen3 with thinking off (no tags written): everything is content
            plain = await client.chat.completions.create(
                model="",
                messages=CHAT,
                max_tokens=20,
                temperature=0,
                extra_body={"guided_regex": "[a-z ]{1,8}"},
            )
            assert plain.usage is not None and plain.usage.completion_tokens_details is not None
            if parser == "qwen3":
                assert plain.choices[0].message.model_dump()["reasoning_content"] is None
                assert (
                    plain.choices[0].message.content
                    and plain.usage.completion_tokens_details.reasoning_tokens == 0
                )
            else:  # deepseek_r1: never closed, all reasoning
                assert plain.choices[0].message.content is None
                assert plain.usage.completion_tokens_details.reasoning_tokens == plain.usage.completion_tokens
        finally:
            await client.close()
    assert results[0] == results[1]  # disaggregated == unified
    await stack.wait_idle()


async def test_the_responses_api_returns_the_reasoning_item(stack: HttpStack) -> None:
    """deepseek_r1 and a random model that never writes </think>: all of it is reasoning."""
    async with gateway_on(stack, reasoning_parser="deepseek_r1") as gateway:
        client = client_of(gateway.http_url or "")
        try:
            kw: dict[str, Any] = dict(model="", input="Hi", max_output_tokens=6, temperature=0)
            answer = await client.responses.create(**kw)
            assert [item.type for item in answer.output] == ["reasoning"]
            item = answer.output[0]
            assert item.type == "reasoning" and item.summary == [] and item.content
            assert answer.output_text == "" and item.content[0].text
            assert answer.usage is not None and answer.status == "incomplete"
            assert answer.usage.output_tokens_details.reasoning_tokens == answer.usage.output_tokens == 6
            events = [e async for e in await client.responses.create(stream=True, **kw)]
            text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
            assert text == item.content[0].text
            final = events[-1]
            assert final.type == "response.incomplete"
            assert final.response.usage is not None
            assert final.response.usage.output_tokens_details.reasoning_tokens == 6
        finally:
            await client.close()
    await stack.wait_idle()


async def test_thinking_token_budget_forces_the_end_of_thinking(stack: HttpStack) -> None:
    """vLLM's thinking_token_budget (deepseek_r1: the template opened <think>): exactly N
    reasoning tokens, then </think> forced token by token (logprob 0), then the answer;
    reasoning_tokens counts them with the tags; streamed == unary, disaggregated == unified; no
    budget (or -1, or one the model never reaches) changes nothing. Without a reasoning parser, or
    with a bad value: 400 naming the field."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(stack.model))
    end_tokens = len(tokenizer.encode("</think>", add_special_tokens=False))
    regex = r"[a-z ]{0,40}</think>[a-z ]{1,8}"  # the close tag may come at any point
    kw: dict[str, Any] = dict(model="", messages=CHAT, max_tokens=40, temperature=1.0, seed=3)
    results = []
    async with gateway_on(stack, reasoning_parser="deepseek_r1") as gateway:
        client = client_of(gateway.http_url or "")
        try:
            for mode in MODES:
                stack.router.mode = mode
                free, *_ = await _both_ways(client, **kw, extra_body={"guided_regex": regex})
                free_tokens = [t.token for t in free.choices[0].logprobs.content]
                assert split_by_token(free_tokens) > 3 + end_tokens  # it would think longer
                for budget in (-1, 1000):  # no limit, and one it never reaches: unchanged
                    same = await client.chat.completions.create(
                        **kw, extra_body={"guided_regex": regex, "thinking_token_budget": budget}
                    )
                    assert same.choices[0].message.model_dump() == free.choices[0].message.model_dump()
                for n in (3, 0):
                    body = {"guided_regex": regex, "thinking_token_budget": n}
                    got, reasoning, content, usage, tokens = await _both_ways(client, **kw, extra_body=body)
                    message = got.choices[0].message.model_dump()
                    assert tokens[:n] == free_tokens[:n]  # N reasoning tokens as drawn freely
                    assert "".join(tokens[n : n + end_tokens]) == "</think>"  # then the forced close
                    forced = got.choices[0].logprobs.content[n : n + end_tokens]
                    assert [lp.logprob for lp in forced] == [0.0] * end_tokens
                    assert (message["reasoning_content"] or "") == "".join(tokens[:n])
                    assert re.fullmatch(r"[a-z ]{1,8}", message["content"])  # the answer follows
                    assert (reasoning, content) == (message["reasoning_content"] or "", message["content"])
                    details = got.usage.completion_tokens_details
                    assert details is not None and details.reasoning_tokens == n + end_tokens
                    assert usage.completion_tokens_details.reasoning_tokens == n + end_tokens
                    results.append((mode, n, message, got.usage.completion_tokens))
            # the Responses API takes it as an extra field
            answer = await client.responses.create(
                model="",
                input="Hi",
                max_output_tokens=12,
                temperature=0,
                extra_body={"thinking_token_budget": 2},
            )
            assert answer.usage is not None
            assert answer.usage.output_tokens_details.reasoning_tokens == 2 + end_tokens
            for bad in (-2, 1.5, "3", True, 1 << 21):
                with pytest.raises(openai.BadRequestError) as err:
                    await client.chat.completions.create(**kw, extra_body={"thinking_token_budget": bad})
                assert err.value.body["param"] == "thinking_token_budget"  # type: ignore[index]
        finally:
            await client.close()
    assert [r[1:] for r in results if r[0] == "unified"] == [r[1:] for r in results if r[0] != "unified"]
    client = client_of(stack.gateway.http_url or "")  # no --reasoning-parser
    try:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(**kw, extra_body={"thinking_token_budget": 3})
        assert err.value.body["param"] == "thinking_token_budget"  # type: ignore[index]
        assert "--reasoning-parser" in err.value.body["message"]  # type: ignore[index]
    finally:
        await client.close()
    await stack.wait_idle()
