"""The router's decisions: modes, compatibility, ranks, reservations, staleness, errors."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest

from services.scheduler.router import Policies, Router
from shared.cluster import KvLayout, Role, ServingMode
from shared.errors import InvalidArgument, Unavailable
from shared.metrics import PREFILL_MODE, SCHEDULE_DECISIONS
from tests.unit.scheduler.helpers import BF16, request, snapshot, worker


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def router(clock: FakeClock | None = None, **policy: Any) -> Router:
    return Router(Policies(**policy), seed=0, clock=clock or FakeClock())


def test_disaggregated_pair_and_min_tokens_ranks() -> None:
    r = router()
    r.apply_snapshot(snapshot(worker("p1", Role.PREFILL, [500, 100]), worker("d1", Role.DECODE, [0, 40])))
    d = r.schedule(request(prompt_tokens=300))
    assert d.mode is ServingMode.DISAGGREGATED
    assert d.prefill is not None
    assert (d.prefill.worker_id, d.prefill.dp_rank, d.prefill.address) == ("p1", 1, "p1:1")
    assert (d.decode.worker_id, d.decode.dp_rank) == ("d1", 0)
    assert d.model == "m" and d.max_model_len == 2048
    assert d.decode.capabilities == ("generated_tokens",)
    # The reservation moved the minimum: next prefill goes to rank 1 again (100+300 < 500),
    # next decode to rank 1 (40 < 300).
    d2 = r.schedule(request("r2", prompt_tokens=10))
    assert d2.prefill is not None and d2.prefill.dp_rank == 1
    assert d2.decode.dp_rank == 1


def test_min_tokens_ties_break_to_lowest_rank() -> None:
    r = router()
    r.apply_snapshot(snapshot(worker("u", Role.UNIFIED, [0, 0, 0, 0])))
    assert [r.schedule(request(f"r{i}", 100)).decode.dp_rank for i in range(6)] == [0, 1, 2, 3, 0, 1]


def test_burst_between_reports_spreads_by_tokens() -> None:
    r = router()
    r.apply_snapshot(snapshot(worker("u", Role.UNIFIED, [0, 0])))
    sizes = [4000, 100, 100, 100, 3000]
    ranks = [r.schedule(request(f"r{i}", t)).decode.dp_rank for i, t in enumerate(sizes)]
    # 4000 -> 0; 100,100,100 -> 1 (100..300 < 4000); 3000 -> 1 (300 < 4000).
    assert ranks == [0, 1, 1, 1, 1]
    state = r.state()
    assert state.workers[0].reserved_tokens == (4000, 3300)


def test_fresh_report_replaces_the_reservations_it_covers() -> None:
    clock = FakeClock()
    r = router(clock)
    r.apply_snapshot(snapshot(worker("u", Role.UNIFIED, [0, 0])))
    r.schedule(request("a", 1000))  # t=1000 -> rank 0
    clock.now = 1001.0
    r.schedule(request("b", 500))  # t=1001 -> rank 1
    clock.now = 1002.0
    # A report polled 1.5 s ago (t=1000.5) covers "a" but not "b"; it shows "a" running.
    r.apply_snapshot(snapshot(worker("u", Role.UNIFIED, [1000, 0], age_ms=1500)))
    assert r.state().workers[0].reserved_tokens == (0, 500)
    # A newer report covers both.
    r.apply_snapshot(snapshot(worker("u", Role.UNIFIED, [1000, 500], age_ms=0)))
    assert r.state().workers[0].reserved_tokens == (0, 0)
    assert r.schedule(request("c", 1)).decode.dp_rank == 1


@pytest.mark.parametrize("policy", ["round_robin", "hash"])
def test_other_rank_policies(policy: str) -> None:
    r = router(dp_rank=policy)
    r.apply_snapshot(snapshot(worker("u", Role.UNIFIED, [10**6, 0, 0, 0])))
    ranks = [r.schedule(request(f"req-{i}", 10)).decode.dp_rank for i in range(40)]
    assert set(ranks) == {0, 1, 2, 3}  # load-blind: rank 0 gets requests too
    if policy == "round_robin":
        assert ranks[:5] == [0, 1, 2, 3, 0]
    else:
        r2 = router(dp_rank="hash")
        r2.apply_snapshot(snapshot(worker("u", Role.UNIFIED, [0, 0, 0, 0])))
        assert [r2.schedule(request(f"req-{i}", 10)).decode.dp_rank for i in range(40)] == ranks


def test_worker_round_robin_survives_snapshots() -> None:
    r = router(decode="round_robin", prefill="round_robin")
    snap = snapshot(worker("p1", Role.PREFILL), worker("d1", Role.DECODE), worker("d2", Role.DECODE))
    picks = []
    for i in range(4):
        r.apply_snapshot(snap)  # a new snapshot does not restart the turn
        picks.append(r.schedule(request(f"r{i}")).decode.worker_id)
    assert picks == ["d1", "d2", "d1", "d2"]


def test_power_of_two_avoids_the_loaded_worker() -> None:
    r = router(decode="power_of_two")
    r.apply_snapshot(
        snapshot(
            worker("p1", Role.PREFILL),
            worker("d1", Role.DECODE, [50_000, 50_000]),
            worker("d2", Role.DECODE, [0, 0]),
        )
    )
    picks = Counter(r.schedule(request(f"r{i}", 100)).decode.worker_id for i in range(50))
    assert picks == {"d2": 50}


def test_random_worker_policy_uses_every_worker() -> None:
    r = router(decode="random")
    r.apply_snapshot(snapshot(worker("p", Role.PREFILL), *[worker(f"d{i}", Role.DECODE) for i in range(3)]))
    assert {r.schedule(request(f"r{i}")).decode.worker_id for i in range(60)} == {"d0", "d1", "d2"}


def test_cache_aware_routes_a_shared_prefix_to_the_same_worker() -> None:
    r = router(prefill="cache_aware")
    r.apply_snapshot(
        snapshot(worker("p1", Role.PREFILL), worker("p2", Role.PREFILL), worker("d", Role.DECODE))
    )
    first = r.schedule(request("a", 64, hashes=(11, 12, 13, 14)))
    assert first.prefill is not None
    # Loads now differ by 64 tokens (balanced): the same prefix follows the cache...
    again = r.schedule(request("b", 64, hashes=(11, 12, 13, 99)))
    assert again.prefill is not None and again.prefill.worker_id == first.prefill.worker_id
    # ...and an unrelated prompt goes to the least loaded worker.
    other = r.schedule(request("c", 64, hashes=(77,)))
    assert other.prefill is not None and other.prefill.worker_id != first.prefill.worker_id


def test_cache_aware_gives_up_the_cache_when_unbalanced() -> None:
    r = router(prefill="cache_aware")
    r.apply_snapshot(
        snapshot(
            worker("p1", Role.PREFILL, [0, 0]),
            worker("p2", Role.PREFILL, [0, 0]),
            worker("d", Role.DECODE),
        )
    )
    first = r.schedule(request("a", 20_000, hashes=(1, 2)))
    assert first.prefill is not None
    nxt = r.schedule(request("b", 100, hashes=(1, 2)))
    assert nxt.prefill is not None and nxt.prefill.worker_id != first.prefill.worker_id


def test_unified_only_is_aggregated() -> None:
    r = router()
    r.apply_snapshot(snapshot(worker("u1", Role.UNIFIED, [5, 0])))
    d = r.schedule(request())
    assert (d.mode, d.prefill, d.decode.worker_id, d.decode.dp_rank) == (
        ServingMode.AGGREGATED,
        None,
        "u1",
        1,
    )


def test_decode_without_any_prefill_worker_is_aggregated() -> None:
    r = router()
    r.apply_snapshot(snapshot(worker("d1", Role.DECODE)))
    d = r.schedule(request())
    assert (d.mode, d.decode.worker_id) == (ServingMode.AGGREGATED, "d1")


def test_incompatible_pair_is_unavailable_naming_the_layouts() -> None:
    r = router()
    r.apply_snapshot(snapshot(worker("p1", Role.PREFILL, layout=BF16), worker("d1", Role.DECODE)))
    with pytest.raises(Unavailable, match=r"no compatible prefill/decode pair.*bfloat16.*float32"):
        r.schedule(request())
    fp8 = dataclasses.replace(worker("d1", Role.DECODE).info.kv_layout, weights="fp8")
    r.apply_snapshot(snapshot(worker("p1", Role.PREFILL, layout=fp8), worker("d1", Role.DECODE)))
    with pytest.raises(Unavailable, match=r"weights=fp8"):
        r.schedule(request())


@pytest.mark.parametrize(
    "other",
    [
        KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=32, dtype="float32"),
        KvLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32"),
        # FP8 weights compute other KV (--quantization fp8 on one side only)
        KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32", weights="fp8"),
    ],
)
def test_pairs_only_matching_layouts(other: KvLayout) -> None:
    r = router(decode="round_robin")
    r.apply_snapshot(
        snapshot(
            worker("p-other", Role.PREFILL, layout=other),
            worker("p-ok", Role.PREFILL),
            worker("d-other", Role.DECODE, layout=other),
            worker("d-ok", Role.DECODE),
        )
    )
    for i in range(6):
        d = r.schedule(request(f"r{i}"))
        assert d.prefill is not None
        assert d.prefill.worker_id.split("-")[1] == d.decode.worker_id.split("-")[1]


def test_model_mismatch_does_not_pair() -> None:
    r = router()
    r.apply_snapshot(snapshot(worker("p1", Role.PREFILL, model="a"), worker("d1", Role.DECODE, model="b")))
    with pytest.raises(Unavailable, match=r"model 'a' has 1 prefill worker.*no decode or unified"):
        r.schedule(request(model="a"))
    assert r.schedule(request(model="b")).mode is ServingMode.AGGREGATED  # b has no prefill worker
    with pytest.raises(Unavailable, match=r"model 'zzz' is not served.*\['a', 'b'\]"):
        r.schedule(request(model="zzz"))


def test_no_workers_and_no_snapshot() -> None:
    r = router()
    with pytest.raises(Unavailable, match="no load snapshot"):
        r.schedule(request())
    r.apply_snapshot(snapshot())
    with pytest.raises(Unavailable, match="no workers are registered"):
        r.schedule(request())
    r.mark_stale()
    with pytest.raises(Unavailable, match="load-monitor is unreachable"):
        r.schedule(request())


def test_exclude_worker_ids() -> None:
    r = router(decode="round_robin")
    r.apply_snapshot(
        snapshot(
            worker("p1", Role.PREFILL),
            worker("p2", Role.PREFILL),
            worker("d1", Role.DECODE),
            worker("d2", Role.DECODE),
        )
    )
    for i in range(4):
        d = r.schedule(request(f"r{i}", exclude_worker_ids=frozenset({"p1", "d2"})))
        assert d.prefill is not None
        assert (d.prefill.worker_id, d.decode.worker_id) == ("p2", "d1")
    # Every prefill worker excluded: the decode worker prefills itself.
    d = r.schedule(request("x", exclude_worker_ids=frozenset({"p1", "p2"})))
    assert d.mode is ServingMode.AGGREGATED and d.decode.worker_id in {"d1", "d2"}
    with pytest.raises(Unavailable, match="excluded"):
        r.schedule(request("y", exclude_worker_ids=frozenset({"p1", "p2", "d1", "d2"})))


def test_excluded_path_still_reserves_on_the_real_worker() -> None:
    r = router()
    r.apply_snapshot(snapshot(worker("u1", Role.UNIFIED, [0, 0]), worker("u2", Role.UNIFIED, [0, 0])))
    r.schedule(request("a", 700, exclude_worker_ids=frozenset({"u2"})))
    reserved = {w.info.worker_id: w.reserved_tokens for w in r.state().workers}
    assert reserved == {"u1": (700, 0), "u2": (0, 0)}
    # The main pool saw it: the next request avoids u1.
    assert r.schedule(request("b", 10)).decode.worker_id == "u2"


def test_stale_workers_used_only_without_fresh_ones() -> None:
    r = router(prefill="round_robin")
    r.apply_snapshot(snapshot(worker("u-stale", Role.UNIFIED, stale=True), worker("u-fresh", Role.UNIFIED)))
    assert {r.schedule(request(f"r{i}")).decode.worker_id for i in range(4)} == {"u-fresh"}
    r.apply_snapshot(snapshot(worker("u-stale", Role.UNIFIED, stale=True)))
    assert r.schedule(request()).decode.worker_id == "u-stale"


def test_keeps_routing_on_last_snapshot_when_marked_stale() -> None:
    r = router()
    r.apply_snapshot(snapshot(worker("u1", Role.UNIFIED)))
    r.mark_stale()
    assert r.stale and r.state().stale
    assert r.schedule(request()).decode.worker_id == "u1"
    r.apply_snapshot(snapshot(worker("u1", Role.UNIFIED)))
    assert not r.stale


def test_removed_worker_vanishes_with_its_reservations() -> None:
    r = router()
    r.apply_snapshot(snapshot(worker("u1", Role.UNIFIED), worker("u2", Role.UNIFIED)))
    for i in range(4):
        r.schedule(request(f"r{i}", 100))
    r.apply_snapshot(snapshot(worker("u2", Role.UNIFIED)))
    assert {r.schedule(request(f"s{i}")).decode.worker_id for i in range(4)} == {"u2"}
    r.apply_snapshot(snapshot(worker("u1", Role.UNIFIED), worker("u2", Role.UNIFIED)))
    reserved = {w.info.worker_id: w.reserved_tokens for w in r.state().workers}
    assert reserved["u1"] == (0, 0)  # came back clean


def test_local_prefill_when_uncached_part_is_short() -> None:
    r = router(local_prefill_threshold=64)
    r.apply_snapshot(snapshot(worker("p1", Role.PREFILL), worker("d1", Role.DECODE)))
    before = PREFILL_MODE.labels(mode="local")._value.get()
    short = r.schedule(request("a", 40))
    assert (short.mode, short.prefill, short.decode.worker_id) == (ServingMode.LOCAL_PREFILL, None, "d1")
    assert PREFILL_MODE.labels(mode="local")._value.get() == before + 1
    long = r.schedule(request("b", 16 * 10, hashes=tuple(range(10))))
    assert long.mode is ServingMode.DISAGGREGATED
    # The decode worker now holds those 10 blocks: 170 tokens with 160 cached -> 10 uncached.
    cached = r.schedule(request("c", 170, hashes=tuple(range(10))))
    assert cached.mode is ServingMode.LOCAL_PREFILL


def test_default_model_and_metrics() -> None:
    r = router()
    r.apply_snapshot(
        snapshot(
            worker("a1", Role.UNIFIED, model="a"),
            worker("b1", Role.UNIFIED, model="b"),
            worker("b2", Role.UNIFIED, model="b"),
        )
    )
    before = SCHEDULE_DECISIONS.labels(role="dp_rank", policy="min_tokens")._value.get()
    assert r.schedule(request()).model == "b"  # the model with the most workers
    assert SCHEDULE_DECISIONS.labels(role="dp_rank", policy="min_tokens")._value.get() == before + 1


def test_negative_prompt_rejected() -> None:
    with pytest.raises(InvalidArgument):
        router().schedule(request(prompt_tokens=-1))


def test_unknown_policy_rejected() -> None:
    with pytest.raises(ValueError, match="decode policy 'nope'"):
        Policies(decode="nope")


def test_least_loaded_tracking_matches_a_scan() -> None:
    """The pool's heap of loads agrees with a plain scan after many reservations."""
    r = router(prefill="cache_aware")
    workers = [worker(f"p{i}", Role.PREFILL, [i * 100, 0]) for i in range(7)]
    r.apply_snapshot(snapshot(*workers, worker("d", Role.DECODE)))
    sizes = [(i * 7919) % 3000 + 1 for i in range(200)]
    for i, size in enumerate(sizes):
        state = {
            w.info.worker_id: sum(x.num_used_tokens for x in w.ranks) + sum(w.reserved_tokens)
            for w in r.state().workers
            if w.info.role is Role.PREFILL
        }
        expected = min(sorted(state), key=lambda wid: (state[wid], int(wid[1:])))
        d = r.schedule(request(f"r{i}", size))  # no prefix hashes: least loaded
        assert d.prefill is not None and d.prefill.worker_id == expected


def test_reservations_just_before_a_poll_survive_it() -> None:
    """A request routed moments before the worker was polled may not show in that report yet:
    reservations younger than reservation_grace_s at poll time are kept."""
    clock = FakeClock()
    r = router(clock, reservation_grace_s=0.05)
    r.apply_snapshot(snapshot(worker("u", Role.UNIFIED, [0, 0])))
    r.schedule(request("a", 300))  # t = 1000.00
    clock.now = 1000.1
    r.apply_snapshot(snapshot(worker("u", Role.UNIFIED, [0, 0], age_ms=80)))  # polled at 1000.02
    assert r.state().workers[0].reserved_tokens == (300, 0)
    r.apply_snapshot(snapshot(worker("u", Role.UNIFIED, [300, 0], age_ms=0)))  # polled at 1000.1
    assert r.state().workers[0].reserved_tokens == (0, 0)


def test_a_one_block_template_prefix_does_not_pile_requests_on_one_unified_worker() -> None:
    """Every chat request starts with the template's default system prompt (one shared block).
    cache_aware once followed that block: a burst all went to the first worker that held it."""
    # aggregated serving (the unified split off): this is about which worker runs the request
    r = router(prefill="cache_aware", unified_disaggregate_threshold=0)
    r.apply_snapshot(snapshot(worker("u1", Role.UNIFIED, [0]), worker("u2", Role.UNIFIED, [0])))
    chosen = Counter(
        r.schedule(request(f"r{i}", 16 * 8, hashes=(1, *range(100 * i, 100 * i + 7)))).decode.worker_id
        for i in range(10)
    )
    assert chosen == {"u1": 5, "u2": 5}
    # a real shared prefix (6 of 8 blocks) still follows the cache
    r.schedule(request("s0", 16 * 8, hashes=(*range(900, 906), 1, 2)))
    again = r.schedule(request("s1", 16 * 8, hashes=(*range(900, 906), 3, 4)))
    first = r.schedule(request("s2", 16 * 8, hashes=(*range(900, 906), 5, 6)))
    assert again.decode.worker_id == first.decode.worker_id


def test_unified_workers_split_long_prompts_and_keep_short_ones_aggregated() -> None:
    r = router(unified_disaggregate_threshold=256)
    r.apply_snapshot(
        snapshot(
            worker("u1", Role.UNIFIED, [3000]),
            worker("u2", Role.UNIFIED, [100]),
            worker("u3", Role.UNIFIED, [900]),
        )
    )
    long = r.schedule(request("long", 400))
    assert long.mode is ServingMode.DISAGGREGATED
    assert long.prefill is not None
    # the least loaded prefills, the least loaded of the others decodes
    assert (long.prefill.worker_id, long.decode.worker_id) == ("u2", "u3")
    short = r.schedule(request("short", 100))
    assert (short.mode, short.prefill) == (ServingMode.AGGREGATED, None)
    # a prompt mostly cached on the would-be prefill worker is short enough to stay aggregated
    r2 = router(unified_disaggregate_threshold=256)
    r2.apply_snapshot(snapshot(worker("u1", Role.UNIFIED, [0]), worker("u2", Role.UNIFIED, [5000])))
    hashes = tuple(range(20))
    assert r2.schedule(request("a", 16 * 20 + 8, hashes=hashes)).mode is ServingMode.DISAGGREGATED
    assert r2.schedule(request("b", 16 * 20 + 8, hashes=hashes)).mode is ServingMode.AGGREGATED


def test_unified_split_defaults_to_128_tokens_turns_off_at_0_and_needs_two_workers() -> None:
    r = router()
    r.apply_snapshot(snapshot(worker("u1", Role.UNIFIED), worker("u2", Role.UNIFIED)))
    assert r.schedule(request("a", 128)).mode is ServingMode.DISAGGREGATED
    assert r.schedule(request("b", 127)).mode is ServingMode.AGGREGATED
    off = router(unified_disaggregate_threshold=0)
    off.apply_snapshot(snapshot(worker("u1", Role.UNIFIED), worker("u2", Role.UNIFIED)))
    assert off.schedule(request("a", 4000)).mode is ServingMode.AGGREGATED
    one = router(unified_disaggregate_threshold=1)
    one.apply_snapshot(snapshot(worker("u1", Role.UNIFIED)))
    assert one.schedule(request("a", 4000)).mode is ServingMode.AGGREGATED
    with pytest.raises(ValueError, match="unified_disaggregate_threshold"):
        Policies(unified_disaggregate_threshold=-1)
