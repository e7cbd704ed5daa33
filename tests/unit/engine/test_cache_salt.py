"""vLLM's cache_salt in the engine: a prompt cached under one salt is found again only under the
same salt, never by another salt or an unsalted request (per-tenant prefix-cache isolation),
on the unified path, on a decode worker's handoff reservation, and in the host tier; outputs do
not depend on the salt."""

from __future__ import annotations

import dataclasses
import random

from services.worker.engine.api import SamplingConfig
from tests.unit.engine.conftest import EngineFactory, collect, greedy, handoff_run, request, tokens_of

PROMPT = tuple(random.Random(11).randrange(3, 400) for _ in range(40))


def salted(salt: str) -> SamplingConfig:
    return dataclasses.replace(greedy(4, ignore_eos=True), cache_salt=salt)


async def test_a_salted_prompt_is_found_only_under_its_salt(make_engine: EngineFactory) -> None:
    engine = make_engine(block_size=4)
    runs = []
    for rid, salt in (("a1", "tenant-a"), ("b1", "tenant-b"), ("n1", ""), ("a2", "tenant-a"), ("n2", "")):
        out = await collect(engine.add_request(request(rid, PROMPT, salted(salt))))
        runs.append((rid, out[-1].num_local_cached_tokens, tokens_of(out)))
    cached = {rid: c for rid, c, _ in runs}
    assert cached == {"a1": 0, "b1": 0, "n1": 0, "a2": 36, "n2": 36}
    assert len({tuple(t) for _, _, t in runs}) == 1  # same tokens whatever the salt
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


async def test_the_decode_side_and_the_host_tier_keep_salts_apart(make_engine: EngineFactory) -> None:
    prefill = make_engine(block_size=4)
    decode = make_engine(block_size=4, kv_cache_tokens=64, kv_offload_tokens=256)
    first, _ = await handoff_run(prefill, decode, "a1", PROMPT, salted("tenant-a"))
    other, rest = await handoff_run(prefill, decode, "b1", PROMPT, salted("tenant-b"))
    assert rest[-1].num_local_cached_tokens == 0  # tenant-a's blocks on the decode worker: not b's
    # evict everything from the 64-token pool: tenant-a's blocks go to the host tier
    await collect(decode.add_request(request("x", tuple(range(100, 140)), greedy(4, ignore_eos=True))))
    _, again_b = await handoff_run(prefill, decode, "b2", PROMPT, salted("tenant-c"))
    assert again_b[-1].num_local_cached_tokens == 0
    _, again_a = await handoff_run(prefill, decode, "a2", PROMPT, salted("tenant-a"))
    assert again_a[-1].num_local_cached_tokens == 40  # its own blocks, from the pool or the tier
    assert list(first.new_token_ids) == list(other.new_token_ids)
    assert decode.num_free_blocks(0) == decode.num_total_blocks(0)
