"""Block manager: reference counts, prefix lookups by chained hash, LRU eviction, consecutive
runs."""

from __future__ import annotations

from services.worker.engine.block_manager import BlockManager
from shared.block_hash import block_hashes


def _cache_all(bm: BlockManager, blocks: list[int], tokens: list[int]) -> None:
    for b, h in zip(blocks, block_hashes(tokens, bm.block_size), strict=False):
        bm.cache_block(b, h)


def test_allocate_free_refcounts() -> None:
    bm = BlockManager(8, 4, True)
    a = bm.allocate(3)
    assert a == [0, 1, 2] and bm.num_free_blocks == 5
    b = bm.allocate(2, after=a[-1])
    assert b == [3, 4]  # grows in place
    bm.take([0])
    bm.free(a)
    assert bm.ref_count(0) == 1 and bm.num_free_blocks == 5
    bm.free([0, *b])
    assert bm.num_free_blocks == 8


def test_prefix_lookup_and_hit_after_free() -> None:
    bm = BlockManager(8, 4, True)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    blocks = bm.allocate(3)
    _cache_all(bm, blocks, tokens)
    assert bm.lookup_prefix(tokens, 10) == blocks[:2]
    assert bm.lookup_prefix([*tokens[:4], 99, 98, 97, 96], 10) == blocks[:1]
    bm.free(blocks)
    assert bm.lookup_prefix(tokens, 10) == blocks[:2]  # still cached while unreferenced
    assert bm.lookup_prefix(tokens, 1) == blocks[:1]  # capped


def test_lru_eviction_order() -> None:
    bm = BlockManager(4, 2, True)
    old = bm.allocate(2)
    _cache_all(bm, old, [1, 2, 3, 4])
    new = bm.allocate(2)
    _cache_all(bm, new, [5, 6, 7, 8])
    bm.free(old)
    bm.free(new)
    # everything is cached and free: handing out 2 blocks evicts the least recently freed
    got = bm.allocate(2)
    assert sorted(got) == sorted(old)
    assert bm.lookup_prefix([1, 2, 3, 4], 2) == []
    assert bm.lookup_prefix([5, 6, 7, 8], 2) == new


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(4, 2, False)
    blocks = bm.allocate(2)
    _cache_all(bm, blocks, [1, 2, 3, 4])
    assert bm.lookup_prefix([1, 2, 3, 4], 2) == []
