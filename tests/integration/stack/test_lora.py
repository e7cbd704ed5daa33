"""Multi-LoRA serving through the real stack (load-monitor, scheduler, workers, gateway in this
process, on loopback), over a tiny random Llama and two tiny PEFT adapters of it, with the openai
client and gRPC: an adapter is a model of its own (listed with its parent, named in `model`), its
greedy text differs from the base model's and is the same disaggregated (prefill + decode
workers) and unified; concurrent requests of the base model and both adapters, which share engine
steps, each give their solo text; an adapter's prompt is cached under the adapter only; unknown
models are 404 naming what is served. Adapters loaded while the cluster runs (into workers
started with --enable-lora only, through a gateway with --allow-runtime-lora-updating): served
at once with the greedy text of the same adapter loaded at start, listed, 404 once unloaded; a
gateway without the flag refuses (403), a bad adapter is 400 and loaded nowhere, a second load
409, an unload while a request of it runs 409 until it ended."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import pytest_asyncio

from shared.cluster import LORA_RUNTIME_CAPABILITY
from shared.proto import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.support.inproc import InProcessStack, five_services
from tests.support.prom import sample_total
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


@contextlib.asynccontextmanager
async def stacks_per_mode(
    model: Path, gateway: dict[str, Any], worker: dict[str, Any]
) -> AsyncIterator[dict[str, InProcessStack]]:
    """One in-process stack per mode (blocks of 4 tokens, HTTP on), with these overrides."""
    async with contextlib.AsyncExitStack() as exits:
        out = {}
        for mode in MODES:
            out[mode] = await exits.enter_async_context(
                five_services(
                    model,
                    ROLES[mode],
                    gateway_overrides={"http_port": 0, "block_size": 4, **gateway},
                    worker_overrides={"block_size": 4, **worker},
                )
            )
        yield out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stacks(model: Path) -> AsyncIterator[dict[str, InProcessStack]]:
    """One stack per mode; every worker serves both adapters (seeds 1 and 2)."""
    modules = tuple(
        f"{name}={build_tiny_lora(model, model.parent / name, seed=i + 1)}" for i, name in enumerate(ADAPTERS)
    )
    async with stacks_per_mode(model, {}, {"lora_modules": modules}) as out:
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
    counted = ("pdserve_generation_tokens_total", "pdserve_requests_total")
    before = {(m, name): sample_total(m, model=name) for m in counted for name in ("sql", "chat", model.name)}
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
    # usage by model id, each adapter apart (per mode: sql twice, chat once, the base model twice)
    expected = {"sql": 2 * len(MODES), "chat": len(MODES), model.name: 2 * len(MODES)}
    for _ in range(100):  # a request is counted as its call ends: the last one may lag its reply
        got = {n: sample_total(counted[1], model=n) - before[(counted[1], n)] for n in expected}
        if got == expected:
            break
        await asyncio.sleep(0.02)
    assert got == expected
    for name, requests in expected.items():
        tokens = sample_total(counted[0], model=name) - before[(counted[0], name)]
        assert tokens == requests * MAX_TOKENS, name


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


# --- adapters loaded and unloaded while the cluster runs (vLLM's runtime LoRA updating) ---

KEY = "lora-admin-key"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(model: Path) -> AsyncIterator[dict[str, InProcessStack]]:
    """One stack per mode whose workers start with --enable-lora and no adapter, behind a gateway
    with --allow-runtime-lora-updating and an API key."""
    gateway = {"allow_runtime_lora_updating": True, "api_keys": (KEY,)}
    async with stacks_per_mode(model, gateway, {"enable_lora": True}) as out:
        yield out


def http(stack: InProcessStack, key: str | None = KEY) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=str(stack.gateway.http_url), headers=headers, timeout=60)


def adapter_path(model: Path, name: str) -> str:
    """The folder the `stacks` fixture built for `name` (the same adapter its workers load at start)."""
    return str(build_tiny_lora(model, model.parent / name, seed=ADAPTERS.index(name) + 1))


async def worker_adapters(stack: InProcessStack) -> list[tuple[str, ...]]:
    """What each worker's Info says it serves."""
    out = []
    for w in stack.workers:
        async with grpc.aio.insecure_channel(w.address) as channel:
            info = await worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest())
        assert LORA_RUNTIME_CAPABILITY in info.capabilities and "lora" in info.capabilities
        out.append(tuple(info.lora_adapters))
    return out


@pytest.mark.parametrize("mode", MODES)
async def test_an_adapter_loaded_at_runtime_serves_like_one_loaded_at_start_until_unloaded(
    runtime: dict[str, InProcessStack], stacks: dict[str, InProcessStack], model: Path, mode: str
) -> None:
    stack = runtime[mode]
    async with http(stack) as web, client(stacks[mode]) as at_start:
        api = openai.AsyncOpenAI(base_url=f"{stack.gateway.http_url}/v1", api_key=KEY, max_retries=0)
        base = (await complete(api, model.name)).choices[0].text
        loaded = await web.post(
            "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapter_path(model, "sql")}
        )
        assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
        assert await worker_adapters(stack) == [("sql",)] * len(ROLES[mode])  # every role
        cards = {c.id: c.model_extra or {} for c in (await api.models.list()).data}
        assert list(cards) == [model.name, "sql"] and cards["sql"]["parent"] == model.name
        done = await complete(api, "sql")  # at once: the gateway answered once routing had it
        assert done.model == "sql"
        assert done.choices[0].text == (await complete(at_start, "sql")).choices[0].text != base
        gone = await web.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
        assert await worker_adapters(stack) == [()] * len(ROLES[mode])
        with pytest.raises(openai.NotFoundError):
            await complete(api, "sql")
        assert [c.id for c in (await api.models.list()).data] == [model.name]
        assert (await complete(api, model.name)).choices[0].text == base
        await api.close()


async def test_runtime_updates_are_refused_unless_the_gateway_allows_them(
    stacks: dict[str, InProcessStack], runtime: dict[str, InProcessStack], model: Path
) -> None:
    """The `stacks` gateways run without --allow-runtime-lora-updating: 403 / PERMISSION_DENIED
    naming the flag, nothing changed; an API key is needed like on every /v1 route."""
    body = {"lora_name": "more", "lora_path": adapter_path(model, "sql")}
    async with http(stacks["unified"], key=None) as web:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            refused = await web.post(path, json=body)
            assert refused.status_code == 403, refused.text
            assert "--allow-runtime-lora-updating" in refused.json()["error"]["message"]
    async with grpc.aio.insecure_channel(stacks["unified"].gateway.server.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.LoadLoraAdapter(
                gateway_pb2.GatewayLoadLoraAdapterRequest(lora_name="more", lora_path="/x")
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert await worker_adapters(stacks["unified"]) == [ADAPTERS]
    async with http(runtime["unified"], key=None) as web:
        assert (await web.post("/v1/load_lora_adapter", json=body)).status_code == 401


async def test_a_bad_adapter_is_400_with_the_reason_and_loaded_nowhere(
    runtime: dict[str, InProcessStack], model: Path
) -> None:
    stack = runtime["disaggregated"]
    async with http(stack) as web:
        bad = await web.post(
            "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(model.parent / "nope")}
        )
        assert bad.status_code == 400, bad.text
        assert "no adapter_config.json" in bad.json()["error"]["message"]
        missing = await web.post("/v1/load_lora_adapter", json={"lora_name": "sql"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
        assert (await web.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})).status_code == 404
        listed = (await web.get("/v1/models")).json()["data"]
    assert [c["id"] for c in listed] == [model.name]
    assert await worker_adapters(stack) == [(), ()]


async def test_loading_twice_is_a_conflict_and_grpc_answers_like_http(
    runtime: dict[str, InProcessStack], model: Path
) -> None:
    stack = runtime["disaggregated"]
    async with grpc.aio.insecure_channel(stack.gateway.server.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        auth = (("authorization", f"Bearer {KEY}"),)
        request = gateway_pb2.GatewayLoadLoraAdapterRequest(
            lora_name="chat", lora_path=adapter_path(model, "chat")
        )
        loaded = await stub.LoadLoraAdapter(request, metadata=auth, timeout=60)
        assert sorted(loaded.worker_ids) == sorted(w.worker_id for w in stack.workers)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.LoadLoraAdapter(request, metadata=auth, timeout=60)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "already loaded" in (
            err.value.details() or ""
        )
        async with http(stack) as web:
            again = await web.post(
                "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/elsewhere"}
            )
            assert again.status_code == 409, again.text
        unloaded = await stub.UnloadLoraAdapter(
            gateway_pb2.GatewayUnloadLoraAdapterRequest(lora_name="chat", model=model.name),
            metadata=auth,
            timeout=60,
        )
        assert sorted(unloaded.worker_ids) == sorted(loaded.worker_ids)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.UnloadLoraAdapter(
                gateway_pb2.GatewayUnloadLoraAdapterRequest(lora_name="chat"), metadata=auth
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert await worker_adapters(stack) == [(), ()]


@pytest.mark.parametrize("mode", MODES)
async def test_an_adapter_is_not_unloaded_while_a_request_of_it_runs(
    runtime: dict[str, InProcessStack], model: Path, mode: str
) -> None:
    """Refused (409, FAILED_PRECONDITION) while a stream of it runs, everything left as it was
    (disaggregated: the prefill worker, which had finished its part, loads it again); once the
    stream ended, the unload goes through."""
    stack = runtime[mode]
    async with http(stack) as web:
        body = {"lora_name": "sql", "lora_path": adapter_path(model, "sql")}
        assert (await web.post("/v1/load_lora_adapter", json=body)).status_code == 200
        api = openai.AsyncOpenAI(base_url=f"{stack.gateway.http_url}/v1", api_key=KEY, max_retries=0)
        stream = await api.completions.create(
            model="sql",
            prompt=PROMPT,
            max_tokens=1500,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            break  # running now, with tokens to go
        refused = await web.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert refused.status_code == 409, refused.text
        assert "queued or running" in refused.json()["error"]["message"]
        assert await worker_adapters(stack) == [("sql",)] * len(ROLES[mode])
        await stream.close()  # the client goes away: the request is aborted on the workers
        await api.close()
        for _ in range(100):
            gone = await web.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            if gone.status_code != 409:
                break
            await asyncio.sleep(0.05)  # the abort is on its way
        assert gone.status_code == 200, gone.text
    assert await worker_adapters(stack) == [()] * len(ROLES[mode])
