"""The OpenAI-compatible HTTP API with the official `openai` client (sync and async) and raw HTTP,
against a real gateway in front of real workers (tiny models, byte-level BPE and byte-fallback
tokenizers, disaggregated and unified): responses, streams, usage, n, stop, seeds, cached tokens,
errors, API keys on both faces, and disconnects that free the workers' KV pools."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import grpc
import httpx
import jsonschema
import openai
import pytest
import pytest_asyncio

from shared.proto import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2
from tests.support.prom import sample_total
from tests.support.tiny_models import build_tiny_model

from .http_stack import HttpStack, gateway_on, http_stack, reassembled

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODES = ["disaggregated", "unified"]
CHAT: Any = [{"role": "user", "content": "The quick brown fox 🙂 jumps"}]  # openai.types ... MessageParam
LONG_PROMPT = "Prefill and decode run on different workers; the KV cache moves between them. " * 3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bpe(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[HttpStack]:
    model = build_tiny_model(tmp_path_factory.mktemp("http") / "tiny-bpe", "bpe")
    async with http_stack(model) as stack:
        yield stack


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def byte_fallback(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[HttpStack]:
    model = build_tiny_model(tmp_path_factory.mktemp("http") / "tiny-bf", "byte_fallback")
    async with http_stack(model) as stack:
        yield stack


# clients made here, closed after each test: an unclosed AsyncOpenAI schedules its aclose() on
# whatever event loop runs when it is collected, a later test's, and that loop logs its failure
_clients: list[openai.AsyncOpenAI | openai.OpenAI] = []


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _clients:
        client = _clients.pop()
        if isinstance(client, openai.AsyncOpenAI):
            await client.close()
        else:
            client.close()


_Client = TypeVar("_Client", openai.AsyncOpenAI, openai.OpenAI)


def _track(client: _Client) -> _Client:
    _clients.append(client)
    return client


def aclient(stack: HttpStack, **kw: Any) -> openai.AsyncOpenAI:
    return _track(
        openai.AsyncOpenAI(base_url=stack.base_url, api_key=kw.pop("api_key", "none"), max_retries=0, **kw)
    )


def sclient(stack: HttpStack, **kw: Any) -> openai.OpenAI:
    return _track(
        openai.OpenAI(base_url=stack.base_url, api_key=kw.pop("api_key", "none"), max_retries=0, **kw)
    )


def usage_of(u: Any) -> tuple[int, int, int, int]:
    return u.prompt_tokens, u.completion_tokens, u.total_tokens, u.prompt_tokens_details.cached_tokens


def grpc_usage(u: Any) -> tuple[int, int, int, int]:
    return u.prompt_tokens, u.completion_tokens, u.total_tokens, u.cached_tokens


def chat_pb(messages: list[dict[str, str]], **kw: Any) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(**m) for m in messages], **kw)


def chat_tokenize_pb(messages: list[dict[str, str]]) -> gateway_pb2.TokenizeRequest:
    return gateway_pb2.TokenizeRequest(messages=[gateway_pb2.ChatMessage(**m) for m in messages])


# --- the same request through HTTP and gRPC ---
@pytest.mark.parametrize("tokenizer", ["bpe", "byte_fallback"])
@pytest.mark.parametrize("mode", MODES)
async def test_http_and_grpc_give_identical_text_and_usage(
    bpe: HttpStack, byte_fallback: HttpStack, tokenizer: str, mode: str
) -> None:
    stack = bpe if tokenizer == "bpe" else byte_fallback
    stack.router.mode = mode
    await stack.stub.Complete(chat_pb(CHAT, max_tokens=16, temperature=0))  # warm the prefix cache
    want = await stack.stub.Complete(chat_pb(CHAT, max_tokens=16, temperature=0))
    frames = [f async for f in stack.stub.Generate(chat_pb(CHAT, max_tokens=16, temperature=0))]
    client = aclient(stack)
    got = await client.chat.completions.create(model="", messages=CHAT, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == {1: "stop", 2: "length"}[want.finish_reason]
    assert usage_of(got.usage) == grpc_usage(want.usage)
    assert got.model == want.model == stack.model.name
    # streamed: the deltas are exactly the gRPC frames' texts (no U+FFFD from a split character)
    stream = await client.chat.completions.create(
        model="",
        messages=CHAT,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert deltas == [f.text for f in frames if f.text]
    assert "\ufffd" not in "".join(deltas) or "\ufffd" in want.text
    assert usage_of(chunks[-1].usage) == grpc_usage(frames[-1].usage)
    # completions: same prompt text as the gRPC prompt
    want_c = await stack.stub.Complete(
        gateway_pb2.GenerateRequest(prompt=LONG_PROMPT, max_tokens=8, temperature=0)
    )
    got_c = await client.completions.create(
        model=stack.model.name, prompt=LONG_PROMPT, max_tokens=8, temperature=0
    )
    assert got_c.choices[0].text == want_c.text
    assert usage_of(got_c.usage)[:3] == grpc_usage(want_c.usage)[:3]
    await stack.wait_idle()


# --- response shapes ---
async def test_sync_client_chat_and_completions(bpe: HttpStack) -> None:
    bpe.router.mode = "unified"
    client = sclient(bpe)
    chat = await asyncio.to_thread(
        lambda: client.chat.completions.create(
            model=bpe.model.name, messages=CHAT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
    )
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 5
    comp = await asyncio.to_thread(
        lambda: client.completions.create(
            model="",
            prompt=["Hello world", "The quick brown fox"],
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    )
    assert comp.id.startswith("cmpl-") and comp.object == "text_completion"
    assert [c.index for c in comp.choices] == [0, 1] and all(
        c.finish_reason == "length" for c in comp.choices
    )
    assert comp.usage is not None and comp.usage.completion_tokens == 8
    # token ids as the prompt give the same answer as the text they encode
    ids = bpe.gateway.service._require_tokenizer().encode_prompt("Hello world")
    by_ids = await aclient(bpe).completions.create(
        model="", prompt=list(ids), max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == comp.choices[0].text


async def test_raw_stream_shape_and_request_id(bpe: HttpStack) -> None:
    bpe.router.mode = "disaggregated"
    body = {
        "messages": CHAT,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        httpx.AsyncClient(base_url=bpe.base_url, timeout=60) as http,
        http.stream("POST", "/chat/completions", json=body, headers={"X-Request-Id": "my-id-1"}) as r,
    ):
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"] == "my-id-1"
        lines = [line async for line in r.aiter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["id"] == "chatcmpl-my-id-1" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" in c for c in chunks) and all(c["usage"] is None for c in chunks[:-1])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks[1:-1]]
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    # without include_usage there is no usage key at all
    async with (
        httpx.AsyncClient(base_url=bpe.base_url, timeout=60) as http,
        http.stream("POST", "/completions", json={"prompt": "Hello", "max_tokens": 3, "stream": True}) as r,
    ):
        lines = [line async for line in r.aiter_lines() if line]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_n2_seeds_reproducible_and_stop(bpe: HttpStack) -> None:
    bpe.router.mode = "unified"
    client = aclient(bpe)
    kw: dict[str, Any] = dict(
        model="", messages=CHAT, max_tokens=12, temperature=1.0, seed=1234, extra_body={"ignore_eos": True}
    )
    a = await client.chat.completions.create(n=2, **kw)
    b = await client.chat.completions.create(n=2, **kw)
    single = await client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1]
    assert texts == [c.message.content for c in b.choices]  # same seed: same choices
    assert texts[0] != texts[1]  # each choice has its own derived seed
    assert single.choices[0].message.content == texts[0]  # choice 0 uses the seed itself
    assert a.usage is not None and a.usage.completion_tokens == 24
    assert single.usage is not None and a.usage.prompt_tokens == single.usage.prompt_tokens
    streamed = await client.chat.completions.create(n=2, stream=True, **kw)
    by_choice = {0: "", 1: ""}
    async for c in streamed:
        for ch in c.choices:
            by_choice[ch.index] += ch.delta.content or ""
    assert [by_choice[0], by_choice[1]] == texts
    # stop: cut where a stop string first appears
    greedy = await client.completions.create(
        model="", prompt=LONG_PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    text = greedy.choices[0].text
    stop = text[3:6]
    assert stop.strip(), text
    cut = await client.completions.create(
        model="", prompt=LONG_PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("mode", MODES)
async def test_cached_tokens_on_a_repeated_prefix(bpe: HttpStack, mode: str) -> None:
    bpe.router.mode = mode
    client = aclient(bpe)
    prompt = f"{mode}: {LONG_PROMPT}"  # a prefix no earlier test sent
    first = await client.completions.create(model="", prompt=prompt, max_tokens=2, temperature=0)
    second = await client.completions.create(model="", prompt=prompt + " again", max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= first.usage.prompt_tokens - 4 and cached % 4 == 0 and cached > 0


async def test_models_and_health(bpe: HttpStack) -> None:
    models = await aclient(bpe).models.list()
    assert [mdl.id for mdl in models.data] == [bpe.model.name]
    card = await aclient(bpe).models.retrieve(bpe.model.name)
    assert card == models.data[0]
    await asyncio.sleep(1.1)  # `created` is the model's, not the answer's: a second later, the same
    assert (await aclient(bpe).models.retrieve(bpe.model.name)).created == card.created
    with pytest.raises(openai.NotFoundError) as err:
        await aclient(bpe).models.retrieve("org/other-model")
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "GET /v1/models" in err.value.body["message"]  # type: ignore[index]
    async with httpx.AsyncClient(base_url=bpe.gateway.http_url or "", timeout=10) as http:
        r = await http.get("/health")
        assert r.status_code == 200
        await bpe.gateway.server.set_serving(False)
        try:
            assert (await http.get("/health")).status_code == 503
        finally:
            await bpe.gateway.server.set_serving(True)


# --- tokenize / detokenize (vLLM's paths; gRPC Tokenize / Detokenize) ---
@pytest.mark.parametrize("tokenizer", ["bpe", "byte_fallback"])
async def test_tokenize_counts_what_generation_reports_and_detokenize_inverts_it(
    bpe: HttpStack, byte_fallback: HttpStack, tokenizer: str
) -> None:
    """count is the usage.prompt_tokens of the same prompt / messages (tools and template
    variables included) over HTTP and gRPC alike; detokenize gives the prompt's text back;
    settings that would tokenize otherwise than generation, bad ids and another model are
    refused by name."""
    stack = bpe if tokenizer == "bpe" else byte_fallback
    client = aclient(stack)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    async with httpx.AsyncClient(base_url=stack.gateway.http_url or "", timeout=30) as http:
        r = await http.post("/tokenize", json={"prompt": LONG_PROMPT, "return_token_strs": True})
        assert r.status_code == 200, r.text
        got = r.json()
        done = await client.completions.create(model="", prompt=LONG_PROMPT, max_tokens=1)
        assert done.usage is not None and got["count"] == done.usage.prompt_tokens == len(got["tokens"])
        assert len(got["token_strs"]) == got["count"] and got["max_model_len"] > got["count"]
        r = await http.post("/detokenize", json={"tokens": got["tokens"]})
        assert r.status_code == 200 and r.json()["prompt"] == LONG_PROMPT
        counts = []
        extras: list[dict[str, Any]] = [{}, {"tools": [tool]}]
        for extra in extras:
            r = await http.post("/tokenize", json={"messages": CHAT, **extra})
            chat = await client.chat.completions.create(model="", messages=CHAT, max_tokens=1, **extra)
            assert chat.usage is not None and r.json()["count"] == chat.usage.prompt_tokens, extra
            assert r.json()["token_strs"] is None
            counts.append(r.json()["count"])
        assert counts[1] > counts[0]  # the tools offered are part of the prompt
        grpc_got = await stack.stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=LONG_PROMPT))
        assert list(grpc_got.token_ids) == got["tokens"] and grpc_got.count == got["count"]
        assert grpc_got.model == stack.model.name and not grpc_got.token_strs
        grpc_chat = await stack.stub.Tokenize(
            gateway_pb2.TokenizeRequest(messages=[gateway_pb2.ChatMessage(**m) for m in CHAT])
        )
        assert grpc_chat.count == counts[0]
        text = await stack.stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=got["tokens"]))
        assert text.text == LONG_PROMPT
        for path, body, param in (
            ("/tokenize", {"prompt": "a", "messages": CHAT}, "messages"),
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
            ("/detokenize", {"tokens": [1, 10**7]}, "tokens"),
            ("/detokenize", {"tokens": [-1]}, "tokens"),
        ):
            r = await http.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = await http.post("/tokenize", json={"model": "other", "prompt": "a"})
        assert r.status_code == 404
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=[10**7]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[0]" in (
        err.value.details() or ""
    )


async def _prompt_counts(
    stack: HttpStack, messages: Any, http_flags: dict[str, Any], **grpc_flags: bool
) -> tuple[list[int], list[int]]:
    """A conversation's prompt length with these flags as HTTP chat, gRPC Complete, gRPC Tokenize
    and HTTP /tokenize count it, and /tokenize's token ids."""
    chat = await aclient(stack).chat.completions.create(
        model="", messages=messages, max_tokens=1, extra_body=http_flags
    )
    assert chat.usage is not None
    done = await stack.stub.Complete(chat_pb(messages, max_tokens=1, **grpc_flags))
    turns = [gateway_pb2.ChatMessage(**m) for m in messages]
    tokenize = gateway_pb2.TokenizeRequest(messages=turns)
    for name, value in grpc_flags.items():  # the fields GenerateRequest and TokenizeRequest share
        setattr(tokenize, name, value)
    counted = await stack.stub.Tokenize(tokenize)
    async with httpx.AsyncClient(base_url=stack.gateway.http_url or "", timeout=30) as http:
        r = await http.post("/tokenize", json={"messages": messages, **http_flags})
        assert r.status_code == 200, r.text
    counts = [chat.usage.prompt_tokens, done.usage.prompt_tokens, counted.count, r.json()["count"]]
    return counts, r.json()["tokens"]


async def test_continue_final_message_prefills_the_reply_and_counts_it(bpe: HttpStack) -> None:
    """An assistant message at the end, continued (vLLM's continue_final_message with
    add_generation_prompt false): the prompt ends inside it (the template's rendering cut after
    its text, as transformers does), usage.prompt_tokens is that prompt's length over HTTP and
    gRPC, and Tokenize with the same flag agrees; the wrong combinations are 400s naming the
    field."""
    client = aclient(bpe)
    prefix = "The capital of France is"
    convo: Any = [*CHAT, {"role": "assistant", "content": prefix}]
    tok = bpe.gateway.service._require_tokenizer()._tok
    text = tok.apply_chat_template(convo, continue_final_message=True, tokenize=False)
    assert text.endswith(prefix)
    want = len(tok.encode(text, add_special_tokens=False))
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    counts, tokens = await _prompt_counts(bpe, convo, flags, continue_final_message=True)
    assert counts == [want] * 4
    async with httpx.AsyncClient(base_url=bpe.gateway.http_url or "", timeout=30) as http:
        detok = await http.post("/detokenize", json={"tokens": tokens})
        assert detok.json()["prompt"].endswith(prefix)  # no end of turn, no generation prompt
    plain = await client.chat.completions.create(model="", messages=convo, max_tokens=1)
    assert plain.usage is not None and plain.usage.prompt_tokens > want  # closed turn + new reply
    # add_generation_prompt false alone: the prompt ends after the conversation's last turn
    closed = len(tok.encode(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False))
    counts, _ = await _prompt_counts(bpe, CHAT, {"add_generation_prompt": False}, add_generation_prompt=False)
    assert counts == [closed] * 4
    generated = await client.chat.completions.create(model="", messages=CHAT, max_tokens=1)
    assert generated.usage is not None and generated.usage.prompt_tokens > closed  # the reply's opening
    with pytest.raises(openai.BadRequestError) as err:  # both: a generation prompt, then continued?
        await client.chat.completions.create(
            model="", messages=convo, max_tokens=1, extra_body={"continue_final_message": True}
        )
    assert err.value.body["param"] == "continue_final_message"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:  # the last message is the user's
        await client.chat.completions.create(model="", messages=CHAT, max_tokens=1, extra_body=flags)
    assert err.value.body["param"] == "continue_final_message"  # type: ignore[index]


async def test_vllms_stop_token_ids_stop_strings_kept_and_truncated_prompts(bpe: HttpStack) -> None:
    """vLLM's extras a client expects to change the output, served as the gRPC fields do:
    stop_token_ids end the choice at that token (counted), include_stop_str_in_output keeps
    the stop string, truncate_prompt_tokens keeps the prompt's last k tokens; the extras that
    are not served are 400s naming them, never ignored."""
    client = aclient(bpe)
    base: dict[str, Any] = dict(model="", prompt=LONG_PROMPT, max_tokens=8, temperature=0)
    plain = await client.completions.create(**base, extra_body={"ignore_eos": True})
    done = await bpe.stub.Complete(
        gateway_pb2.GenerateRequest(
            prompt=LONG_PROMPT, max_tokens=8, temperature=0, ignore_eos=True, return_token_ids=True
        )
    )
    ids = list(done.token_ids)
    assert done.text == plain.choices[0].text
    third = ids[2]
    stopped = await client.completions.create(
        **base, extra_body={"ignore_eos": True, "stop_token_ids": [third]}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == ids.index(third) + 1
    word = plain.choices[0].text[2:5]
    cut = await client.completions.create(**base, stop=[word], extra_body={"ignore_eos": True})
    kept = await client.completions.create(
        **base, stop=[word], extra_body={"ignore_eos": True, "include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == cut.choices[0].text + word
    short = await client.completions.create(**base, extra_body={"truncate_prompt_tokens": 5})
    assert short.usage is not None and short.usage.prompt_tokens == 5
    chat = await client.chat.completions.create(
        model="", messages=CHAT, max_tokens=2, extra_body={"truncate_prompt_tokens": 3}
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 3
    for field, value in (
        ("spaces_between_special_tokens", False),
        ("use_beam_search", True),
        ("stop_token_ids", [-1]),
        ("truncate_prompt_tokens", 0),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(**base, extra_body={field: value})
        assert err.value.body["param"] == field, field  # type: ignore[index]
    await client.completions.create(**base, extra_body={"skip_special_tokens": True})  # the default


async def test_skip_special_tokens_false_shows_special_tokens_text(bpe: HttpStack) -> None:
    """vLLM's skip_special_tokens: a special token the model writes (forced here by logit_bias)
    has its text in the output only with false; streamed the same; usage counts it either way;
    a terminating EOS never shows."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bpe.model))
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert isinstance(start, int)
    client = aclient(bpe)
    base: dict[str, Any] = dict(model="", prompt=LONG_PROMPT, max_tokens=3, temperature=0)
    bias = {"logit_bias": {str(start): 100}, "ignore_eos": True}
    hidden = await client.completions.create(**base, extra_body=bias)
    shown = await client.completions.create(**base, extra_body={**bias, "skip_special_tokens": False})
    assert hidden.choices[0].text == ""
    assert shown.choices[0].text == "<|im_start|>" * 3
    assert shown.usage is not None and hidden.usage is not None
    assert shown.usage.completion_tokens == hidden.usage.completion_tokens == 3
    stream = await client.completions.create(
        **base, stream=True, extra_body={**bias, "skip_special_tokens": False}
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == "<|im_start|>" * 3
    eos = tok.convert_tokens_to_ids("<|im_end|>")  # the model's EOS: ends the choice, no text
    ended = await client.completions.create(
        **base, extra_body={"logit_bias": {str(eos): 100}, "skip_special_tokens": False}
    )
    assert ended.choices[0].text == "" and ended.choices[0].finish_reason == "stop"
    chat = await client.chat.completions.create(
        model="",
        messages=CHAT,
        max_tokens=2,
        temperature=0,
        extra_body={**bias, "skip_special_tokens": False},
    )
    assert chat.choices[0].message.content == "<|im_start|>" * 2
    done = await bpe.stub.Complete(  # gRPC's field
        gateway_pb2.GenerateRequest(
            prompt=LONG_PROMPT,
            max_tokens=3,
            temperature=0,
            ignore_eos=True,
            logit_bias={start: 100},
            skip_special_tokens=False,
        )
    )
    assert done.text == "<|im_start|>" * 3


async def test_allowed_token_ids_and_bad_words(bpe: HttpStack) -> None:
    """vLLM's allowed_token_ids and bad_words through the openai client (extra_body) and gRPC:
    every token is one of the allowed ids; a bad word taken from the unconstrained output (its
    token sequences, as the gateway makes them, occur there) never occurs; the same tokens
    disaggregated and unified, HTTP and gRPC, chat too; bad input is a 400 / INVALID_ARGUMENT
    naming the field."""
    from transformers import AutoTokenizer

    from services.gateway.tokenization import PromptTokenizer

    tok = PromptTokenizer(AutoTokenizer.from_pretrained(str(bpe.model)), "m", 0)
    client = aclient(bpe)
    base: dict[str, Any] = dict(prompt=LONG_PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    free = list(
        (await bpe.stub.Complete(gateway_pb2.GenerateRequest(**base, return_token_ids=True))).token_ids
    )

    def occurs(seq: tuple[int, ...], ids: list[int]) -> bool:
        return any(tuple(ids[i : i + len(seq)]) == seq for i in range(len(ids) - len(seq) + 1))

    # a word of the output whose token sequences (as is or after a space) the output contains
    words = [w for w in tok.decode(tuple(free)).split() if w.isalpha()]
    word = next(w for w in words if any(occurs(s, free) for s in tok.bad_word_sequences([w])))
    allowed = sorted({free[3], free[7], 40, 41, 300})
    runs = {}
    for mode in MODES:
        bpe.router.mode = mode
        for name, extra in (("allowed", {"allowed_token_ids": allowed}), ("bad", {"bad_words": [word]})):
            done = await bpe.stub.Complete(
                gateway_pb2.GenerateRequest(**base, return_token_ids=True, **extra)
            )
            got = await client.completions.create(
                model="",
                prompt=LONG_PROMPT,
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True, **extra},
            )
            assert got.choices[0].text == done.text and len(done.token_ids) == 12
            runs[mode, name] = list(done.token_ids)
    for mode in MODES:
        assert set(runs[mode, "allowed"]) <= set(allowed) and runs[mode, "allowed"] != free
        assert not any(occurs(s, runs[mode, "bad"]) for s in tok.bad_word_sequences([word])), word
    assert runs["disaggregated", "allowed"] == runs["unified", "allowed"]
    assert runs["disaggregated", "bad"] == runs["unified", "bad"]
    chat = await client.chat.completions.create(
        model="", messages=CHAT, max_tokens=4, temperature=0, extra_body={"allowed_token_ids": [40]}
    )
    assert chat.choices[0].message.content == tok.decode((40,) * 4)
    for field, value, message in (
        ("allowed_token_ids", [], "is empty"),
        ("allowed_token_ids", [1, 10**6], "not a token of the served model"),
        ("bad_words", [""], "is empty"),
        ("bad_words", ["x"] * 129, "limit is 128"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(model="", prompt="x", max_tokens=2, extra_body={field: value})
        assert err.value.body["param"] == field and message in err.value.body["message"]  # type: ignore[index]
    for bad in (
        gateway_pb2.GenerateRequest(prompt="x", allowed_token_ids=[10**6]),
        gateway_pb2.GenerateRequest(prompt="x", bad_words=[" "]),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as rpc_err:
            await bpe.stub.Complete(bad)
        assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("mode", MODES)
async def test_cache_salt_keeps_tenants_prefix_caches_apart(bpe: HttpStack, mode: str) -> None:
    """vLLM's cache_salt through the openai client: the same prompt is a cache hit again under
    its salt (in the usage's cached_tokens), never under another salt or none; the text is the
    same whatever the salt; a salt over 256 characters is a 400 naming it."""
    bpe.router.mode = mode
    client = aclient(bpe)
    prompt = f"salted, {mode}: {LONG_PROMPT}"  # a prompt no other test sends
    kw: dict[str, Any] = dict(model="", prompt=prompt, max_tokens=2, temperature=0)

    async def cached(salt: str | None) -> tuple[int, str]:
        extra = {"cache_salt": salt} if salt is not None else {}
        got = await client.completions.create(**kw, extra_body=extra)
        assert got.usage is not None and got.usage.prompt_tokens_details is not None
        return got.usage.prompt_tokens_details.cached_tokens or 0, got.choices[0].text

    first = await cached("tenant-a")
    assert first[0] == 0
    other, unsalted, again = await cached("tenant-b"), await cached(None), await cached("tenant-a")
    assert other[0] == 0 and unsalted[0] == 0 and again[0] > 0
    assert first[1] == other[1] == unsalted[1] == again[1]
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(**kw, extra_body={"cache_salt": "x" * 257})
    assert err.value.body["param"] == "cache_salt"  # type: ignore[index]
    await bpe.wait_idle()


# --- penalties, logit_bias, min_tokens, min_p ---
async def test_penalties_bias_and_min_tokens_through_the_openai_client(bpe: HttpStack) -> None:
    """Same tokens disaggregated and unified and as over gRPC (min_p too); min_tokens holds back
    an EOS that logit_bias made certain; bad values are 400s naming the field."""
    client = aclient(bpe)
    eos = bpe.gateway.service._require_tokenizer()._tok.eos_token_id
    kw: dict[str, Any] = dict(
        model="",
        messages=CHAT,
        max_tokens=10,
        temperature=1.0,
        seed=21,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        logit_bias={"7": 5.0},
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True, "min_p": 0.6, "priority": -2},
    )
    texts = []
    for mode in MODES:
        bpe.router.mode = mode
        got = await client.chat.completions.create(**kw)
        stream = await client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw
        )
        chunks = [c async for c in stream]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == got.choices[0].message.content
        assert got.usage is not None and got.usage.completion_tokens == 10
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
        texts.append(got.choices[0].message.content)
    want = await bpe.stub.Complete(
        chat_pb(
            CHAT,
            max_tokens=10,
            temperature=1.0,
            seed=21,
            presence_penalty=0.7,
            frequency_penalty=0.4,
            repetition_penalty=1.3,
            logit_bias={7: 5.0},
            ignore_eos=True,
            min_p=0.6,
            priority=-2,
        )
    )
    assert texts == [want.text, want.text]
    for mode in MODES:
        bpe.router.mode = mode
        ended = await client.completions.create(
            model="",
            prompt=LONG_PROMPT,
            max_tokens=10,
            temperature=0,
            logit_bias={str(eos): 100},
            extra_body={"min_tokens": 4},
        )
        assert ended.choices[0].finish_reason == "stop"
        assert ended.usage is not None and ended.usage.completion_tokens == 4
    for field, value in (
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"five": 1}),
        ("logit_bias", {"99999999": 1}),
        ("min_tokens", -1),
        ("min_tokens", 11),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("priority", 2**31),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model="", prompt="hi", max_tokens=10, extra_body={field: value})
        assert bad.value.body["param"] == field, (field, value)  # type: ignore[index]
        assert field in bad.value.message
    await bpe.wait_idle()


# --- logprobs ---
@pytest.mark.parametrize("tokenizer", ["bpe", "byte_fallback"])
async def test_logprobs_through_the_openai_client(
    bpe: HttpStack, byte_fallback: HttpStack, tokenizer: str
) -> None:
    """Chat and completions, unary and streamed, disaggregated and unified: one entry per
    generated token (usage counts them), the same numbers everywhere and as over gRPC, top
    alternatives sorted with the chosen token first under greedy."""
    stack = bpe if tokenizer == "bpe" else byte_fallback
    client = aclient(stack)
    seen: dict[str, list[Any]] = {}
    for mode in MODES:
        stack.router.mode = mode
        chat = await client.chat.completions.create(
            model="", messages=CHAT, max_tokens=9, temperature=0, logprobs=True, top_logprobs=3
        )
        choice = chat.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        content = choice.logprobs.content
        assert chat.usage is not None and len(content) == chat.usage.completion_tokens
        for entry in content:
            assert len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the chosen is the top
            assert [t.logprob for t in entry.top_logprobs] == sorted(
                (t.logprob for t in entry.top_logprobs), reverse=True
            )
            assert entry.bytes == list(entry.token.encode())
        stream = await client.chat.completions.create(
            model="", messages=CHAT, max_tokens=9, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
        streamed = [
            e
            for c in [c async for c in stream]
            if c.choices and c.choices[0].logprobs
            for e in (c.choices[0].logprobs.content or [])
        ]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
        text = await client.completions.create(
            model="", prompt=LONG_PROMPT, max_tokens=6, temperature=0.8, seed=4, logprobs=2
        )
        lp = text.choices[0].logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert lp.top_logprobs is not None and lp.text_offset is not None
        assert text.usage is not None and len(lp.tokens) == text.usage.completion_tokens
        assert all(len(alt) <= 2 for alt in lp.top_logprobs)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
        streamed_c = [
            c
            async for c in await client.completions.create(
                model="", prompt=LONG_PROMPT, max_tokens=6, temperature=0.8, seed=4, logprobs=2, stream=True
            )
        ]
        tokens = [t for c in streamed_c if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []]
        offsets = [
            o for c in streamed_c if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset or []
        ]
        assert tokens == lp.tokens and offsets == lp.text_offset
        seen[mode] = [[(e.token, e.logprob) for e in content], lp.token_logprobs]
    for (chat_a, text_a), (chat_b, text_b) in [(seen["disaggregated"], seen["unified"])]:
        assert [t for t, _ in chat_a] == [t for t, _ in chat_b]
        assert all(abs(x - y) <= 1e-5 for (_, x), (_, y) in zip(chat_a, chat_b, strict=True))
        assert all(abs(x - y) <= 1e-5 for x, y in zip(text_a, text_b, strict=True))
    want = await stack.stub.Complete(chat_pb(CHAT, max_tokens=9, temperature=0, logprobs=3))
    assert len(want.logprobs) == want.usage.completion_tokens
    assert all(
        abs(g.logprob - x) <= 1e-5 for g, (_, x) in zip(want.logprobs, seen["unified"][0], strict=True)
    )
    # no logprobs asked: none in the response
    plain = await client.chat.completions.create(model="", messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    bad_fields: list[dict[str, Any]] = [{"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}]
    for kw in bad_fields:
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model="", messages=CHAT, max_tokens=2, extra_body=kw)
        assert bad.value.body["param"] == "top_logprobs"  # type: ignore[index]
    for value in (21, -1):
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model="", prompt="hi", max_tokens=2, logprobs=value)
        assert bad.value.body["param"] == "logprobs"  # type: ignore[index]
    await stack.wait_idle()


# --- echo: prompt logprobs (log-likelihood scoring) ---
async def test_echo_prompt_logprobs_through_the_openai_client(bpe: HttpStack) -> None:
    """echo + logprobs + max_tokens 0 (how evaluation harnesses score a prompt): the prompt's
    text, every prompt token with its logprob (the first null) and alternatives, finish_reason
    length, no completion tokens; disaggregated it needs no decode worker at all. With
    generation the prompt's entries come first, unary as streamed; disaggregated equals
    unified to 1e-5; the gRPC API returns the same numbers; bad combinations are 400s."""
    stack, client = bpe, aclient(bpe)
    scored: dict[str, list[float | None]] = {}
    for mode in MODES:
        stack.router.mode = mode
        decode = stack.router.targets["decode"]
        # disaggregated max_tokens 0: a decode worker that cannot be reached is never needed
        stack.router.targets["decode"] = scheduler_pb2.WorkerTarget(worker_id="gone", address="127.0.0.1:9")
        try:
            score = await client.completions.create(
                model="", prompt=LONG_PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0
            )
        finally:
            stack.router.targets["decode"] = decode
        choice = score.choices[0]
        assert choice.text == LONG_PROMPT and choice.finish_reason == "length"
        assert score.usage is not None and score.usage.completion_tokens == 0
        lp = choice.logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
        assert len(lp.tokens) == score.usage.prompt_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v is not None and v <= 0.0 for v in lp.token_logprobs[1:])
        assert all(alt is not None and 1 <= len(alt) <= 2 for alt in lp.top_logprobs[1:])
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
        scored[mode] = lp.token_logprobs
        # with generation: the prompt's entries, then one per generated token; streamed the same
        fields: dict[str, Any] = dict(
            model="", prompt=LONG_PROMPT, max_tokens=4, echo=True, logprobs=1, temperature=0
        )
        both = await client.completions.create(**fields)
        glp = both.choices[0].logprobs
        assert both.usage is not None and glp is not None and glp.token_logprobs is not None
        assert both.choices[0].text.startswith(LONG_PROMPT) and len(both.choices[0].text) > len(LONG_PROMPT)
        assert glp.tokens is not None and len(glp.tokens) == len(lp.tokens) + both.usage.completion_tokens
        prompt_part = glp.token_logprobs[: len(lp.tokens)]
        assert all(
            a == b or abs(a - b) <= 1e-5 for a, b in zip(prompt_part[1:], lp.token_logprobs[1:], strict=True)
        )
        chunks = [c async for c in await client.completions.create(**fields, stream=True)]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == both.choices[0].text
        streamed = [
            t
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens or []
        ]
        assert streamed == glp.tokens
    assert all(
        a == b or abs(a - b) <= 1e-5  # type: ignore[operator]
        for a, b in zip(scored["disaggregated"], scored["unified"], strict=True)
    )
    # several prompts and n > 1: every choice echoes its own prompt (as OpenAI and vLLM)
    many = await client.completions.create(model="", prompt=["Hi there", "Bye"], n=2, max_tokens=0, echo=True)
    assert [c.text for c in many.choices] == ["Hi there", "Hi there", "Bye", "Bye"]
    assert many.usage is not None and many.usage.completion_tokens == 0
    # the gRPC API: prompt_logprobs, the prompt's ids and one entry per token after the first
    done = await stack.stub.Complete(
        gateway_pb2.GenerateRequest(prompt=LONG_PROMPT, max_tokens=0, prompt_logprobs=2)
    )
    assert done.finish_reason == common_pb2.FINISH_REASON_LENGTH and done.usage.completion_tokens == 0
    assert len(done.prompt_token_ids) == done.usage.prompt_tokens == len(done.prompt_logprobs) + 1
    assert [e.token_id for e in done.prompt_logprobs] == list(done.prompt_token_ids[1:])
    assert all(
        abs(e.logprob - x) <= 1e-5 for e, x in zip(done.prompt_logprobs, scored["unified"][1:], strict=True)
    )
    # refused: max_tokens 0 without echo (or prompt_logprobs), prompt_logprobs out of range (gRPC)
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model="", prompt="hi", max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]
    for request, words in (
        (gateway_pb2.GenerateRequest(prompt="hi", max_tokens=0), "0 is allowed only to score the prompt"),
        (gateway_pb2.GenerateRequest(prompt="hi", prompt_logprobs=21), "prompt_logprobs"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.stub.Complete(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in (err.value.details() or "")
    await stack.wait_idle()


# --- vLLM's prompt_logprobs, return_tokens_as_token_ids, continuous usage ---
async def _sse_chunks(stack: HttpStack, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed request's chunks over raw HTTP (ending with [DONE])."""
    async with (
        httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http,
        http.stream("POST", path, json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def _reference_log_softmax(stack: HttpStack, token_ids: list[int]) -> Any:
    """transformers' own log_softmax of the stack's tiny model at every position of token_ids
    (float32 tensor [len(token_ids), vocab])."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(stack.model), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


async def test_vllm_prompt_logprobs_token_ids_and_continuous_usage(bpe: HttpStack) -> None:
    """prompt_logprobs (vLLM's shape: null first, then {token id: logprob, rank, decoded_token},
    the prompt token first): per choice on completions, top level on chat (max_tokens 0 scores
    the prompt only), the numbers of the gRPC API's prompt logprobs, disaggregated == unified
    to 1e-5 (the ranks exactly); streamed is a 400. The prompt token's rank is vLLM's, 1 + the
    vocabulary entries more likely than it in transformers' own log_softmax of the tiny model,
    also (> 2) for a token outside the 2 alternatives. return_tokens_as_token_ids names
    logprobs' tokens "token_id:N" (echo's prompt part too). continuous_usage_stats: every chunk
    carries its choice's usage so far, exact (completions: as many tokens as its logprobs
    entries so far), ending at what the usage chunk sums."""
    stack, client = bpe, aclient(bpe)
    grpc_request = gateway_pb2.GenerateRequest(prompt=LONG_PROMPT, max_tokens=1, prompt_logprobs=2)
    want = await stack.stub.Complete(grpc_request)
    ids = list(want.prompt_token_ids)
    ref = _reference_log_softmax(stack, ids)
    scores: dict[str, list[Any]] = {}
    ranked: dict[str, list[int]] = {}
    for mode in MODES:
        stack.router.mode = mode
        text = await client.completions.create(
            model="", prompt=LONG_PROMPT, max_tokens=3, n=2, temperature=0, extra_body={"prompt_logprobs": 2}
        )
        assert text.usage is not None and text.usage.prompt_tokens == len(ids)
        lists = [(c.model_extra or {})["prompt_logprobs"] for c in text.choices]
        assert lists[0] == lists[1] and lists[0][0] is None and len(lists[0]) == len(ids)
        for entry, token_id, grpc_entry in zip(lists[0][1:], ids[1:], want.prompt_logprobs, strict=True):
            keys = list(entry)
            assert keys[0] == str(token_id) and 1 <= len(keys) <= 3  # the token, then 2 alternatives
            assert abs(entry[keys[0]]["logprob"] - grpc_entry.logprob) <= 1e-5
            assert all(isinstance(e["decoded_token"], str) for e in entry.values())
            ranks = [e["rank"] for e in entry.values()]  # the token's first, then 1..2
            assert set(ranks[1:]) <= {1, 2} and ranks[0] == grpc_entry.rank
            if len(keys) == 3:  # outside the alternatives: ranked in the whole vocabulary
                assert grpc_entry.rank > 2
        ranked[mode] = [next(iter(e.values()))["rank"] for e in lists[0][1:]]
        assert any(r > 2 for r in ranked[mode])  # the tiny model ranks some prompt token lower
        for i, (rank, token_id) in enumerate(zip(ranked[mode], ids[1:], strict=True)):
            own = float(ref[i, token_id])
            tol = 1e-4  # the worker's paged attention vs transformers' own forward
            assert 1 + int((ref[i] > own + tol).sum()) <= rank <= 1 + int((ref[i] > own - tol).sum())
        chat = await client.chat.completions.create(
            model="", messages=CHAT, max_tokens=0, extra_body={"prompt_logprobs": 1}
        )
        assert chat.usage is not None and chat.usage.completion_tokens == 0
        assert chat.choices[0].finish_reason == "length"
        chat_lp = (chat.model_extra or {})["prompt_logprobs"]
        assert chat_lp[0] is None and len(chat_lp) == chat.usage.prompt_tokens
        scores[mode] = [next(iter(e.values()))["logprob"] for e in lists[0][1:] + chat_lp[1:]]
    assert all(abs(a - b) <= 1e-5 for a, b in zip(scores["disaggregated"], scores["unified"], strict=True))
    assert ranked["disaggregated"] == ranked["unified"]
    for kw in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": -1}, {"prompt_logprobs": 21}):
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model="", prompt="hi", max_tokens=2, extra_body=kw)
        assert bad.value.body["param"] == "prompt_logprobs"  # type: ignore[index]
    # return_tokens_as_token_ids: chat's logprobs, and completions' with echo's prompt part
    named = {"return_tokens_as_token_ids": True}
    by_text = await client.chat.completions.create(
        model="", messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    by_id = await client.chat.completions.create(
        model="", messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, extra_body=named
    )
    text_lp = by_text.choices[0].logprobs.content or []  # type: ignore[union-attr]
    id_lp = by_id.choices[0].logprobs.content or []  # type: ignore[union-attr]
    assert [e.bytes for e in id_lp] == [e.bytes for e in text_lp]
    assert [e.logprob for e in id_lp] == [e.logprob for e in text_lp]
    assert all(re.fullmatch(r"token_id:\d+", t.token) for e in id_lp for t in [e, *e.top_logprobs])
    echoed = await client.completions.create(
        model="", prompt=LONG_PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1, extra_body=named
    )
    lp = echoed.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert lp.tokens[: len(ids)] == [f"token_id:{t}" for t in ids]
    assert all(re.fullmatch(r"token_id:\d+", k) for alt in lp.top_logprobs[1:] for k in alt or {})
    # continuous usage: chat n=2 (role chunks: no tokens yet), completions streamed per token
    options = {"include_usage": True, "continuous_usage_stats": True}
    for mode in MODES:
        stack.router.mode = mode
        body = {"messages": CHAT, "max_tokens": 5, "n": 2, "ignore_eos": True, "stream_options": options}
        chunks = await _sse_chunks(stack, "/chat/completions", body)
        *per_choice, tail = chunks
        assert tail["choices"] == [] and tail["usage"]["completion_tokens"] == 10
        seen: dict[int, list[int]] = {0: [], 1: []}
        for c in per_choice:
            (choice,) = c["choices"]
            u = c["usage"]
            assert u["prompt_tokens"] == tail["usage"]["prompt_tokens"]
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
            seen[choice["index"]].append(u["completion_tokens"])
        assert all(s[0] == 0 and s == sorted(s) and s[-1] == 5 for s in seen.values())
        body = {"prompt": LONG_PROMPT, "max_tokens": 6, "temperature": 0.8, "seed": 2, "logprobs": 0}
        chunks = await _sse_chunks(stack, "/completions", {**body, "stream_options": options})
        *per_token, tail = chunks
        tokens = 0
        for c in per_token:
            tokens += len(c["choices"][0]["logprobs"]["tokens"])
            assert c["usage"]["completion_tokens"] == tokens
        assert tokens == tail["usage"]["completion_tokens"] and per_token[-1]["usage"] == {
            **tail["usage"],
            "prompt_tokens_details": per_token[-1]["usage"]["prompt_tokens_details"],
        }
    await stack.wait_idle()


# --- vLLM's return_token_ids, stop_reason and truncation_side ---
def _extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {})[name]


def _streamed_ids(chunks: list[dict[str, Any]], n: int) -> tuple[list[list[int]], list[Any], list[Any]]:
    """Per choice: the token_ids of its chunks joined, its prompt_token_ids (from its first chunk:
    chat's at the top level, completions' in the choice) and its finished chunk's stop_reason."""
    ids: list[list[int]] = [[] for _ in range(n)]
    prompts: list[Any] = [None] * n
    stops: list[Any] = ["unset"] * n
    for chunk in chunks:
        for choice in chunk["choices"]:
            i = choice["index"]
            if prompts[i] is None:
                prompts[i] = chunk.get("prompt_token_ids", choice.get("prompt_token_ids"))
            ids[i] += choice.get("token_ids") or []
            assert ("stop_reason" in choice) == (choice["finish_reason"] is not None), choice
            if choice["finish_reason"] is not None:
                stops[i] = choice["stop_reason"]
    return ids, prompts, stops


async def test_return_token_ids_stop_reason_and_truncation_side(bpe: HttpStack) -> None:
    """vLLM's return_token_ids: every choice's generated ids (as many as its completion tokens,
    streamed as the ids since the choice's previous chunk, joined equal to unary) and the
    prompt's (completions: per choice; chat: top level; streamed: each choice's first chunk),
    disaggregated == unified; echo leaves the prompt's text out (vLLM's). stop_reason: null
    (length), the stop token id, the stop string (cut or kept; its tokens are in token_ids).
    truncation_side "right" keeps the prompt's first tokens (HTTP and gRPC); bad values: 400."""
    stack, client = bpe, aclient(bpe)
    want = await stack.stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=LONG_PROMPT))
    prompt_ids = list(want.token_ids)
    chat_ids = list((await stack.stub.Tokenize(chat_tokenize_pb(CHAT))).token_ids)
    asked: dict[str, Any] = {"return_token_ids": True, "ignore_eos": True}
    base: dict[str, Any] = dict(model="", max_tokens=5, n=2, temperature=0.8, seed=3)
    by_mode: dict[str, list[Any]] = {}
    for mode in MODES:
        stack.router.mode = mode
        text = await client.completions.create(**base, prompt=LONG_PROMPT, extra_body=asked)
        chat = await client.chat.completions.create(**base, messages=CHAT, extra_body=asked)
        assert _extra(chat, "prompt_token_ids") == chat_ids
        assert text.usage is not None and chat.usage is not None
        for reply, u in ((text, text.usage), (chat, chat.usage)):
            got = [_extra(c, "token_ids") for c in reply.choices]
            assert sum(len(ids) for ids in got) == u.completion_tokens == 10
            assert all(
                c.finish_reason == "length" and _extra(c, "stop_reason") is None for c in reply.choices
            )
        assert all(_extra(c, "prompt_token_ids") == prompt_ids for c in text.choices)
        unary = [[_extra(c, "token_ids") for c in r.choices] for r in (text, chat)]
        body: dict[str, Any] = {"max_tokens": 5, "n": 2, "temperature": 0.8, "seed": 3, **asked}
        streamed = [
            _streamed_ids(await _sse_chunks(stack, "/completions", {**body, "prompt": LONG_PROMPT}), 2),
            _streamed_ids(await _sse_chunks(stack, "/chat/completions", {**body, "messages": CHAT}), 2),
        ]
        for (ids, prompts, stops), want_ids, want_prompt in zip(
            streamed, unary, (prompt_ids, chat_ids), strict=True
        ):
            assert ids == want_ids and prompts == [want_prompt] * 2 and stops == [None, None]
        by_mode[mode] = unary
    assert by_mode["disaggregated"] == by_mode["unified"]
    # no return_token_ids: no ids, stop_reason still there
    plain = await client.completions.create(model="", prompt=LONG_PROMPT, max_tokens=8, temperature=0)
    assert "token_ids" not in (plain.choices[0].model_extra or {})
    assert _extra(plain.choices[0], "stop_reason") is None
    # stop_reason: a stop token id, a stop string (cut or kept); echo without the prompt's text
    greedy: dict[str, Any] = dict(model="", prompt=LONG_PROMPT, max_tokens=8, temperature=0)
    full = await client.completions.create(**greedy, extra_body=asked)
    ids = _extra(full.choices[0], "token_ids")
    stopped = await client.completions.create(**greedy, extra_body={**asked, "stop_token_ids": [ids[2]]})
    (choice,) = stopped.choices
    assert choice.finish_reason == "stop" and _extra(choice, "stop_reason") == ids[2]
    assert _extra(choice, "token_ids") == ids[: ids.index(ids[2]) + 1]
    word = full.choices[0].text[3:6]
    for keep in (False, True):
        flags: dict[str, Any] = {**asked, "include_stop_str_in_output": keep}
        cut = await client.completions.create(**greedy, stop=["\x00never", word], extra_body=flags)
        (choice,) = cut.choices
        assert choice.finish_reason == "stop" and _extra(choice, "stop_reason") == word
        assert cut.usage is not None and len(_extra(choice, "token_ids")) == cut.usage.completion_tokens
        body = {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0, "stop": word, **flags}
        _, _, stops = _streamed_ids(await _sse_chunks(stack, "/completions", body), 1)
        assert stops == [word]
    echoed = await client.completions.create(**greedy, echo=True, extra_body=asked)
    assert echoed.choices[0].text == full.choices[0].text  # vLLM's: the prompt is in its ids
    assert _extra(echoed.choices[0], "prompt_token_ids") == prompt_ids
    # truncation_side
    for side, kept in (("left", prompt_ids[-5:]), ("right", prompt_ids[:5]), (None, prompt_ids[-5:])):
        truncation = {"truncate_prompt_tokens": 5, "truncation_side": side, "return_token_ids": True}
        short = await client.completions.create(**greedy, extra_body=truncation)
        assert _extra(short.choices[0], "prompt_token_ids") == kept, side
    right = await stack.stub.Complete(
        gateway_pb2.GenerateRequest(
            prompt=LONG_PROMPT,
            max_tokens=1,
            prompt_logprobs=0,
            truncate_prompt_tokens=5,
            truncation_side=gateway_pb2.TRUNCATION_SIDE_RIGHT,
        )
    )
    assert list(right.prompt_token_ids) == prompt_ids[:5]
    bad: list[tuple[str, dict[str, Any]]] = [
        ("/completions", {"prompt": "hi", "truncate_prompt_tokens": 1, "truncation_side": "middle"}),
        ("/chat/completions", {"messages": CHAT, "truncation_side": 1}),
    ]
    for path, refused in bad:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as http:
            r = await http.post(path, json={**refused, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side", r.text
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.Complete(gateway_pb2.GenerateRequest(prompt="hi", max_tokens=1, truncation_side=7))  # type: ignore[arg-type]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncation_side" in (
        err.value.details() or ""
    )
    await stack.wait_idle()


async def test_chat_echo_as_vllm(bpe: HttpStack) -> None:
    """vLLM's chat echo: every choice's content starts with the last message's text when that
    message has the reply's role (the continued assistant message; without a generation prompt
    the reply takes the last message's role), streamed as a chunk of its own after the role
    chunk (with continuous usage, no tokens yet); a user message is not echoed after a
    generation prompt; usage is the request's without echo (the echo is no generated token)."""
    stack, client = bpe, aclient(bpe)
    stack.router.mode = "unified"
    prefix = "The capital of France is"
    convo: Any = [*CHAT, {"role": "assistant", "content": prefix}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    fields: dict[str, Any] = dict(model="", messages=convo, max_tokens=4, temperature=0, n=2)
    plain = await client.chat.completions.create(**fields, extra_body=flags)
    echoed = await client.chat.completions.create(**fields, extra_body={**flags, "echo": True})
    assert [c.message.content for c in echoed.choices] == [
        prefix + (c.message.content or "") for c in plain.choices
    ]
    assert echoed.usage is not None and plain.usage is not None
    assert usage_of(echoed.usage)[:3] == usage_of(plain.usage)[:3]  # (the cache warmed between)
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**fields, **flags, "echo": True, "stream_options": options}
    chunks = await _sse_chunks(stack, "/chat/completions", body)
    assert [c["choices"][0]["delta"] for c in chunks[:4]] == [
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": ""},
        {"content": prefix},
        {"content": prefix},
    ]
    assert all(c["usage"]["completion_tokens"] == 0 for c in chunks[:4])
    for i, choice in enumerate(echoed.choices):
        text = "".join(
            c["choices"][0]["delta"].get("content", "") for c in chunks[:-1] if c["choices"][0]["index"] == i
        )
        assert text == choice.message.content
    after_prompt = await client.chat.completions.create(
        model="", messages=CHAT, max_tokens=2, extra_body={"echo": True}
    )
    assert after_prompt.choices[0].message.role == "assistant"  # the user message is not echoed
    as_user = await client.chat.completions.create(
        model="", messages=CHAT, max_tokens=2, extra_body={"echo": True, "add_generation_prompt": False}
    )
    assert as_user.choices[0].message.role == "user"
    assert (as_user.choices[0].message.content or "").startswith(CHAT[0]["content"])
    await stack.wait_idle()


# --- structured outputs ---
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
        "required": ["ok", "size"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 1,
        "maxItems": 4,
    },
    {"type": "object", "properties": {"n": {"type": "null"}, "v": {"type": "number"}}, "required": ["n"]},
]


async def test_structured_outputs_through_the_openai_client(bpe: HttpStack) -> None:
    """A corpus of JSON schemas: every output validates and parses, the same disaggregated and
    unified, streamed and unary, with exact usage; json_object, guided_regex and guided_choice;
    vLLM's structured_outputs (json, regex, choice, grammar) and guided_grammar (GBNF); bad
    constraints are 400s naming the field."""
    client = aclient(bpe)
    for k, schema in enumerate(SCHEMAS):
        texts = []
        for mode in MODES:
            bpe.router.mode = mode
            kw: dict[str, Any] = dict(
                model="",
                messages=CHAT,
                max_tokens=120,
                temperature=1.0,
                seed=k,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schema}},
            )
            got = await client.chat.completions.create(**kw)
            text = got.choices[0].message.content or ""
            assert got.choices[0].finish_reason == "stop", text  # complete JSON, then EOS
            jsonschema.validate(json.loads(text), schema)
            stream = await client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kw
            )
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
            assert got.usage is not None and chunks[-1].usage is not None
            assert got.usage.completion_tokens == chunks[-1].usage.completion_tokens > 0
            texts.append(text)
        assert texts[0] == texts[1]
    for mode in MODES:
        bpe.router.mode = mode
        obj = await client.chat.completions.create(
            model="",
            messages=CHAT,
            max_tokens=60,
            temperature=0.7,
            seed=3,
            response_format={"type": "json_object"},
        )
        if obj.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
        regex = await client.completions.create(
            model="",
            prompt="Code:",
            max_tokens=20,
            temperature=1.0,
            seed=2,
            extra_body={"guided_regex": r"[A-Z]{2}-\d{3}"},
        )
        assert (
            re.fullmatch(r"[A-Z]{2}-\d{3}", regex.choices[0].text)
            and regex.choices[0].finish_reason == "stop"
        )
        choice = await client.completions.create(
            model="",
            prompt="Pick:",
            max_tokens=20,
            temperature=0,
            extra_body={"guided_choice": ["red", "green 🙂"]},
        )
        assert choice.choices[0].text in ("red", "green 🙂")
        # vLLM's current form (structured_outputs) and a grammar (GBNF; Lark through gRPC tests)
        gbnf = 'root ::= ("yes" | "no") " " [0-9]'
        for body in (
            {"structured_outputs": {"grammar": gbnf}},
            {"guided_grammar": gbnf},
            {"structured_outputs": {"regex": r"(yes|no) [0-9]", "json": None, "disable_fallback": True}},
        ):
            out = await client.chat.completions.create(
                model="", messages=CHAT, max_tokens=20, temperature=1.0, seed=4, extra_body=body
            )
            text = out.choices[0].message.content or ""
            assert re.fullmatch(r"(yes|no) [0-9]", text), (body, text)
            assert out.choices[0].finish_reason == "stop"
        flag: dict[str, Any] = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
        flag.update(required=["ok"], additionalProperties=False)
        as_json = await client.completions.create(
            model="",
            prompt="JSON:",
            max_tokens=20,
            temperature=0,
            extra_body={"structured_outputs": {"json": flag}},
        )
        assert json.loads(as_json.choices[0].text) in ({"ok": True}, {"ok": False})
        picked = await client.completions.create(
            model="",
            prompt="Pick:",
            max_tokens=20,
            extra_body={"structured_outputs": {"choice": ["up", "down"]}},
        )
        assert picked.choices[0].text in ("up", "down")
    bad: list[tuple[dict[str, Any], str]] = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "(a|b"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "a"}, "guided_regex"),
    ]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(model="", prompt="hi", max_tokens=4, extra_body=body)
        assert err.value.body["param"] == param, body  # type: ignore[index]
    await bpe.wait_idle()


TOOL_PARAMS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo 🙂"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tz": {"enum": ["UTC", "CET"]}},
        "required": ["tz"],
        "additionalProperties": False,
    },
]
TOOLS: Any = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": TOOL_PARAMS[0]},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TOOL_PARAMS[1]}},
]


async def test_tool_calls_through_the_openai_client(bpe: HttpStack) -> None:
    """tool_choice required and a named function make even the random model call a tool: the
    arguments validate against the tool's schema, finish_reason is tool_calls, the stream's deltas
    reassemble to the unary call, usage is exact, disaggregated == unified; tool messages in the
    conversation are accepted; auto runs; bad tool inputs are 400s naming the field."""
    client = aclient(bpe)
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    for k, choice in enumerate(["required", named]):
        results = []
        for mode in MODES:
            bpe.router.mode = mode
            kw: dict[str, Any] = dict(
                model="",
                messages=CHAT,
                tools=TOOLS,
                tool_choice=choice,
                max_tokens=60,
                temperature=1.0,
                seed=k,
                logprobs=True,
            )
            got = await client.chat.completions.create(**kw)
            msg = got.choices[0].message
            assert got.choices[0].finish_reason == "tool_calls", msg
            assert msg.content is None and msg.tool_calls and len(msg.tool_calls) == 1
            call = msg.tool_calls[0]
            assert call.type == "function" and call.id.startswith("call_")
            if choice is named:
                assert call.function.name == "get_time"
            schema = TOOL_PARAMS[[t["function"]["name"] for t in TOOLS].index(call.function.name)]
            jsonschema.validate(json.loads(call.function.arguments), schema)
            stream = await client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kw
            )
            chunks = [c async for c in stream]
            content, calls, reason = reassembled(chunks)
            assert (content, [c[1:] for c in calls], reason) == (
                "",
                [(call.function.name, call.function.arguments)],
                "tool_calls",
            )
            pieces = [
                tc.function.arguments
                for c in chunks
                if c.choices
                for tc in c.choices[0].delta.tool_calls or ()
                if tc.function is not None and tc.function.arguments
            ]
            assert len(pieces) > 1, pieces  # a forced call's arguments stream as they are written
            assert got.usage is not None and chunks[-1].usage is not None
            # exact usage (cached tokens differ: the second request finds the first's prefix)
            assert (
                usage_of(got.usage)[:3] == usage_of(chunks[-1].usage)[:3] and got.usage.completion_tokens > 0
            )
            # one logprob per counted token, also for the tokens the parser held back in the stream
            streamed_lps = [
                e
                for c in chunks
                if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or ()
            ]
            assert got.choices[0].logprobs is not None
            assert (
                len(got.choices[0].logprobs.content or ()) == len(streamed_lps) == got.usage.completion_tokens
            )
            results.append((call.function.name, call.function.arguments, usage_of(got.usage)[:3]))
        assert results[0] == results[1]  # disaggregated == unified
    # a conversation with an earlier call and its result; auto lets the model choose
    history: Any = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo 🙂", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    for mode in MODES:
        bpe.router.mode = mode
        auto = await client.chat.completions.create(
            model="", messages=history, tools=TOOLS, max_tokens=8, temperature=0
        )
        assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
        stream = await client.chat.completions.create(
            model="", messages=history, tools=TOOLS, max_tokens=8, temperature=0, stream=True
        )
        content, calls, reason = reassembled([c async for c in stream])
        unary = auto.choices[0].message
        assert (content or None, [c[1:] for c in calls], reason) == (
            unary.content or None,
            [(c.function.name, c.function.arguments) for c in unary.tool_calls or ()],  # type: ignore[union-attr]
            auto.choices[0].finish_reason,
        )
    bad: list[tuple[dict[str, Any], str]] = [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages"),
    ]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(**{"model": "", "messages": CHAT, "max_tokens": 4, **body})
        assert err.value.body["param"] == param, body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model="", prompt="hi", max_tokens=4, extra_body={"tools": TOOLS})
    assert err.value.body["param"] == "tools"  # type: ignore[index]
    await bpe.wait_idle()


# --- errors ---
# --- the Responses API (POST /v1/responses), served by the chat path ---
async def _responses_stream(client: openai.AsyncOpenAI, **kw: Any) -> tuple[list[Any], Any]:
    """A streamed response's events and its final Response (from response.completed/incomplete)."""
    stream = await client.responses.create(stream=True, **kw)
    got = [e async for e in stream]
    assert [e.sequence_number for e in got] == list(range(len(got)))
    assert got[0].type == "response.created" and got[1].type == "response.in_progress"
    assert got[-1].type in ("response.completed", "response.incomplete")
    return got, got[-1].response


async def test_responses_api_logprobs_are_chats(bpe: HttpStack) -> None:
    """include ["message.output_text.logprobs"] + top_logprobs: one entry per output token with
    its alternatives, the chat completion's entries (greedy); streamed, each delta carries its
    own and the final part all of them."""
    client = aclient(bpe)
    kw: dict[str, Any] = {"model": "", "input": "the sky is", "max_output_tokens": 6, "temperature": 0.0}
    asked: dict[str, Any] = {"include": ["message.output_text.logprobs"], "top_logprobs": 2, **kw}

    def seen(entries: Any) -> list[Any]:
        return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in entries]

    chat = await client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "the sky is"}],
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    assert chat.choices[0].logprobs is not None
    expected = seen(chat.choices[0].logprobs.content)
    got = await client.responses.create(**asked)
    part: Any = got.output[0].content[0]
    assert got.usage is not None and len(part.logprobs) == got.usage.output_tokens == len(expected)
    assert seen(part.logprobs) == expected and all(len(e.top_logprobs) == 2 for e in part.logprobs)
    events, final = await _responses_stream(client, **asked)
    streamed = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    assert seen(streamed) == seen(final.output[0].content[0].logprobs) == expected
    plain: Any = await client.responses.create(**kw)  # not asked: none
    assert plain.output[0].content[0].logprobs == []
    await bpe.wait_idle()


async def test_responses_api_through_the_openai_client(bpe: HttpStack) -> None:
    """`client.responses.create` gives the chat completion's text and usage (greedy), with
    instructions as the system message and input items as messages; streamed, the output_text
    deltas add up to the same text and the last event holds the whole Response; a run cut by
    max_output_tokens is incomplete; disaggregated == unified."""
    client = aclient(bpe)
    system = "Answer briefly."
    texts = []
    for mode in MODES:
        bpe.router.mode = mode
        chat = await client.chat.completions.create(
            model="",
            messages=[{"role": "system", "content": system}, *CHAT],
            max_tokens=12,
            temperature=0.0,
        )
        kw: dict[str, Any] = dict(
            model="", instructions=system, input=CHAT[0]["content"], max_output_tokens=12, temperature=0.0
        )
        got = await client.responses.create(**kw)
        assert got.object == "response" and got.id.startswith("resp_")
        assert got.output_text == chat.choices[0].message.content
        assert chat.usage is not None and got.usage is not None
        assert (got.usage.input_tokens, got.usage.output_tokens, got.usage.total_tokens) == (
            chat.usage.prompt_tokens,
            chat.usage.completion_tokens,
            chat.usage.total_tokens,
        )
        # the chat request before it left the prompt's full blocks in the prefix cache
        assert 0 < got.usage.input_tokens_details.cached_tokens < got.usage.input_tokens
        if chat.choices[0].finish_reason == "length":
            assert got.status == "incomplete"
            assert got.incomplete_details is not None
            assert got.incomplete_details.reason == "max_output_tokens"
        else:
            assert got.status == "completed"
        (item,) = got.output
        assert item.type == "message" and item.role == "assistant" and item.status == "completed"
        events, final = await _responses_stream(client, **kw)
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert "".join(deltas) == final.output_text == got.output_text
        assert final.usage == got.usage and final.status == got.status
        kinds = [e.type for e in events]
        for kind in (
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.done",
        ):
            assert kind in kinds
        texts.append(got.output_text)
        # the same conversation as input items: a developer message and content parts
        items: Any = [
            {"role": "developer", "content": system},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": CHAT[0]["content"]}],
            },
        ]
        as_items = await client.responses.create(model="", input=items, max_output_tokens=12, temperature=0.0)
        assert as_items.output_text == got.output_text
    assert texts[0] == texts[1]
    await bpe.wait_idle()


async def test_responses_api_structured_output_tools_and_refusals(bpe: HttpStack) -> None:
    """text.format json_schema constrains the output as response_format does; function tools
    with tool_choice required give function_call items (streamed: their arguments deltas add up);
    a conversation with the call and its output is accepted; what is not served is a 400 naming
    the field."""
    client = aclient(bpe)
    schema = SCHEMAS[0]
    fmt: Any = {"format": {"type": "json_schema", "name": "s0", "schema": schema, "strict": True}}
    got = await client.responses.create(
        model="", input="Give JSON", text=fmt, max_output_tokens=120, temperature=0.0
    )
    assert got.status == "completed", got.output_text
    jsonschema.validate(json.loads(got.output_text), schema)
    tools: Any = [{"type": "function", "name": "get_time", "parameters": TOOL_PARAMS[1], "strict": True}]
    for mode in MODES:
        bpe.router.mode = mode
        kw: dict[str, Any] = dict(
            model="",
            input="What time is it?",
            tools=tools,
            tool_choice="required",
            max_output_tokens=60,
            temperature=0.0,
        )
        called = await client.responses.create(**kw)
        calls = [o for o in called.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_time" and calls[0].status == "completed"
        jsonschema.validate(json.loads(calls[0].arguments), TOOL_PARAMS[1])
        events, final = await _responses_stream(client, **kw)
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        (streamed,) = [o for o in final.output if o.type == "function_call"]
        assert "".join(pieces) == streamed.arguments == calls[0].arguments
        # the next turn: the call and its output as input items
        history: Any = [
            {"role": "user", "content": "What time is it?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_time",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00"},
        ]
        after = await client.responses.create(
            model="", input=history, tools=tools, max_output_tokens=8, temperature=0.0
        )
        assert after.status in ("completed", "incomplete")
    refused: list[tuple[dict[str, Any], str]] = [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "web_search_call"}]}, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ]
    for body, param in refused:
        with pytest.raises(openai.BadRequestError) as err:
            await client.post("/responses", cast_to=httpx.Response, body={"model": "", **body})
        assert err.value.body["param"] == param, body  # type: ignore[index]
    await bpe.wait_idle()


async def test_errors_surface_as_openai_exceptions(bpe: HttpStack) -> None:
    client = aclient(bpe)
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="", messages=CHAT, temperature=-1)
    assert "temperature" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model="", prompt="hi", best_of=2)
    assert bad.value.body["param"] == "best_of"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="", messages=CHAT, max_tokens=10_000)
    assert "max_model_len" in bad.value.message
    with pytest.raises(openai.NotFoundError) as nf:
        await client.chat.completions.create(model="gpt-9", messages=CHAT)
    assert "gpt-9" in nf.value.message
    bpe.router.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED
    try:
        with pytest.raises(openai.RateLimitError) as rl:
            await client.chat.completions.create(model="", messages=CHAT, stream=True)
        assert rl.value.response.headers["retry-after"] == "1"
        bpe.router.refuse = grpc.StatusCode.UNAVAILABLE
        with pytest.raises(openai.InternalServerError) as unavailable:
            await client.completions.create(model="", prompt="hi")
        assert unavailable.value.status_code == 503
    finally:
        bpe.router.refuse = None
    # an unknown vendor field is ignored
    ok = await client.completions.create(model="", prompt="hi", max_tokens=1, extra_body={"vendor_x": 1})
    assert ok.choices[0].text is not None


async def test_malformed_requests_get_actionable_4xx(bpe: HttpStack) -> None:
    async with httpx.AsyncClient(base_url=bpe.base_url, timeout=30) as http:
        r = await http.post(
            "/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = await http.post("/chat/completions", json={"messages": CHAT, "max_tokens": "ten"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = await http.post("/chat/completions", json={"max_tokens": 3})
        assert r.status_code == 400 and "messages is required" in r.json()["error"]["message"]
        r = await http.post("/chat/completions", json=[1, 2])
        assert r.status_code == 400
        r = await http.post(
            "/completions",
            content=b"prompt=hi",
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
        big = {"prompt": "x" * (bpe.gateway.settings.http_max_body_bytes + 10)}
        r = await http.post("/completions", json=big)
        assert r.status_code == 413 and "http-max-body-bytes" in r.json()["error"]["message"]
        r = await http.post(
            "/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
        )
        assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
        r = await http.get("/nothing-here")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        # content parts are joined
        r = await http.post(
            "/chat/completions",
            json={
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                "max_tokens": 2,
            },
        )
        assert r.status_code == 200, r.text
    await bpe.wait_idle()


# --- API keys on both faces ---
async def test_api_keys_on_http_and_grpc(bpe: HttpStack) -> None:
    bpe.router.mode = "unified"
    async with gateway_on(bpe, api_keys=("key-one", "key-two")) as gw:
        url = (gw.http_url or "") + "/v1"
        wrong = _track(openai.AsyncOpenAI(base_url=url, api_key="key-three", max_retries=0))
        with pytest.raises(openai.AuthenticationError) as denied:
            await wrong.completions.create(model="", prompt="hi", max_tokens=1)
        assert "key-three" not in str(denied.value.body)
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
        ok = _track(openai.AsyncOpenAI(base_url=url, api_key="key-two", max_retries=0))
        assert (await ok.completions.create(model="", prompt="hi", max_tokens=1)).choices
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get((gw.http_url or "") + "/health")).status_code == 200  # open
            for headers in ({}, {"authorization": "Basic a2V5LW9uZQ=="}, {"authorization": "Bearer"}):
                r = await http.post(url + "/completions", json={"prompt": "hi"}, headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["type"] == "authentication_error"
        async with grpc.aio.insecure_channel(gw.server.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            req = gateway_pb2.GenerateRequest(prompt="hi", max_tokens=1)
            for md in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Complete(req, metadata=md)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    _ = [f async for f in stub.Generate(req, metadata=md)]
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            done = await stub.Complete(req, metadata=(("authorization", "Bearer key-one"),))
            assert done.usage.completion_tokens == 1
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # open without a key


# --- disconnects ---
def _aborted() -> float:
    return sample_total("pdserve_requests_total", finish_reason="abort")


async def _leave_mid_stream(stack: HttpStack, path: str, body: dict[str, Any], marker: str) -> None:
    """Stream `body` from `path` and go away after the third line that starts with `marker`."""
    async with (
        httpx.AsyncClient(base_url=stack.base_url, timeout=60) as http,
        http.stream("POST", path, json={**body, "stream": True}) as r,
    ):
        got = 0
        async for line in r.aiter_lines():
            got += line.startswith(marker)
            if got >= 3:
                break  # the client goes away mid-stream


@pytest.mark.parametrize("mode", MODES)
async def test_disconnect_aborts_on_the_workers(bpe: HttpStack, mode: str) -> None:
    bpe.router.mode = mode
    await bpe.wait_idle()
    before = _aborted()
    body = {"prompt": LONG_PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    await _leave_mid_stream(bpe, "/completions", body, "data: ")
    await bpe.wait_idle()
    assert _aborted() == before + 1
    # before a non-streaming answer
    async with httpx.AsyncClient(base_url=bpe.base_url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/completions", json=body)
    await bpe.wait_idle()
    assert _aborted() == before + 2
    # a Responses stream (its chat stream underneath)
    responses = {"input": LONG_PROMPT, "max_output_tokens": 1500, "temperature": 0, "ignore_eos": True}
    await _leave_mid_stream(bpe, "/responses", responses, "event: response.output_text.delta")
    await bpe.wait_idle()
    assert _aborted() == before + 3


async def test_error_after_the_stream_started_ends_it_with_an_error_event(bpe: HttpStack) -> None:
    bpe.router.mode = "unified"
    body = {"prompt": LONG_PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    async with gateway_on(bpe) as gw:
        async with (
            httpx.AsyncClient(base_url=(gw.http_url or "") + "/v1", timeout=60) as http,
            http.stream("POST", "/completions", json=body) as r,
        ):
            assert r.status_code == 200
            lines: list[str] = []
            async for line in r.aiter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 2:  # mid-stream: the gateway shuts down with no grace
                    drain = asyncio.ensure_future(gw.service.drain(0.0))
        await drain
        last = json.loads(lines[-1][6:])
        assert last["error"]["type"] == "service_unavailable_error" and "retry" in last["error"]["message"]
        assert "data: [DONE]" not in lines
        # the official client raises on the error event
        client = _track(openai.AsyncOpenAI(base_url=(gw.http_url or "") + "/v1", api_key="x", max_retries=0))
        with pytest.raises(openai.InternalServerError):
            await client.completions.create(model="", prompt="hi", max_tokens=2)  # draining: 503
    # the official client raises the error event as an APIError
    async with gateway_on(bpe) as gw:
        client = _track(openai.AsyncOpenAI(base_url=(gw.http_url or "") + "/v1", api_key="x", max_retries=0))
        stream = await client.completions.create(
            model="", prompt=LONG_PROMPT, max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
        )
        seen = 0
        with pytest.raises(openai.APIError, match="retry"):
            async for _ in stream:
                seen += 1
                if seen == 2:
                    drain = asyncio.ensure_future(gw.service.drain(0.0))
        await drain
    await bpe.wait_idle()


async def test_mistral_tool_requests_have_the_workers_show_special_tokens(
    bpe: HttpStack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With --tool-call-parser mistral an auto tool request asks the workers to show special
    tokens (so [TOOL_CALLS] reaches the parser wherever it comes): a special token the model
    writes (forced here) is in the content, as vLLM's Mistral parser leaves it; without tools,
    or as hermes (the `bpe` stack's), it stays hidden."""
    from transformers import AutoTokenizer

    start = AutoTokenizer.from_pretrained(str(bpe.model)).convert_tokens_to_ids("<|im_start|>")
    base: dict[str, Any] = dict(
        model="",
        messages=CHAT,
        max_tokens=2,
        temperature=0,
        extra_body={"logit_bias": {str(start): 100}, "ignore_eos": True},
    )
    hermes = await aclient(bpe).chat.completions.create(**base, tools=TOOLS)
    assert hermes.choices[0].message.content == ""
    async with http_stack(bpe.model, tool_call_parser="mistral") as stack:
        client = aclient(stack)
        with_tools = await client.chat.completions.create(**base, tools=TOOLS)
        assert with_tools.choices[0].message.content == "<|im_start|>" * 2
        plain = await client.chat.completions.create(**base)
        assert plain.choices[0].message.content == ""


async def test_unset_sampling_fields_take_the_models_generation_config(
    bpe: HttpStack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """vLLM's --generation-config auto: a request that leaves temperature and max_tokens unset
    gets the model's recommendation (here greedy, 3 tokens), set ones win; with `vllm` the
    gateway's own defaults apply."""
    import json
    import shutil

    model = tmp_path_factory.mktemp("genconfig") / bpe.model.name
    shutil.copytree(bpe.model, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=3)
    (model / "generation_config.json").write_text(json.dumps(config))
    greedy = await aclient(bpe).completions.create(
        model="", prompt=LONG_PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    async with http_stack(model, default_max_tokens=5) as stack:
        client = aclient(stack)
        unset = await client.completions.create(model="", prompt=LONG_PROMPT, extra_body={"ignore_eos": True})
        assert unset.choices[0].text == greedy.choices[0].text
        assert unset.usage is not None and unset.usage.completion_tokens == 3
        longer = await client.completions.create(
            model="", prompt=LONG_PROMPT, max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert longer.usage is not None and longer.usage.completion_tokens == 4
    async with http_stack(model, default_max_tokens=5, generation_config="vllm") as stack:
        own = await aclient(stack).completions.create(
            model="", prompt=LONG_PROMPT, extra_body={"ignore_eos": True}
        )
        assert own.usage is not None and own.usage.completion_tokens == 5
