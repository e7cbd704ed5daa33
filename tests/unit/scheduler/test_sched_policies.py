"""Each routing policy as a pure function."""

from __future__ import annotations

import random
from collections import Counter

from services.scheduler import policies
from services.scheduler.policies import Balance


def test_round_robin_cycles() -> None:
    assert [policies.round_robin(3, t) for t in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_random_is_uniform_and_seeded() -> None:
    rng = random.Random(7)
    picks = Counter(policies.random_pick(4, rng) for _ in range(4000))
    assert set(picks) == {0, 1, 2, 3}
    assert min(picks.values()) > 850
    a = [policies.random_pick(10, random.Random(3)) for _ in range(3)]
    assert a == [policies.random_pick(10, random.Random(3)) for _ in range(3)]


def test_least_loaded_lowest_index_on_ties() -> None:
    assert policies.least_loaded([5, 2, 2, 9]) == 1


def test_power_of_two_picks_the_lighter_of_two_distinct() -> None:
    rng = random.Random(0)
    loads = [100, 0, 100, 100]
    picks = Counter(policies.power_of_two(loads, rng) for _ in range(2000))
    # Worker 1 wins every draw that includes it (3/6 of the pairs), never loses.
    assert 0.4 < picks[1] / 2000 < 0.6
    assert policies.power_of_two([5], rng) == 0
    # Two candidates: always the lighter one, ties to the lower index.
    assert {policies.power_of_two([3, 1], rng) for _ in range(50)} == {1}
    assert {policies.power_of_two([2, 2], rng) for _ in range(50)} == {0}


def test_cache_aware_prefers_longest_match_least_loaded() -> None:
    balance = Balance(abs_tokens=1000, rel=1.5)
    assert policies.cache_aware([500, 300, 400], matched=[0, 2], balance=balance) == 2
    assert policies.cache_aware([500, 300, 400], matched=[], balance=balance) == 1


def test_cache_aware_falls_back_to_least_loaded_when_unbalanced() -> None:
    balance = Balance(abs_tokens=1000, rel=1.5)
    # Worker 0 holds the prefix but has 5000 tokens more than worker 1: spread wins.
    assert policies.cache_aware([6000, 1000, 3000], matched=[0], balance=balance) == 1
    # Both thresholds must be exceeded: a large absolute gap with a small ratio is balanced.
    assert not policies.is_unbalanced(98_000, 100_000, balance)
    assert not policies.is_unbalanced(100, 600, balance)  # large ratio, small gap
    assert policies.is_unbalanced(1000, 6000, balance)
    # Precomputed least/max (as the router passes them) give the same answer.
    loads = [6000, 1000, 3000]
    assert policies.cache_aware(loads, [0], balance, least=1, max_load=6000) == 1


def test_min_tokens_fewest_then_lowest_rank() -> None:
    assert policies.min_tokens([30, 10, 20]) == 1
    assert policies.min_tokens([10, 5, 5, 7]) == 1
    assert policies.min_tokens([0, 0]) == 0


def test_rank_round_robin_and_hash() -> None:
    assert [policies.rank_round_robin(2, t) for t in range(4)] == [0, 1, 0, 1]
    assert policies.rank_hash("req-1", 4) == policies.rank_hash("req-1", 4)
    spread = Counter(policies.rank_hash(f"req-{i}", 4) for i in range(400))
    assert set(spread) == {0, 1, 2, 3}


def test_candidates_holding_maps_ids_to_indices() -> None:
    assert policies.candidates_holding(["b", "x", "a"], {"a": 0, "b": 1}) == [1, 0]


def test_cache_aware_ignores_a_match_shorter_than_the_minimum_share() -> None:
    balance = policies.Balance(min_match_share=0.5)
    # worker 0 holds 1 of the prompt's 6 blocks (a chat template's system prompt): least loaded wins
    assert policies.cache_aware([500, 300], matched=[0], balance=balance, match_share=1 / 6) == 1
    # half the prompt or more: the match wins over a moderate load difference
    assert policies.cache_aware([500, 300], matched=[0], balance=balance, match_share=0.5) == 0
    assert policies.cache_aware([500, 300], matched=[0], balance=policies.Balance(min_match_share=0.0)) == 0


def test_unified_split_prefills_on_the_least_loaded_and_decodes_on_the_next() -> None:
    loads = [900, 100, 400]
    assert policies.unified_split(loads, least=1, uncached_tokens=300, threshold=256) == (1, 2)
    assert policies.unified_split(loads, least=1, uncached_tokens=255, threshold=256) is None
    assert policies.unified_split(loads, least=1, uncached_tokens=10_000, threshold=0) is None  # off
    assert policies.unified_split([100], least=0, uncached_tokens=300, threshold=256) is None
    assert policies.unified_split([7, 7, 7], least=0, uncached_tokens=300, threshold=1) == (
        0,
        1,
    )  # ties: lowest
