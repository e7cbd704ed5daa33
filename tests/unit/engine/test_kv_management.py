"""Prefix caching, chunked prefill, preemption and block accounting give cold-run tokens and
leak no block."""

from __future__ import annotations

import asyncio
import random

from services.worker.engine.api import RequestHandle, RequestOutput
from tests.unit.engine.conftest import (
    EngineFactory,
    collect,
    drain,
    greedy,
    metrics_core,
    request,
    tokens_of,
)


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 450) for _ in range(n))


async def test_prefix_cache_hit_gives_cold_tokens(make_engine: EngineFactory) -> None:
    engine = make_engine()
    cold_engine = make_engine(enable_prefix_caching=False)
    shared = _prompt(100, 1)
    first = await collect(engine.add_request(request("a", (*shared, 7, 8), greedy(12))))
    prompt = shared + _prompt(30, 2)
    warm = await collect(engine.add_request(request("b", prompt, greedy(12))))
    cold = await collect(cold_engine.add_request(request("c", prompt, greedy(12))))
    assert tokens_of(warm) == tokens_of(cold)
    assert warm[-1].num_local_cached_tokens == 96  # 6 full blocks of the shared 100 tokens
    assert cold[-1].num_local_cached_tokens == 0
    assert first[-1].num_local_cached_tokens == 0
    load = engine.rank_loads()[0]
    assert load.prefix_cache_queries_tokens == 102 + 130
    assert load.prefix_cache_hits_tokens == 96


async def test_generated_tokens_are_cached(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = _prompt(40, 3)
    out = await collect(engine.add_request(request("t1", prompt, greedy(40, ignore_eos=True))))
    follow_up = prompt + tuple(tokens_of(out)) + _prompt(10, 4)
    out2 = await collect(engine.add_request(request("t2", follow_up, greedy(2))))
    # prompt 40 + 40 generated: the K/V of the first 79 tokens exists -> 4 full blocks cached
    assert out2[-1].num_local_cached_tokens == 64


async def test_chunked_prefill_emits_nothing_early(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_tokens=32)
    ref_engine = make_engine()
    prompt = _prompt(150, 5)
    outs = await collect(engine.add_request(request("c", prompt, greedy(6))))
    ref = await collect(ref_engine.add_request(request("r", prompt, greedy(6))))
    assert tokens_of(outs) == tokens_of(ref)
    assert outs[0].num_prefill_chunks == 5  # ceil(150 / 32), all before the first token
    assert outs[0].new_token_ids  # the first output already carries the first token
    assert ref[0].num_prefill_chunks == 1


async def test_decodes_keep_flowing_during_long_prefill(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_tokens=24)
    short = engine.add_request(request("short", _prompt(5, 6), greedy(20, ignore_eos=True)))
    await asyncio.sleep(0)
    long = engine.add_request(request("long", _prompt(200, 7), greedy(2, ignore_eos=True)))
    short_out, long_out = await drain([short, long])
    assert tokens_of(short_out) and tokens_of(long_out)


async def test_preempted_request_resumes_with_cold_tokens(make_engine: EngineFactory) -> None:
    # 8 blocks of 16 tokens: three requests growing to ~70 tokens each cannot all stay
    engine = make_engine(kv_cache_tokens=128, max_batch_tokens=64)
    ref_engine = make_engine()
    prompts = [_prompt(30, 10 + i) for i in range(3)]
    handles = [
        engine.add_request(request(f"p{i}", p, greedy(40, ignore_eos=True))) for i, p in enumerate(prompts)
    ]
    results = await drain(handles)
    refs = await drain(
        [
            ref_engine.add_request(request(f"q{i}", p, greedy(40, ignore_eos=True)))
            for i, p in enumerate(prompts)
        ]
    )
    for got, ref in zip(results, refs, strict=True):
        assert tokens_of(got) == tokens_of(ref)
        assert got[-1].num_generated_tokens == 40
        # first-scheduling stats survive preemption
        assert got[-1].num_prompt_tokens == 30
        assert got[-1].num_local_cached_tokens == 0
    assert max(r[-1].num_prefill_chunks for r in results) > 1  # someone was recomputed
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


async def test_500_random_requests_with_aborts_leak_no_block(make_engine: EngineFactory) -> None:
    engines = [make_engine(kv_cache_tokens=512, max_batch_tokens=96, max_num_seqs=16, dp_size=2)]
    engine = engines[0]
    rng = random.Random(0)
    tasks: list[asyncio.Task[list[RequestOutput]]] = []
    handles: list[tuple[str, RequestHandle]] = []
    for i in range(500):
        prompt = _prompt(rng.randint(1, 120), 1000 + rng.randrange(20))  # repeats: cache hits
        rid = f"r{i}"
        h = engine.add_request(request(rid, prompt, greedy(rng.randint(1, 12)), dp_rank=i % 2))
        handles.append((rid, h))
        tasks.append(asyncio.ensure_future(collect(h)))
        if rng.random() < 0.3:
            victim = rng.choice(handles)[0]
            engine.abort(victim)
        if i % 25 == 0:
            await asyncio.sleep(0.01)
    results = await asyncio.gather(*tasks)
    assert all(r[-1].finished for r in results)
    assert any(r[-1].finish_reason is not None and r[-1].finish_reason.value == "abort" for r in results)
    for rank in range(2):
        assert engine.num_free_blocks(rank) == engine.num_total_blocks(rank)
    loads = engine.rank_loads()
    assert [x.num_running + x.num_waiting for x in loads] == [0, 0]
    assert all(x.prefix_cache_hits_tokens > 0 for x in loads)


async def test_preemption_never_rewrites_prefix_hits(make_engine: EngineFactory) -> None:
    """Requests that hit a cached prefix and are then preempted (tiny pool) keep reporting the
    cache figures fixed at their first scheduling: a recompute that finds its own blocks cached
    must not raise them, and nothing derived can go negative."""
    engine = make_engine(kv_cache_tokens=128, max_batch_tokens=64)
    shared = _prompt(32, 50)  # two full blocks
    await collect(engine.add_request(request("warm", (*shared, 1, 2, 3), greedy(2))))
    prompts = [(*shared, *_prompt(14, 60 + i)) for i in range(3)]
    results = await drain(
        [engine.add_request(request(f"h{i}", p, greedy(40, ignore_eos=True))) for i, p in enumerate(prompts)]
    )
    assert max(r[-1].num_prefill_chunks for r in results) > 1  # someone was preempted and recomputed
    cached = []
    for outs in results:
        figures = {(o.num_local_cached_tokens, o.num_transferred_tokens) for o in outs}
        assert len(figures) == 1, f"cache figures changed during the request: {figures}"
        ((local, transferred),) = figures
        assert transferred == 0 and local in (0, 32) and local <= outs[-1].num_prompt_tokens
        cached.append(local)
    assert 32 in cached  # the prefix really was hit
    load = engine.rank_loads()[0]
    assert 0 <= load.prefix_cache_hits_tokens <= load.prefix_cache_queries_tokens
    assert 0.0 <= load.prefix_cache_hit_rate <= 1.0
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


async def test_preemption_counter_moves_and_reaches_prometheus(make_engine: EngineFactory) -> None:
    """A pool too small for three growing requests preempts; the engine counts it and the
    worker core turns the count into pdserve_preemptions_total."""
    from prometheus_client import REGISTRY

    engine = make_engine(kv_cache_tokens=128, max_batch_tokens=64)
    core = metrics_core(engine)

    def exported() -> float:
        return REGISTRY.get_sample_value("pdserve_preemptions_total", {"dp_rank": "0"}) or 0.0

    core.refresh_metrics()
    before = exported()
    assert engine.num_preemptions(0) == 0
    await drain(
        [
            engine.add_request(request(f"p{i}", _prompt(30, 10 + i), greedy(40, ignore_eos=True)))
            for i in range(3)
        ]
    )
    preempted = engine.num_preemptions(0)
    assert preempted > 0
    core.refresh_metrics()
    assert exported() - before == preempted
    core.refresh_metrics()  # cumulative counts are exported once
    assert exported() - before == preempted
