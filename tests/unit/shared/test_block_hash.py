"""Chained block hashes: equal prefixes give equal hashes, any earlier difference changes all later."""

from __future__ import annotations

from shared.block_hash import block_hashes, salt_root


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(list(range(33)), 16)) == 2
    assert block_hashes(list(range(15)), 16) == []


def test_shared_prefix_shares_hashes() -> None:
    a = block_hashes(list(range(48)), 16)
    b = block_hashes([*range(32), *range(100, 116)], 16)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_hash_is_chained() -> None:
    a = block_hashes([1, *range(1, 32)], 16)
    b = block_hashes([2, *range(1, 32)], 16)
    # The second blocks hold the same tokens but follow different first blocks.
    assert a[1] != b[1]


def test_deterministic_across_calls() -> None:
    assert block_hashes(list(range(64)), 16) == block_hashes(list(range(64)), 16)


def test_a_cache_salt_roots_the_chain_elsewhere() -> None:
    tokens = list(range(48))
    plain = block_hashes(tokens, 16)
    salted = block_hashes(tokens, 16, salt_root("tenant-a"))
    assert salt_root("") is None and block_hashes(tokens, 16, salt_root("")) == plain
    assert salt_root("tenant-a") == salt_root("tenant-a") != salt_root("tenant-b")
    assert not set(salted) & set(plain)  # no block of one chain matches the other's
    assert not set(salted) & set(block_hashes(tokens, 16, salt_root("tenant-b")))
    assert salted == block_hashes(tokens, 16, salt_root("tenant-a"))
