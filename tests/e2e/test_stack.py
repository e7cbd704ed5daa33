"""The whole stack as real processes (`pdserve up`) on a tiny model: disaggregated and unified
generation, token identity with transformers' generate, Generate vs Complete, cancellation."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from shared.proto import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.support.reference import eos_ids, hf_greedy, tokenize
from tests.support.stack import Stack

pytestmark = pytest.mark.e2e

PROMPT = "Prefill and decode run on different workers"


async def _generate(stack: Stack, **fields: Any) -> list[gateway_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(stack.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        return [f async for f in stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=120)]


async def _complete(stack: Stack, **fields: Any) -> gateway_pb2.CompleteResponse:
    async with grpc.aio.insecure_channel(stack.gateway) as channel:
        return await gateway_pb2_grpc.GatewayStub(channel).Complete(
            gateway_pb2.GenerateRequest(**fields), timeout=120
        )


def _tokens(frames: list[gateway_pb2.GenerateResponse]) -> list[int]:
    return [t for f in frames for t in f.token_ids]


def _strip_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


@pytest.mark.parametrize("max_tokens", [1, 7, 24])
async def test_disaggregated_greedy_matches_hf_generate(
    disagg_stack: Stack, tiny_bpe_model: Path, max_tokens: int
) -> None:
    frames = await _generate(
        disagg_stack, prompt=PROMPT, max_tokens=max_tokens, temperature=0, return_token_ids=True
    )
    want = hf_greedy(tiny_bpe_model, tokenize(tiny_bpe_model, PROMPT), max_tokens)
    got = _strip_eos(_tokens(frames), eos_ids(tiny_bpe_model))
    assert got == want
    final = frames[-1]
    assert final.kind == gateway_pb2.FRAME_KIND_FINAL
    assert final.usage.completion_tokens == len(want)
    assert final.usage.prompt_tokens == len(tokenize(tiny_bpe_model, PROMPT))
    expected_reason = (
        common_pb2.FINISH_REASON_LENGTH if len(want) >= max_tokens else common_pb2.FINISH_REASON_STOP
    )
    assert final.finish_reason == expected_reason
    assert frames[0].kind in (gateway_pb2.FRAME_KIND_FIRST, gateway_pb2.FRAME_KIND_FINAL)
    assert len({f.request_id for f in frames}) == 1


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0), dict(temperature=1.2, top_p=0.9, seed=42)], ids=["greedy", "seeded"]
)
async def test_unified_and_disaggregated_agree(
    disagg_stack: Stack, unified_stack: Stack, sampling: dict[str, float]
) -> None:
    fields = dict(
        messages=[gateway_pb2.ChatMessage(role="user", content="What is a KV cache?")],
        max_tokens=20,
        return_token_ids=True,
        ignore_eos=True,
        **sampling,
    )
    disagg = await _generate(disagg_stack, **fields)
    unified = await _generate(unified_stack, **fields)
    assert _tokens(disagg) == _tokens(unified)
    assert "".join(f.text for f in disagg) == "".join(f.text for f in unified)
    assert disagg[-1].usage.completion_tokens == unified[-1].usage.completion_tokens
    assert disagg[-1].finish_reason == unified[-1].finish_reason


async def test_generate_and_complete_agree(disagg_stack: Stack) -> None:
    fields = dict(prompt=PROMPT, max_tokens=16, temperature=0, return_token_ids=True)
    frames = await _generate(disagg_stack, **fields)
    complete = await _complete(disagg_stack, **fields)
    assert complete.text == "".join(f.text for f in frames)
    assert list(complete.token_ids) == _tokens(frames)
    assert complete.usage == frames[-1].usage
    assert complete.finish_reason == frames[-1].finish_reason


async def test_token_ids_only_when_asked(disagg_stack: Stack) -> None:
    frames = await _generate(disagg_stack, prompt=PROMPT, max_tokens=8, temperature=0)
    assert _tokens(frames) == []
    assert frames[-1].usage.completion_tokens > 0


async def test_seeded_sampling_is_reproducible(disagg_stack: Stack) -> None:
    fields = dict(prompt=PROMPT, max_tokens=12, temperature=1.0, seed=1234, return_token_ids=True)
    a = await _generate(disagg_stack, **fields)
    b = await _generate(disagg_stack, **fields)
    assert _tokens(a) == _tokens(b)


async def test_bad_input_is_invalid_argument_and_stack_keeps_serving(disagg_stack: Stack) -> None:
    for fields in (
        dict(),
        dict(prompt="x", max_tokens=0),
        dict(prompt="x", temperature=-1.0),
        dict(prompt="x", prompt_token_ids=[1, 2]),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await _generate(disagg_stack, **fields)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert exc.value.details()
    frames = await _generate(disagg_stack, prompt=PROMPT, max_tokens=4, temperature=0)
    assert frames[-1].kind == gateway_pb2.FRAME_KIND_FINAL


async def _used_tokens(stack: Stack, address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        load = await worker_pb2_grpc.WorkerStub(channel).GetLoad(
            worker_pb2.GetLoadRequest(), timeout=10, metadata=stack.internal_metadata
        )
    return sum(r.num_used_tokens + r.num_running + r.num_waiting for r in load.ranks)


async def test_cancel_mid_stream_frees_kv_on_both_workers(disagg_stack: Stack) -> None:
    async with grpc.aio.insecure_channel(disagg_stack.gateway) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            gateway_pb2.GenerateRequest(prompt=PROMPT * 4, max_tokens=2000, temperature=0, ignore_eos=True)
        )
        got = 0
        async for _frame in call:
            got += 1
            if got >= 3:
                call.cancel()
                break
    for _ in range(100):
        busy = [await _used_tokens(disagg_stack, a) for a in disagg_stack.workers]
        if not any(busy):
            break
        await asyncio.sleep(0.1)
    assert busy == [0, 0], f"KV still held after cancel: {busy}"


async def test_cached_tokens_count_prefix_hits_only(disagg_stack: Stack, unified_stack: Stack) -> None:
    """A cold prompt reports 0 cached tokens (KV pushed from prefill to decode is not a cache hit);
    the same prompt again hits the prefix cache in whole blocks, on both serving paths."""
    prompt = "Cache accounting check: " + " ".join(f"w{i}" for i in range(60))
    for stack in (disagg_stack, unified_stack):
        cold = await _generate(stack, prompt=prompt, max_tokens=4, temperature=0)
        warm = await _generate(stack, prompt=prompt, max_tokens=4, temperature=0)
        assert cold[-1].usage.cached_tokens == 0
        assert all(f.cached_tokens == 0 for f in cold)
        usage = warm[-1].usage
        assert 0 < usage.cached_tokens <= usage.prompt_tokens
        assert usage.cached_tokens % 16 == 0  # whole KV blocks
        assert usage.cached_tokens == usage.local_cached_tokens + usage.transferred_cached_tokens
        assert all(f.cached_tokens == usage.cached_tokens for f in warm)
    assert warm[-1].usage.local_cached_tokens > 0  # unified: the worker's own cache
