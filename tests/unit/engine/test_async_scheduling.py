"""Async scheduling (engine/rank.py, issue 31 item 4), forced on on CPU: the step loop launches
decode step N+1 before step N's tokens are applied, and the token streams are the ones the
synchronous loop gives: greedy and seeded sampling, stop tokens and EOS, max_tokens, requests
joining and leaving mid-run, a cancel mid-run; every block is back in the pool afterwards."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from services.worker.engine.api import Engine, RequestHandle, RequestOutput, SamplingConfig
from tests.unit.engine.conftest import EngineFactory, collect, greedy, request, tokens_of

PROMPTS = [tuple(range(3 + i, 12 + 3 * i)) for i in range(5)]


def _count_overlapped(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps launched with the previous step's ids on the device."""
    runner = engine._ranks[0].runner  # type: ignore[attr-defined]
    real = runner.execute_async
    overlapped: list[int] = []

    def execute_async(seqs: Any, input_ids: Any = None) -> Any:
        if input_ids is not None:
            overlapped.append(len(seqs))
        return real(seqs, input_ids)

    monkeypatch.setattr(runner, "execute_async", execute_async)
    return overlapped


async def _run(engine: Engine, eos: int, stop: int) -> list[list[RequestOutput]]:
    """Two waves of requests (the second joins while the first decodes): greedy to max_tokens,
    greedy with a stop token, seeded top-p / top-k sampling (EOS honoured)."""
    samplings = [
        greedy(24, ignore_eos=True),
        greedy(30, ignore_eos=True, stop_token_ids=(stop,)),
        SamplingConfig(max_tokens=40, temperature=1.3, top_p=0.95, seed=5),
        SamplingConfig(max_tokens=40, temperature=1.5, top_k=50, seed=6, stop_token_ids=(eos + 7,)),
        greedy(20),  # ends at the EOS token set by _check_same_streams
    ]
    decoding = asyncio.Event()

    async def first_of(handle: RequestHandle) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        async for out in handle:
            outs.append(out)
            if len(tokens_of(outs)) >= 5:
                decoding.set()
        decoding.set()
        return outs

    first = [
        asyncio.ensure_future(first_of(engine.add_request(request(f"a{i}", p, sp))))
        for i, (p, sp) in enumerate(zip(PROMPTS, samplings, strict=True))
    ]
    await decoding.wait()  # the first wave is decoding (tokens never depend on the batch)
    second = [
        asyncio.ensure_future(collect(engine.add_request(request(f"b{i}", p[::-1], sp))))
        for i, (p, sp) in enumerate(zip(PROMPTS, samplings[::-1], strict=True))
    ]
    return list(await asyncio.gather(*first, *second))


async def _all_blocks_free(engine: Engine) -> bool:
    for _ in range(100):  # the step thread frees a finished request's blocks after its output
        if engine.num_free_blocks(0) == engine.num_total_blocks(0):
            return True
        await asyncio.sleep(0.01)
    return False


async def test_async_scheduling_gives_the_same_streams(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync = make_engine(async_scheduling=False)
    await _check_same_streams(sync, make_engine(async_scheduling=True), monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_async_scheduling_gives_the_same_streams(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA (graphs, FlexAttention, pinned copies; fp32): the overlap changes no stream."""
    sync = make_engine(device="cuda", dtype="float32", async_scheduling=False)
    await _check_same_streams(sync, make_engine(device="cuda", dtype="float32"), monkeypatch)


async def _probe(engine: Engine, prompt: tuple[int, ...]) -> list[int]:
    return tokens_of(await collect(engine.add_request(request("probe", prompt, greedy(30, ignore_eos=True)))))


async def _check_same_streams(sync: Engine, on: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = await _probe(sync, PROMPTS[1])
    stop = probe[len(probe) // 2]  # a token the greedy stream meets mid-run
    # EOS: a token PROMPTS[4]'s greedy stream meets a few tokens in (the tiny model's own EOS
    # may never come), set on both engines' ranks
    probe = await _probe(sync, PROMPTS[4])
    eos = next((t for t in probe[3:] if t not in probe[:3]), probe[-1])
    for engine in (sync, on):
        rank = engine._ranks[0]  # type: ignore[attr-defined]
        rank.eos_token_ids = rank.scheduler.eos_token_ids = frozenset({eos})
    want = await _run(sync, eos, stop)
    ended = want[4][-1].finish_reason
    assert 3 <= len(tokens_of(want[4])) < 20 and ended is not None and ended.value == "stop"  # by EOS
    overlapped = _count_overlapped(on, monkeypatch)
    got = await _run(on, eos, stop)
    assert [tokens_of(o) for o in got] == [tokens_of(o) for o in want]
    assert [o[-1].finish_reason for o in got] == [o[-1].finish_reason for o in want]
    assert ["".join(x.text_delta for x in o) for o in got] == ["".join(x.text_delta for x in o) for o in want]
    reasons = {o[-1].finish_reason.value for o in want if o[-1].finish_reason is not None}
    assert reasons == {"length", "stop"}  # both ways of ending mid-run are covered
    assert len(overlapped) > 20 and max(overlapped) > 1  # steps did overlap, with several requests
    assert await _all_blocks_free(on)


async def test_async_scheduling_cancel_mid_run_frees_every_block(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(async_scheduling=True)
    overlapped = _count_overlapped(engine, monkeypatch)
    long = greedy(10_000, ignore_eos=True)
    handles = [engine.add_request(request(f"c{i}", p, long)) for i, p in enumerate(PROMPTS)]
    tasks = [asyncio.ensure_future(collect(h)) for h in handles]
    while len(overlapped) < 5:
        await asyncio.sleep(0.01)
    assert engine.abort("c1") and engine.abort("c3")
    await asyncio.sleep(0.1)  # the others go on (overlapping again)
    for i in (0, 2, 4):
        assert engine.abort(f"c{i}")
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert all(r[-1].finish_reason is not None and r[-1].finish_reason.value == "abort" for r in results)
    assert await _all_blocks_free(engine)
