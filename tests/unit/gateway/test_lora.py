"""LoRA adapters at the gateway (no grpc servers): the cards (one per adapter, parent = its base
model, max_model_len the smallest of its workers'), the lookup that finds an adapter whose workers
just registered, validation of `model`, and the request life of an adapter's request: scheduled
under the adapter's name, prefix hashes rooted at the adapter's chain root, the adapter sent to
every worker run (a migration too), and never to a worker lacking the "lora" capability."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from services.gateway import convert
from services.gateway.capabilities import needed_capabilities
from services.gateway.dispatch import Dispatcher
from services.gateway.http_responses import model_list
from services.gateway.model_cards import ModelCards
from services.gateway.ports import ModelCard, PrefillResult, WorkerTarget, WorkerUnavailable
from services.gateway.request import RequestState
from services.gateway.service import GatewayService
from services.gateway.settings import GatewaySettings
from services.gateway.tokenization import PromptTokenizer
from services.gateway.validation import Limits, validate_input, validate_model
from shared.block_hash import block_hashes, chain_root
from shared.cluster import FinishReason
from shared.errors import NotFound, ResourceExhausted, Unavailable
from shared.proto import common_pb2, scheduler_pb2

from .test_dispatch import (
    ADMITTED,
    DECODE,
    DECODE2,
    PREFILL,
    FakeScheduler,
    FakeStream,
    FakeWorkers,
    agg,
    disagg,
    final,
    prepared,
    tokens,
)
from .test_model_cards import Clock, Lister

LORA_CAPS = ("generated_tokens", "first_output_index", "cache_salt", "lora")


def state_of(*workers: tuple[str, int, tuple[str, ...]]) -> scheduler_pb2.GetStateResponse:
    """GetState listing workers as (model_id, max_model_len, lora_adapters)."""
    return scheduler_pb2.GetStateResponse(
        workers=[
            scheduler_pb2.SchedulerWorker(
                info=common_pb2.WorkerInfo(
                    worker_id=f"w{i}", model_id=model, max_model_len=max_len, lora_adapters=adapters
                )
            )
            for i, (model, max_len, adapters) in enumerate(workers)
        ]
    )


def test_cards_list_each_adapter_under_its_base_model() -> None:
    state = state_of(("m", 4096, ("sql", "chat")), ("m", 2048, ("sql",)), ("m", 0, ()), ("other", 512, ()))
    assert convert.model_cards(state) == [
        ModelCard("m", 2048),
        ModelCard("other", 512),
        ModelCard("chat", 4096, "m"),  # the smallest of the workers listing it, not of "m"'s
        ModelCard("sql", 2048, "m"),
    ]
    # a name that is also a base model id is that model; a name on two base models belongs to
    # the one more workers list it on (the scheduler's rule: it routes it only there)
    state = state_of(("m", 100, ("other", "x")), ("m", 100, ("x",)), ("other", 50, ("x",)))
    assert convert.model_cards(state) == [
        ModelCard("m", 100),
        ModelCard("other", 50),
        ModelCard("x", 100, "m"),
    ]


def test_list_models_sets_parent_only_for_adapters() -> None:
    pb = convert.list_models_response([ModelCard("m", 2048), ModelCard("sql", 1024, "m")])
    base, adapter = pb.models
    assert not base.HasField("parent")
    assert (adapter.id, adapter.max_model_len, adapter.parent) == ("sql", 1024, "m")
    http = model_list([ModelCard("m", 2048), ModelCard("sql", 0, "m")], created=7).data
    assert [(c.id, c.root, c.parent, c.max_model_len) for c in http] == [
        ("m", "m", None, 2048),
        ("sql", "sql", "m", None),
    ]


def test_validation_accepts_the_served_model_and_its_adapters_only() -> None:
    validate_model("", "tiny", ["sql"])
    validate_model("tiny", "tiny", ["sql"])
    validate_model("sql", "tiny", ["sql"])
    with pytest.raises(NotFound) as err:
        validate_model("chat", "tiny", ["sql", "b-lora"])
    assert str(err.value) == (
        "model 'chat' is not served here; this deployment serves 'tiny' and its LoRA adapters "
        "['b-lora', 'sql'] (ListModels lists them; leave model empty to use the base model)"
    )
    with pytest.raises(NotFound, match=r"serves 'tiny' \(ListModels"):
        validate_model("sql", "tiny")  # no adapters: the message names only the model
    from services.gateway.inputs import GenerateInput

    validate_input(GenerateInput(model="sql", prompt="x"), Limits(), "tiny", ["sql"])


async def test_a_name_new_to_the_cards_refreshes_them_at_most_once_per_interval() -> None:
    lister = Lister(
        [
            [ModelCard("m", 24)],
            [ModelCard("m", 24), ModelCard("sql", 16, "m")],  # its workers just registered
            [ModelCard("m", 24), ModelCard("sql", 16, "m"), ModelCard("chat", 8, "m")],
        ]
    )
    clock = Clock()
    cards = ModelCards(lister, ttl_s=5.0, clock=clock, miss_refresh_s=1.0)
    assert await cards.lookup("m", 1.0) == ModelCard("m", 24)
    assert await cards.lookup("sql", 1.0) is None  # fetched 0 s ago: not again
    assert lister.calls == 1
    clock.now_s = 1.0
    assert await cards.lookup("sql", 1.0) == ModelCard("sql", 16, "m")  # a fresh fetch, awaited
    assert lister.calls == 2
    for _ in range(5):  # a flood of unknown names: no fetch within the interval
        assert await cards.lookup("nope", 1.0) is None
    assert lister.calls == 2
    assert cards.adapters_of("m") == ["sql"] and cards.adapters_of("sql") == []
    clock.now_s = 2.5
    assert await cards.lookup("chat", 1.0) == ModelCard("chat", 8, "m")
    assert await cards.max_model_len("chat", 1.0) == 8
    assert cards.adapters_of("m") == ["chat", "sql"]
    await cards.close()


async def test_an_adapter_request_is_scheduled_hashed_and_sent_under_its_adapter() -> None:
    """And a decode worker that dies mid-stream: the migrated run keeps the adapter, and its
    prefix hashes (prompt + generated tokens) stay under the adapter's root."""
    lora_decode = dataclasses.replace(DECODE, capabilities=LORA_CAPS)
    lora_decode2 = dataclasses.replace(DECODE2, capabilities=LORA_CAPS)
    lora_prefill = dataclasses.replace(PREFILL, capabilities=LORA_CAPS)
    workers = FakeWorkers(
        streams={
            DECODE.address: [FakeStream([ADMITTED, tokens("b", 2), WorkerUnavailable("died", "d1")])],
            DECODE2.address: [FakeStream([ADMITTED, final("d", 1, FinishReason.LENGTH)])],
        },
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None), PrefillResult("c", (3,), 1, None)]},
    )
    placements = [dataclasses.replace(disagg(d), prefill=lora_prefill) for d in (lora_decode, lora_decode2)]
    sched = FakeScheduler(list(placements))
    req = prepared(max_tokens=4, prompt_len=20)
    req = dataclasses.replace(
        req, model="sql", sampling=dataclasses.replace(req.sampling, lora_adapter="sql", cache_salt="t")
    )
    state = RequestState(req.request_id, req.prompt_token_ids, False, "sql")
    frames = [f async for f in Dispatcher(sched, workers, block_size=4).run(req, state, None)]
    assert "".join(f.text for f in frames) == "abcd" and {f.model for f in frames} == {"sql"}
    assert [q.model for q in sched.queries] == ["sql", "sql"]
    root = chain_root("t", "sql")
    assert root != chain_root("t") and root != chain_root("", "sql")
    assert sched.queries[0].prefix_block_hashes == tuple(block_hashes(range(20), 4, root))
    migrated_prompt = (*range(20), 1, 2)
    assert sched.queries[1].prefix_block_hashes == tuple(block_hashes(migrated_prompt, 4, root))
    assert len(workers.jobs) == 4 and {j.sampling.lora_adapter for j in workers.jobs} == {"sql"}
    assert workers.jobs[-1].prompt_token_ids == migrated_prompt


async def test_a_worker_without_the_lora_capability_never_runs_an_adapter_request() -> None:
    """An older worker would ignore lora_adapter and answer with the base model: skipped like a
    worker lacking any needed capability, then the request refused naming what is missing."""
    old = WorkerTarget("old", "old:1", 0, ("generated_tokens", "cache_salt"))
    new = WorkerTarget("d2", "decode:2", 0, LORA_CAPS)
    workers = FakeWorkers(streams={new.address: [FakeStream([tokens("a", 1), final("b", 2)])]})
    req = prepared()
    req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, lora_adapter="sql"))
    assert needed_capabilities(req.sampling) == {"lora"}
    state = RequestState(req.request_id, req.prompt_token_ids, False, "sql")
    sched = FakeScheduler([agg(old), agg(new)])
    frames = [f async for f in Dispatcher(sched, workers, block_size=4).run(req, state, None)]
    assert "".join(f.text for f in frames) == "ab"
    assert sched.queries[1].exclude_worker_ids == ("old",) and len(workers.jobs) == 1
    with pytest.raises(ResourceExhausted, match="lacks lora"):
        state = RequestState(req.request_id, req.prompt_token_ids, False, "sql")
        sched = FakeScheduler([agg(old)] * 3)
        async for _ in Dispatcher(sched, FakeWorkers(), block_size=4).run(req, state, None):
            pass


async def test_the_service_resolves_model_to_an_adapter_or_refuses_it() -> None:
    """The base model's id or nothing: no adapter, no fetch; a listed adapter of the served model:
    its name; an adapter of another base model, or nothing listed: NOT_FOUND; the scheduler never
    answered: UNAVAILABLE (unknown is not missing)."""
    tokenizer = PromptTokenizer(object(), "m", 100)
    none: Any = None
    lister = Lister([[ModelCard("m", 24), ModelCard("sql", 24, "m"), ModelCard("x", 8, "other")]])
    service = GatewayService(GatewaySettings(), lister, none, tokenizer)
    assert await service.lora_adapter("") == "" and await service.lora_adapter("m") == ""
    assert lister.calls == 0
    assert await service.lora_adapter("sql") == "sql"
    with pytest.raises(
        NotFound, match=r"'x' is not served here; this deployment serves 'm' and its LoRA adapters \['sql'\]"
    ):
        await service.lora_adapter("x")  # a card, but of a model this gateway does not tokenize for
    await service.close()
    down = GatewayService(GatewaySettings(), Lister([Unavailable("scheduler down")]), none, tokenizer)
    with pytest.raises(Unavailable, match="has not listed the cluster's models yet"):
        await down.lora_adapter("sql")
    await down.close()
