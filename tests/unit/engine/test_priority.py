"""Request priority through a real engine (tiny model): with one sequence slot taken, the
waiting request of better (lower) priority runs first whatever the arrival order (and a strictly
better one preempts the running request, which then resumes first among its equals), and
priorities leave each request's tokens unchanged."""

from __future__ import annotations

import asyncio
import dataclasses

from services.worker.engine.api import EngineRequest
from tests.unit.engine.conftest import EngineFactory, collect, greedy, request, tokens_of


async def test_the_better_priority_runs_first_and_outputs_do_not_change(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_seqs=1)
    finished: list[str] = []

    async def run(req: EngineRequest) -> list[int]:
        out = tokens_of(await collect(engine.add_request(req)))
        finished.append(req.request_id)
        return out

    def req(rid: str, first: int, priority: int, max_tokens: int = 6) -> EngineRequest:
        r = request(rid, tuple(range(first, first + 12)), greedy(max_tokens, ignore_eos=True))
        return dataclasses.replace(r, priority=priority)

    # busy holds the only slot (it has produced a token) while the others arrive: the worst
    # first, the best last
    handle = engine.add_request(req("busy", 10, 0, max_tokens=48))
    first = await anext(aiter(handle))

    async def rest_of_busy() -> list[int]:
        out = tokens_of([first, *(await collect(handle))])
        finished.append("busy")
        return out

    busy = asyncio.ensure_future(rest_of_busy())
    rest = [
        asyncio.ensure_future(run(req(rid, start, priority)))
        for rid, start, priority in (("batch", 30, 10), ("default", 50, 0), ("urgent", 70, -5))
    ]
    outs = await asyncio.gather(busy, *rest)
    # urgent preempted busy (priority 0) for its slot; busy resumes before default, its equal
    assert finished == ["urgent", "busy", "default", "batch"]
    # the same requests without priorities, all at once: the same tokens
    plain = [
        tokens_of(await collect(engine.add_request(req(f"p{i}", f, 0)))) for i, f in enumerate((30, 50, 70))
    ]
    assert outs[1:] == plain
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)
