"""Multi-LoRA serving through the real stack (load-monitor, scheduler, workers, gateway in this
process, on loopback), over a tiny random Llama and two tiny PEFT adapters of it, with the openai
client and gRPC: an adapter is a model of its own (listed with its parent, named in `model`), its
greedy text differs from the base model's and is the same disaggregated (prefill + decode
workers) and unified; concurrent requests of the base model and both adapters, which share engine
steps, each give their solo text; an adapter's prompt is cached under the adapter only; unknown
models are 404 naming what is served."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import pytest_asyncio

from shared.proto import gateway_pb2, gateway_pb2_grpc
from tests.support.inproc import InProcessStack, five_services
from tests.support.tiny_models import build_tiny_lora, build_tiny_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODES = ("disaggregated", "unified")
ROLES = {"disaggregated": ("prefill", "decode"), "unified": ("unified",)}
ADAPTERS = ("sql", "chat")
PROMPT = "The KV cache of an adapter"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lora") / "tiny", "bpe")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stacks(model: Path) -> AsyncIterator[dict[str, InProcessStack]]:
    """One stack per mode; every worker serves both adapters (seeds 1 and 2)."""
    modules = tuple(
        f"{name}={build_tiny_lora(model, model.parent / name, seed=i + 1)}" for i, name in enumerate(ADAPTERS)
    )
    async with contextlib.AsyncExitStack() as exits:
        out = {}
        for mode in MODES:
            out[mode] = await exits.enter_async_context(
                five_services(
                    model,
                    ROLES[mode],
                    gateway_overrides={"http_port": 0, "block_size": 4},
                    worker_overrides={"lora_modules": modules, "block_size": 4},
                )
            )
        yield out


def client(stack: InProcessStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.gateway.http_url}/v1", api_key="none", max_retries=0)


async def complete(api: openai.AsyncOpenAI, model: str, prompt: str = PROMPT) -> Any:
    return await api.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},  # every run generates MAX_TOKENS
        timeout=60,
    )


async def test_models_list_each_adapter_with_its_parent(
    stacks: dict[str, InProcessStack], model: Path
) -> None:
    async with client(stacks["disaggregated"]) as api:
        cards = {c.id: c for c in (await api.models.list()).data}
        assert list(cards) == [model.name, "chat", "sql"]
        assert (cards[model.name].model_extra or {})["parent"] is None
        for name in ADAPTERS:
            extra = cards[name].model_extra or {}
            assert (extra["parent"], extra["root"]) == (model.name, name)
            assert extra["max_model_len"] == (cards[model.name].model_extra or {})["max_model_len"]
        assert await api.models.retrieve("sql") == cards["sql"]
        with pytest.raises(openai.NotFoundError):
            await api.models.retrieve("nope")
        with pytest.raises(openai.NotFoundError) as err:
            await complete(api, "nope")
    message = str(err.value)
    assert f"serves '{model.name}' and its LoRA adapters ['chat', 'sql']" in message, message
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"  # type: ignore[index]


async def test_an_adapters_text_differs_from_the_base_models_and_is_the_same_in_both_modes(
    stacks: dict[str, InProcessStack], model: Path
) -> None:
    texts: dict[str, dict[str, str]] = {}
    for mode in MODES:
        async with client(stacks[mode]) as api:
            texts[mode] = {}
            base = await complete(api, model.name)
            for name in ("", *ADAPTERS):  # "" = the base model, by default
                done = await complete(api, name or model.name)
                assert done.model == (name or model.name)
                assert done.usage is not None
                assert done.usage.prompt_tokens == base.usage.prompt_tokens  # the base model's tokenizer
                assert done.usage.completion_tokens == MAX_TOKENS
                assert done.usage.total_tokens == done.usage.prompt_tokens + MAX_TOKENS
                texts[mode][name] = done.choices[0].text
            chat = await api.chat.completions.create(
                model="sql",
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                extra_body={"ignore_eos": True},
                timeout=60,
            )
            assert (
                chat.model == "sql" and chat.usage is not None and chat.usage.completion_tokens == MAX_TOKENS
            )
    assert texts["disaggregated"] == texts["unified"]
    by_model = texts["unified"]
    assert len({by_model[""], by_model["sql"], by_model["chat"]}) == 3, by_model


async def test_concurrent_base_and_adapter_requests_each_give_their_solo_text(
    stacks: dict[str, InProcessStack], model: Path
) -> None:
    """Requests of the base model and of both adapters in the same engine steps (one row each)."""
    jobs = [(name, f"{PROMPT} number {i}") for i in range(2) for name in (model.name, *ADAPTERS)]
    for mode in MODES:
        async with client(stacks[mode]) as api:
            solo = [(await complete(api, name, prompt)).choices[0].text for name, prompt in jobs]
            together = await asyncio.gather(*(complete(api, name, prompt) for name, prompt in jobs))
            assert [done.choices[0].text for done in together] == solo, mode
            assert [done.model for done in together] == [name for name, _ in jobs]


async def test_an_adapters_prompt_is_cached_under_the_adapter_only(stacks: dict[str, InProcessStack]) -> None:
    prompt = "Cached blocks belong to the weights that computed them, " * 2
    async with client(stacks["unified"]) as api:
        base = await complete(api, "", prompt)
        cached = base.usage.prompt_tokens_details.cached_tokens or 0
        assert cached == 0  # a prompt of its own
        first = await complete(api, "sql", prompt)
        assert (first.usage.prompt_tokens_details.cached_tokens or 0) == 0  # not the base model's KV
        again = await complete(api, "sql", prompt)
        assert (again.usage.prompt_tokens_details.cached_tokens or 0) > 0
        assert again.choices[0].text == first.choices[0].text
        other = await complete(api, "chat", prompt)
        assert (other.usage.prompt_tokens_details.cached_tokens or 0) == 0  # nor another adapter's


async def test_grpc_model_names_an_adapter_in_every_call(
    stacks: dict[str, InProcessStack], model: Path
) -> None:
    stack = stacks["disaggregated"]
    async with (
        client(stack) as api,
        grpc.aio.insecure_channel(stack.gateway.server.address) as channel,
    ):
        stub = gateway_pb2_grpc.GatewayStub(channel)
        listed = await stub.ListModels(gateway_pb2.ListModelsRequest())
        assert [(m.id, m.parent) for m in listed.models] == [
            (model.name, ""),
            ("chat", model.name),
            ("sql", model.name),
        ]
        assert not listed.models[0].HasField("parent")
        req = gateway_pb2.GenerateRequest(
            model="sql",
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            return_token_ids=True,
        )
        done = await stub.Complete(req, timeout=60)
        assert done.model == "sql" and done.usage.completion_tokens == MAX_TOKENS
        assert done.text == (await complete(api, "sql")).choices[0].text
        frames = [f async for f in stub.Generate(req, timeout=60)]
        assert {f.model for f in frames} == {"sql"} and "".join(f.text for f in frames) == done.text
        tokenized = await stub.Tokenize(gateway_pb2.TokenizeRequest(model="sql", prompt=PROMPT))
        assert tokenized.model == "sql" and tokenized.count == done.usage.prompt_tokens
        assert tokenized.max_model_len > 0
        text = await stub.Detokenize(gateway_pb2.DetokenizeRequest(model="sql", token_ids=done.token_ids))
        # the text shows the EOS tokens ignore_eos let through; Complete's text hides them
        assert (text.model, text.text.replace("<|im_end|>", "")) == ("sql", done.text)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Complete(gateway_pb2.GenerateRequest(model="nope", prompt="x"), timeout=60)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
