"""min_tokens under concurrency: pick + reserve is one atomic step, so a burst against one
unchanged snapshot spreads evenly (no two callers see the same stale minimum)."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from services.scheduler.router import Policies, Router
from shared.cluster import Role
from tests.unit.scheduler.helpers import request, snapshot, worker

DP_SIZE = 4


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads as often as possible, to expose any read-then-write race."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def unified_router() -> Router:
    r = Router(Policies(dp_rank="min_tokens"), seed=0)
    r.apply_snapshot(snapshot(worker("u", Role.UNIFIED, [0] * DP_SIZE)))
    return r


def test_threads_spread_evenly(fast_switching: None) -> None:
    r = unified_router()
    num_threads, per_thread = 16, 50
    barrier = threading.Barrier(num_threads)
    picks: list[int] = []
    lock = threading.Lock()

    def run(t: int) -> None:
        barrier.wait()
        mine = [r.schedule(request(f"t{t}-{i}", 128)).decode.dp_rank for i in range(per_thread)]
        with lock:
            picks.extend(mine)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    total = num_threads * per_thread
    assert Counter(picks) == dict.fromkeys(range(DP_SIZE), total // DP_SIZE)
    assert r.state().workers[0].reserved_tokens == (128 * total // DP_SIZE,) * DP_SIZE


async def test_tasks_spread_evenly() -> None:
    r = unified_router()
    start = asyncio.Event()

    async def one(i: int) -> int:
        await start.wait()
        return r.schedule(request(f"r{i}", 256)).decode.dp_rank

    tasks = [asyncio.create_task(one(i)) for i in range(400)]
    await asyncio.sleep(0)
    start.set()
    picks = await asyncio.gather(*tasks)
    assert Counter(picks) == dict.fromkeys(range(DP_SIZE), 100)


async def test_tasks_in_threads_with_mixed_sizes_balance_tokens(fast_switching: None) -> None:
    r = unified_router()
    sizes = [100 + (i * 37) % 900 for i in range(200)]
    await asyncio.gather(*(asyncio.to_thread(r.schedule, request(f"r{i}", s)) for i, s in enumerate(sizes)))
    reserved = r.state().workers[0].reserved_tokens
    assert sum(reserved) == sum(sizes)
    # Greedy least-tokens assignment keeps every rank within one request of the others.
    assert max(reserved) - min(reserved) <= max(sizes)
