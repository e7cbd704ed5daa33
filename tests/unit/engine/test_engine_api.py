"""Engine facade: validation errors, DP ranks and per-rank loads, aborts, the GPU path."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from services.worker.engine.api import RequestKind, SamplingConfig
from shared.errors import AlreadyExists, InvalidArgument, ResourceExhausted
from tests.unit.engine.conftest import (
    EngineFactory,
    collect,
    drain,
    greedy,
    greedy_tokens,
    request,
    tokens_of,
)


async def test_invalid_requests_are_rejected(make_engine: EngineFactory) -> None:
    engine = make_engine(kv_cache_tokens=64)
    with pytest.raises(InvalidArgument):
        engine.add_request(request("a", (), greedy(2)))
    with pytest.raises(InvalidArgument):
        engine.add_request(request("a", (5,), greedy(2), dp_rank=3))
    with pytest.raises(InvalidArgument):
        engine.add_request(request("a", (5,), SamplingConfig(max_tokens=0)))
    with pytest.raises(InvalidArgument):
        engine.add_request(request("a", (10**6,), greedy(2)))
    with pytest.raises(InvalidArgument):
        engine.add_request(request("a", (5,) * engine.max_model_len, greedy(2)))
    with pytest.raises(ResourceExhausted):
        engine.add_request(request("a", (5,) * 100, greedy(2)))
    with pytest.raises(InvalidArgument):
        engine.add_request(request("a", (5,), greedy(2), kind=RequestKind.DECODE_REMOTE))
    handle = engine.add_request(request("dup", (5, 6), greedy(3)))
    with pytest.raises(AlreadyExists):
        engine.add_request(request("dup", (5, 6), greedy(3)))
    await collect(handle)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dp_rank": 1}, "dp_rank 1 is out of range"),
        ({"prompt": ()}, "prompt_token_ids is empty"),
        ({"prompt": (1,) * 2048}, "max_model_len is 2048"),
        ({"request_id": ""}, "request_id"),
        ({"sampling": SamplingConfig(max_tokens=0)}, "max_tokens must be >= 1"),
        ({"sampling": SamplingConfig(max_tokens=1, top_p=1.5)}, "top_p must be in"),
        ({"sampling": SamplingConfig(max_tokens=1, top_k=-1)}, "top_k must be >= 0"),
        ({"sampling": SamplingConfig(max_tokens=1, min_p=1.5)}, "min_p must be in"),
        ({"sampling": SamplingConfig(max_tokens=1, min_p=float("nan"))}, "min_p must be in"),
        ({"sampling": SamplingConfig(max_tokens=1, temperature=-1)}, "temperature must be >= 0"),
    ],
)
async def test_validation_messages_say_what_to_change(
    make_engine: EngineFactory, fields: dict[str, object], message: str
) -> None:
    """The engine is the one validator (the worker core does not check again)."""
    engine = make_engine()
    args: dict[str, Any] = {"request_id": "v", "prompt": (5, 6), "sampling": greedy(2)}
    args.update(fields)  # deliberately invalid values: the engine must refuse them
    with pytest.raises(InvalidArgument, match=message):
        engine.add_request(request(args.pop("request_id"), args.pop("prompt"), args.pop("sampling"), **args))


async def test_dp_ranks_run_independently(make_engine: EngineFactory) -> None:
    engine = make_engine(dp_size=2)
    prompt = tuple(range(20, 60))
    h0 = engine.add_request(request("r0", prompt, greedy(6)))
    h1 = engine.add_request(request("r1", prompt, greedy(6), dp_rank=1))
    out0, out1 = await drain([h0, h1])
    assert tokens_of(out0) == tokens_of(out1)
    loads = engine.rank_loads()
    assert [x.dp_rank for x in loads] == [0, 1]
    assert all(x.prefix_cache_queries_tokens == 40 for x in loads)
    assert all(x.kv_capacity_tokens == 4096 for x in loads)


async def test_abort_running_request(make_engine: EngineFactory) -> None:
    engine = make_engine()
    handle = engine.add_request(request("long", tuple(range(5, 50)), greedy(1000, ignore_eos=True)))
    outs = []
    async for out in handle:
        outs.append(out)
        if len(outs) == 3:
            assert engine.abort("long")
    assert outs[-1].finished and outs[-1].finish_reason is not None
    assert outs[-1].finish_reason.value == "abort"
    assert outs[-1].num_generated_tokens == len(tokens_of(outs))
    await asyncio.sleep(0.05)
    assert engine.rank_loads()[0].num_used_tokens == 0
    assert not engine.abort("long")


async def test_shutdown_ends_handles(make_engine: EngineFactory) -> None:
    engine = make_engine()
    handle = engine.add_request(request("x", (5, 6, 7), greedy(10_000, ignore_eos=True)))
    await asyncio.sleep(0.05)
    engine.shutdown()
    outs = await asyncio.wait_for(collect(handle), 10)
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "abort"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_engine_matches_cpu(make_engine: EngineFactory) -> None:
    cpu = make_engine()
    gpu = make_engine(device="cuda")
    prompts = [tuple(range(5 + i, 60 + 7 * i)) for i in range(4)]
    assert await greedy_tokens(gpu, prompts, 10) == await greedy_tokens(cpu, prompts, 10)
    assert gpu.num_free_blocks(0) == gpu.num_total_blocks(0)


async def test_failed_forward_aborts_its_batch(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    runner = engine._ranks[0].runner  # type: ignore[attr-defined]

    def boom(seqs: object) -> list[int]:
        raise RuntimeError("injected")

    monkeypatch.setattr(runner, "execute", boom)
    outs = await asyncio.wait_for(collect(engine.add_request(request("f", (5, 6), greedy(3)))), 10)
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "abort"
    monkeypatch.undo()
    outs = await collect(engine.add_request(request("g", (5, 6), greedy(3, ignore_eos=True))))
    assert outs[-1].num_generated_tokens == 3
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)
