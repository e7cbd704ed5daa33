"""Reservations and the prefix index."""

from __future__ import annotations

from services.scheduler.prefix_index import PrefixIndex, sampled_depths
from services.scheduler.reservations import Reservations


def test_reservations_add_and_cover_by_time() -> None:
    r = Reservations()
    r.add("w", 2, 0, 100, now_s=1.0)
    r.add("w", 2, 1, 50, now_s=2.0)
    r.add("w", 2, 0, 10, now_s=3.0)
    assert r.totals("w", 2) == [110, 50]
    r.cover("w", reported_at_s=2.0)  # a report polled at t=2 already counts the first two
    assert r.totals("w", 2) == [10, 0]
    r.cover("w", reported_at_s=10.0)
    assert r.totals("w", 2) == [0, 0]
    assert r.totals("unknown", 3) == [0, 0, 0]


def test_reservations_forget_and_retain() -> None:
    r = Reservations()
    r.add("a", 1, 0, 5, 0.0)
    r.add("b", 1, 0, 7, 0.0)
    r.retain({"b"})
    assert r.totals("a", 1) == [0]
    assert r.totals("b", 1) == [7]
    r.forget("b")
    assert r.totals("b", 1) == [0]


def test_reservations_reset_when_dp_size_changes() -> None:
    r = Reservations()
    r.add("a", 2, 1, 5, 0.0)
    r.add("a", 4, 3, 1, 0.0)
    assert r.totals("a", 4) == [0, 0, 0, 1]


def test_sampled_depths() -> None:
    assert sampled_depths(0) == ()
    assert sampled_depths(1) == (1,)
    assert sampled_depths(5) == (5, 4, 2, 1)
    assert sampled_depths(100) == (100, 96, 64, 32, 16, 8, 4, 2, 1)
    assert sampled_depths(64) == (64, 32, 16, 8, 4, 2, 1)


def test_prefix_index_longest_match_among_candidates() -> None:
    idx = PrefixIndex()
    idx.record("a", [1, 2, 3])
    idx.record("b", [1, 2])
    idx.record("c", [1, 2, 3, 4])
    assert idx.longest_match([1, 2, 3, 4, 5], {"a", "b", "c"}) == (["c"], 4)
    # Depth 3 is not a sampled depth of a 5-block prompt: a and b both match at depth 2.
    found, depth = idx.longest_match([1, 2, 3, 4, 5], {"a", "b"})
    assert (sorted(found), depth) == (["a", "b"], 2)
    assert idx.longest_match([1, 2, 3], {"a", "b"}) == (["a"], 3)
    assert idx.longest_match([7, 8], {"a"}) == ([], 0)
    assert idx.matched_blocks([1, 2, 3, 4], "c") == 4
    assert idx.matched_blocks([1, 2, 3, 4], "b") == 2
    assert idx.matched_blocks([1], "nobody") == 0


def test_prefix_index_long_shared_prefix() -> None:
    idx = PrefixIndex()
    system = list(range(1000, 1070))  # 70 shared blocks
    idx.record("a", [*system, *range(1, 31)])
    idx.record("b", list(range(5000, 5100)))
    # The shared part is found at the deepest sampled depth inside it (64 of 70 blocks).
    assert idx.longest_match([*system, 7, 8, 9], {"a", "b"}) == (["a"], 64)
    assert idx.matched_blocks([*system, 7], "a") == 64


def test_prefix_index_evicts_least_recent_and_forgets() -> None:
    idx = PrefixIndex(max_prefixes_per_worker=3)
    idx.record("a", [1, 2])  # stores depths 1 and 2
    idx.record("a", [1])  # refresh depth 1: depth 2 is now the oldest
    idx.record("a", [5])
    idx.record("a", [6])  # 4 entries > 3: depth-2 prefix [1, 2] goes
    assert idx.matched_blocks([1], "a") == 1
    assert idx.matched_blocks([1, 2], "a") == 1
    idx.record("b", [5])
    assert sorted(idx.longest_match([5], {"a", "b"})[0]) == ["a", "b"]
    idx.forget("a")
    assert idx.longest_match([1], {"a"}) == ([], 0)
    assert idx.longest_match([5], {"a", "b"}) == (["b"], 1)
    assert idx.workers() == ["b"]


def test_waiting_requests_keep_their_reservations() -> None:
    """A report that says rank 0 has 1 request waiting (not yet holding KV, so not in its used
    tokens) keeps the newest covered reservation of rank 0."""
    r = Reservations()
    r.add("w", 2, 0, 100, now_s=1.0)
    r.add("w", 2, 0, 200, now_s=2.0)
    r.add("w", 2, 1, 50, now_s=2.5)
    r.cover("w", reported_at_s=3.0, num_waiting=[1, 0])
    assert r.totals("w", 2) == [200, 0]
    r.cover("w", reported_at_s=4.0, num_waiting=[5, 0])  # more waiting than covered: keep all
    assert r.totals("w", 2) == [200, 0]
    r.cover("w", reported_at_s=5.0, num_waiting=[0, 0])
    assert r.totals("w", 2) == [0, 0]
