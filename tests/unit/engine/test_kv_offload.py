"""The prefix cache's host tier (kv_offload.py): blocks the KV pool evicts are kept in host
memory and copied back on a later prefix hit, bit for bit, so a request served from them decodes
the same tokens; LRU order in the tier; the pool tells the tier before handing a block out."""

from __future__ import annotations

import random

import torch
from prometheus_client import REGISTRY

from services.worker.engine.api import SamplingConfig
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.kv_offload import HostKvCache
from services.worker.rank_metrics import RankMetrics
from shared.block_hash import chain_hash
from tests.unit.engine.conftest import (
    EngineFactory,
    HandoffStats,
    collect,
    greedy,
    handoff_run,
    request,
    tokens_of,
)


def test_the_pool_reports_the_cached_blocks_it_hands_out_again() -> None:
    evicted: list[list[tuple[int, int]]] = []
    bm = BlockManager(4, 2, True, on_evict=evicted.append)
    first = bm.allocate(2)
    bm.cache_block(first[0], 111)  # a full, computed block under its hash
    bm.free(first)
    assert evicted == []  # freed, still cached
    again = bm.allocate(4)  # every block: the cached one is evicted
    assert evicted == [[(first[0], 111)]] and bm.lookup_prefix([1, 2], 1) == []
    bm.free(again)
    bm.allocate(2)
    assert len(evicted) == 1  # nothing cached was handed out this time


def test_the_tier_keeps_blocks_by_hash_restores_them_exactly_and_drops_the_oldest() -> None:
    layers, heads, bs, dim, blocks = 2, 2, 4, 8, 6
    pool = torch.randn(layers, 2, heads, blocks * bs, dim)
    view = pool.view(layers, 2, heads, blocks, bs, dim)
    tier = HostKvCache(lambda: view, num_blocks=2, block_size=bs)
    tokens = list(range(12))
    h0 = chain_hash(None, tokens[0:4])
    h1 = chain_hash(h0, tokens[4:8])
    h2 = chain_hash(h1, tokens[8:12])
    want = view[:, :, :, [3, 5]].clone()
    tier.save([(3, h0), (5, h1)])
    assert tier.lookup(tokens, None, 0, 3) == [h0, h1]  # h2 was never saved
    assert tier.lookup(tokens, h0, 1, 3) == [h1] and tier.lookup(tokens, None, 0, 1) == [h0]
    fetched = tier.fetch([h0, h1])
    view.zero_()
    tier.restore(fetched, [0, 1])
    assert torch.equal(view[:, :, :, [0, 1]], want) and tier.restored_blocks == 2
    tier.save([(2, h2)])  # full: the least recently used (h1: h0 was looked up last) goes
    assert h1 not in tier and h0 in tier and h2 in tier and tier.saved_blocks == 3
    tier.save([(2, h2)])  # held already: nothing copied
    assert tier.saved_blocks == 3 and tier.num_used_blocks == 2


async def test_a_prompt_evicted_from_the_pool_comes_back_from_the_host_tier(
    make_engine: EngineFactory,
) -> None:
    """A small pool: a second prompt evicts the first one's blocks; the first prompt again finds
    all its full blocks (in the pool or copied back from the tier) and decodes the same tokens.
    Without the tier it recomputes most of them."""
    rng = random.Random(5)
    prompt_a = tuple(rng.randrange(3, 400) for _ in range(40))
    prompt_b = tuple(rng.randrange(3, 400) for _ in range(40))
    sampling = greedy(4, ignore_eos=True)
    seeded = SamplingConfig(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True)
    cached: dict[int, int] = {}
    for offload in (0, 256):
        engine = make_engine(block_size=4, kv_cache_tokens=64, kv_offload_tokens=offload)
        first = await collect(engine.add_request(request("a1", prompt_a, sampling)))
        await collect(engine.add_request(request("b", prompt_b, seeded)))
        again = await collect(engine.add_request(request("a2", prompt_a, sampling)))
        assert tokens_of(again) == tokens_of(first)
        cached[offload] = again[-1].num_local_cached_tokens
        assert engine.num_free_blocks(0) == engine.num_total_blocks(0)
        stats = engine.kv_offload_stats(0)
        if offload:
            assert stats is not None
            saved, restored, used, capacity = stats
            assert saved >= restored > 0 and 0 < used <= capacity == 64
            before = {d: _sample("pdserve_kv_offload_blocks_total", direction=d) for d in ("save", "restore")}
            RankMetrics(engine).refresh()
            assert _sample("pdserve_kv_offload_blocks_total", direction="save") - before["save"] == saved
            assert (
                _sample("pdserve_kv_offload_blocks_total", direction="restore") - before["restore"]
                == restored
            )
            assert _sample("pdserve_kv_offload_usage_ratio") == used / capacity
        else:
            assert stats is None
    assert cached[256] == 36  # every full block of the prompt but the one holding its last token
    assert cached[0] < 36


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"dp_rank": "0", **labels}) or 0.0


async def test_a_decode_worker_restores_from_its_tier_and_the_handoff_skips_those_blocks(
    make_engine: EngineFactory,
) -> None:
    """Disaggregated: the decode side's reservation finds the evicted prompt in its host tier,
    copies it back and reports it cached, so the handoff moves only the rest; same tokens."""
    rng = random.Random(9)
    prompt_a = tuple(rng.randrange(3, 400) for _ in range(42))  # 10 full blocks and 2 tokens
    prompt_b = tuple(rng.randrange(3, 400) for _ in range(40))
    sampling = greedy(4, ignore_eos=True)
    prefill = make_engine(block_size=4)
    decode = make_engine(block_size=4, kv_cache_tokens=64, kv_offload_tokens=256)
    first, rest = await handoff_run(prefill, decode, "a1", prompt_a, sampling)
    await collect(decode.add_request(request("b", prompt_b, sampling)))  # evicts a's blocks
    moved = HandoffStats()
    again_first, again_rest = await handoff_run(prefill, decode, "a2", prompt_a, sampling, moved)
    assert tokens_of([again_first, *again_rest]) == tokens_of([first, *rest])
    assert again_rest[-1].num_local_cached_tokens == 40  # every full prompt block
    assert moved.blocks == 1  # only the partial block holding the prompt's last 2 tokens moved
    stats = decode.kv_offload_stats(0)
    assert stats is not None and stats[1] > 0  # some came back from the tier (the rest: the pool)
    assert decode.num_free_blocks(0) == decode.num_total_blocks(0)
