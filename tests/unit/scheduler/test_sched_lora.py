"""LoRA adapters in routing (pure, no grpc): a request naming an adapter is served only by workers
that list it, prefill and decode alike, with the base model's roles and pairing rules; workers
without adapters (older ones too) never get such a request; reservations count on the worker in
every pool it is in; the default model is never an adapter; conflicting names resolve the same
way for the scheduler and the gateway's cards (shared.cluster.lora_adapter_bases)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest

from services.scheduler.pools import PoolWorker, build_pools
from services.scheduler.router import Policies, Router
from shared.cluster import Role, ServingMode, WorkerLoad, lora_adapter_bases
from shared.errors import Unavailable
from tests.unit.scheduler.helpers import BF16, request, snapshot, worker


def with_adapters(w: WorkerLoad, *adapters: str) -> WorkerLoad:
    return dataclasses.replace(w, info=dataclasses.replace(w.info, lora_adapters=adapters))


def router(*workers: WorkerLoad, **policy: Any) -> Router:
    r = Router(Policies(**policy), seed=0, clock=lambda: 1000.0)
    r.apply_snapshot(snapshot(*workers))
    return r


def test_an_adapter_request_goes_only_to_workers_listing_it() -> None:
    r = router(
        with_adapters(worker("p-lora", Role.PREFILL), "sql"),
        worker("p-plain", Role.PREFILL),
        with_adapters(worker("d-lora", Role.DECODE), "sql", "chat"),
        worker("d-plain", Role.DECODE),
        prefill="round_robin",
        decode="round_robin",
    )
    pairs: Counter[tuple[str, str]] = Counter()
    for i in range(20):
        d = r.schedule(request(f"a{i}", 50, model="sql"))
        assert d.mode is ServingMode.DISAGGREGATED and d.prefill is not None
        assert d.model == "sql" and d.max_model_len == 2048
        pairs[(d.prefill.worker_id, d.decode.worker_id)] += 1
    assert pairs == Counter({("p-lora", "d-lora"): 20})
    # the base model's requests still use every worker
    base: Counter[str] = Counter()
    for i in range(20):
        d = r.schedule(request(f"b{i}", 50))
        assert d.model == "m" and d.prefill is not None
        base[d.prefill.worker_id] += 1
        base[d.decode.worker_id] += 1
    assert set(base) == {"p-lora", "p-plain", "d-lora", "d-plain"}


def test_an_adapter_only_the_decode_side_lists_is_served_aggregated_or_not_at_all() -> None:
    """No prefill worker lists it: nothing pairs, so a unified worker listing it serves it
    aggregated; without one the request is refused, naming the missing half."""
    p = worker("p", Role.PREFILL)
    d = with_adapters(worker("d", Role.DECODE), "sql")
    u = with_adapters(worker("u", Role.UNIFIED), "sql")
    decision = router(p, d, u).schedule(request(model="sql"))
    assert decision.mode is ServingMode.AGGREGATED and decision.decode.worker_id == "u"
    # only a decode worker has it: the adapter has no prefill worker at all, so that decode
    # worker serves it aggregated (as a model without prefill workers)
    decision = router(p, d).schedule(request(model="sql"))
    assert decision.mode is ServingMode.AGGREGATED and decision.decode.worker_id == "d"
    # only a prefill worker has it
    with pytest.raises(Unavailable, match=r"model 'sql' has 1 prefill worker\(s\) but no decode"):
        router(with_adapters(worker("p", Role.PREFILL), "sql"), worker("d", Role.DECODE)).schedule(
            request(model="sql")
        )


def test_an_adapter_pair_needs_matching_kv_layouts_like_its_base_model() -> None:
    r = router(
        with_adapters(worker("p", Role.PREFILL, layout=BF16), "sql"),
        with_adapters(worker("d", Role.DECODE), "sql"),
        worker("p32", Role.PREFILL),  # pairs with d for the base model, but lacks the adapter
    )
    assert r.schedule(request(model="m")).mode is ServingMode.DISAGGREGATED
    with pytest.raises(Unavailable, match=r"no compatible prefill/decode pair for model 'sql'"):
        r.schedule(request(model="sql"))


def test_old_workers_never_get_an_adapter_request() -> None:
    """A worker older than 1.13 registers no lora_adapters (and no "lora" capability): however
    idle it is, adapter requests avoid it; with the new worker excluded there is nothing left."""
    old = worker("old", Role.UNIFIED, [0, 0])
    new = with_adapters(worker("new", Role.UNIFIED, [5000, 5000]), "sql")
    r = router(old, new, prefill="power_of_two", unified_disaggregate_threshold=0)
    assert {r.schedule(request(f"a{i}", 10, model="sql")).decode.worker_id for i in range(30)} == {"new"}
    with pytest.raises(Unavailable, match="every worker of model 'sql' is excluded"):
        r.schedule(request(model="sql", exclude_worker_ids=frozenset({"new"})))


def test_unknown_model_message_lists_models_and_adapters_apart() -> None:
    r = router(with_adapters(worker("u", Role.UNIFIED), "sql", "chat"), worker("v", Role.UNIFIED, model="b"))
    with pytest.raises(Unavailable) as err:
        r.schedule(request(model="nope"))
    assert str(err.value) == (
        "model 'nope' is not served by any worker; served models: ['b', 'm'], LoRA adapters: ['chat', 'sql']"
    )


def test_the_default_model_is_a_base_model_even_when_an_adapter_sorts_last() -> None:
    # every worker of "m" lists "zz": equal counts, and the id breaks ties (max): "zz" would win
    r = router(
        with_adapters(worker("u1", Role.UNIFIED), "zz"), with_adapters(worker("u2", Role.UNIFIED), "zz")
    )
    assert r.schedule(request()).model == "m"


def test_a_reservation_counts_in_every_pool_the_worker_is_in() -> None:
    """An adapter request's prompt tokens load the worker for base-model requests too."""
    a = with_adapters(worker("a", Role.UNIFIED, [0]), "sql")
    b = worker("b", Role.UNIFIED, [100])
    r = router(a, b, prefill="power_of_two", unified_disaggregate_threshold=0)
    assert r.schedule(request("x", 1000, model="sql")).decode.worker_id == "a"
    # power of two over two workers picks the less loaded: b (100) now, not a (1000)
    assert r.schedule(request("y", 10)).decode.worker_id == "b"
    assert [w.reserved_tokens for w in r.state().workers] == [(1000,), (10,)]


def test_max_model_len_of_an_adapter_is_its_workers() -> None:
    r = router(
        with_adapters(worker("u1", Role.UNIFIED, max_model_len=4096), "sql"),
        worker("u2", Role.UNIFIED, max_model_len=1024),
    )
    assert r.schedule(request(model="sql")).max_model_len == 4096


def test_conflicting_names_resolve_to_one_base_model() -> None:
    """An adapter name that is a base model id is that model; a name on two base models belongs
    to the one with more workers listing it (ties: the smaller id), and its pools hold only that
    model's workers: no pair of a prefill of one base model with a decode of the other."""
    infos = [
        with_adapters(worker("a1", Role.PREFILL, model="a"), "x", "b").info,
        with_adapters(worker("a2", Role.DECODE, model="a"), "x").info,
        with_adapters(worker("c1", Role.PREFILL, model="c"), "x", "y").info,
        with_adapters(worker("b1", Role.DECODE, model="b"), "y").info,
    ]
    assert lora_adapter_bases(infos) == {"x": "a", "y": "b"}  # y: a tie between b and c
    pools = build_pools((PoolWorker(i, (), [], False) for i in infos), mirror=False)
    assert {w.info.worker_id for w in pools["x"].members} == {"a1", "a2"}
    assert pools["x"].parent == "a" and pools["b"].parent == ""
    assert {w.info.worker_id for w in pools["b"].members} == {"b1"}  # not a1's adapter "b"
    assert {w.info.worker_id for w in pools["y"].members} == {"b1"}


def test_an_adapter_loaded_at_runtime_keeps_the_workers_state_and_joins_its_pool() -> None:
    """A worker that registers again with another adapter list (loaded or unloaded while it
    runs) is the same worker: its reservations and cached prefixes stand, and the adapter's pool
    follows its list; any other change of identity starts it clean."""
    plain = worker("u", Role.UNIFIED)
    r = router(plain, decode="cache_aware")
    hashes = (11, 22, 33, 44)
    r.schedule(request("a", 100, hashes))
    assert r.state().workers[0].reserved_tokens == (100, 0)
    loaded = with_adapters(plain, "sql")
    r.apply_snapshot(snapshot(loaded))
    assert r.state().workers[0].reserved_tokens == (100, 0)
    assert r._prefix.matched_blocks(hashes, "u") == len(hashes)
    assert r.schedule(request("b", 10, model="sql")).decode.worker_id == "u"
    r.apply_snapshot(snapshot(plain))  # unloaded
    with pytest.raises(Unavailable):
        r.schedule(request("c", 10, model="sql"))
    moved = dataclasses.replace(plain, info=dataclasses.replace(plain.info, address="u:2"))
    r.apply_snapshot(snapshot(moved))
    assert r.state().workers[0].reserved_tokens == (0, 0)
    assert r._prefix.matched_blocks(hashes, "u") == 0
