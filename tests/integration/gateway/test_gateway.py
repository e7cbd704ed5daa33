"""The gateway over real gRPC against scripted fake scheduler and workers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.server import build_app
from services.gateway.tokenization import PromptTokenizer
from shared.block_hash import block_hashes
from shared.proto import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2
from tests.support.prom import sample_total

from .conftest import Cluster, gateway_settings
from .fakes import (
    Fail,
    Hang,
    admitted,
    aggregated,
    disaggregated,
    final,
    prefill_reply,
    tokens,
)

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
FIRST, CONT, FINAL = (
    gateway_pb2.FRAME_KIND_FIRST,
    gateway_pb2.FRAME_KIND_CONTINUATION,
    gateway_pb2.FRAME_KIND_FINAL,
)


async def generate(c: Cluster, **fields: Any) -> list[gateway_pb2.GenerateResponse]:
    call = c.stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=30)
    return [f async for f in call]


async def complete(c: Cluster, **fields: Any) -> gateway_pb2.CompleteResponse:
    return await c.stub.Complete(gateway_pb2.GenerateRequest(**fields), timeout=30)


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[gateway_pb2.GenerateResponse]:
    """The remaining frames of a call already read with read() (iteration cannot be mixed in)."""
    frames = []
    while (frame := await call.read()) is not grpc.aio.EOF:
        frames.append(frame)
    return frames


def script_disaggregated(c: Cluster, max_model_len: int = 0) -> None:
    c.scheduler.responses.append(disaggregated(c.prefill, c.decode, max_model_len))
    c.decode.decode_scripts.append(
        [
            admitted("tk-9", cached_blocks=1, local_cached=16),
            tokens("lo", 12, transferred=4),
            tokens(" wo", 13),
            final("rld", 2, STOP, 14),
        ]
    )
    # The prefill worker found 8 prompt tokens in its prefix cache: those are the request's cache
    # hits. The decode worker's own hits (16) and the KV it received (4) are not.
    c.prefill.prefill_scripts.append(prefill_reply("Hel", 1, ids=(11,), local_cached=8))


async def test_disaggregated_stream(cluster: Cluster, tokenizer: PromptTokenizer) -> None:
    c = cluster
    script_disaggregated(c)
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    frames = await generate(c, prompt=prompt, max_tokens=10, return_token_ids=True, temperature=0)
    assert [f.kind for f in frames] == [FIRST, CONT, CONT, FINAL]
    assert "".join(f.text for f in frames) == "Hello world"
    assert [t for f in frames for t in f.token_ids] == [11, 12, 13, 14]
    rid = frames[0].request_id
    assert len(rid) == 32 and all(f.request_id == rid for f in frames)
    prompt_ids = list(tokenizer.encode_prompt(prompt))
    assert all(f.prompt_tokens == len(prompt_ids) for f in frames)
    assert [f.cached_tokens for f in frames] == [8, 8, 8, 8]  # the prefill worker's hits, on every frame
    last = frames[-1]
    assert last.finish_reason == STOP
    assert last.usage.completion_tokens == 3
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert (
        last.usage.cached_tokens,
        last.usage.local_cached_tokens,
        last.usage.transferred_cached_tokens,
    ) == (8, 0, 8)
    assert last.usage.total_tokens == len(prompt_ids) + 3
    assert last.model == "tiny"
    # what the peers saw
    sched = c.scheduler.requests[0]
    assert sched.prompt_tokens == len(prompt_ids) and sched.max_tokens == 10 and sched.request_id == rid
    assert list(sched.prefix_block_hashes) == block_hashes(prompt_ids, 16)
    dreq = c.decode.decode_requests[0]
    assert not dreq.local_prefill and list(dreq.prompt_token_ids) == prompt_ids and dreq.return_token_ids
    assert dreq.sampling.max_tokens == 10 and dreq.sampling.temperature == 0
    preq = c.prefill.prefill_requests[0]
    assert preq.kv_target.address == c.decode.address
    assert preq.kv_target.transfer_ticket == "tk-9" and preq.kv_target.skip_blocks == 1
    assert c.decode.aborts == [] and c.prefill.aborts == []


async def test_token_ids_only_when_asked(cluster: Cluster) -> None:
    script_disaggregated(cluster)
    frames = await generate(cluster, prompt="hello", max_tokens=10)
    assert all(not f.token_ids for f in frames)  # the client gets ids only when it asks ...
    # ... while the gateway always asks the worker: migration resumes from the generated ids
    assert cluster.decode.decode_requests[0].return_token_ids


async def test_aggregated_stream(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses.append(aggregated(c.decode))
    c.decode.decode_scripts.append([admitted(local_cached=0), tokens("a"), tokens("b"), final("", 3, STOP)])
    frames = await generate(c, prompt="hello", max_tokens=10)
    assert [f.kind for f in frames] == [FIRST, CONT, FINAL]
    assert frames[-1].usage.completion_tokens == 3
    assert c.decode.decode_requests[0].local_prefill
    assert c.prefill.prefill_requests == []


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
async def test_generate_and_complete_agree(cluster: Cluster, mode: str) -> None:
    c = cluster
    for _ in range(2):
        if mode == "disaggregated":
            c.scheduler.responses.append(disaggregated(c.prefill, c.decode))
            c.decode.decode_scripts.append([admitted(), tokens("b", 2), tokens("", 3), final("", 2, STOP)])
            c.prefill.prefill_scripts.append(prefill_reply("a", 1, ids=(1,)))
        else:
            c.scheduler.responses.append(aggregated(c.decode))
            c.decode.decode_scripts.append(
                [tokens("a", 1), tokens("b", 2), tokens("", 3), final("", 3, STOP)]
            )
    frames = await generate(c, prompt="hi", max_tokens=3, return_token_ids=True)
    done = await complete(c, prompt="hi", max_tokens=3, return_token_ids=True)
    assert done.text == "".join(f.text for f in frames) == "ab"
    assert list(done.token_ids) == [t for f in frames for t in f.token_ids]
    assert done.finish_reason == frames[-1].finish_reason == LENGTH  # count 3 == max_tokens
    assert done.usage == frames[-1].usage
    assert done.usage.completion_tokens == 3


async def test_inflated_worker_count_cannot_exceed_max_tokens(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses.append(disaggregated(c.prefill, c.decode))
    c.decode.decode_scripts.append([admitted(), tokens("b"), final("", 2**63, STOP)])
    c.prefill.prefill_scripts.append(prefill_reply("a", 2**64 - 1))
    frames = await generate(c, prompt="hi", max_tokens=5)
    assert frames[-1].usage.completion_tokens == 5
    assert frames[-1].finish_reason == LENGTH


async def test_byte_fallback_frames_with_empty_text_are_counted(cluster: Cluster) -> None:
    c = cluster
    # Five tokens make one emoji: frames with empty text until the character completes.
    c.scheduler.responses.append(disaggregated(c.prefill, c.decode))
    c.decode.decode_scripts.append(
        [admitted(), tokens(""), tokens(""), tokens(""), tokens("🙂"), final("", 4, STOP)]
    )
    c.prefill.prefill_scripts.append(prefill_reply("", 1))
    frames = await generate(c, prompt="hi", max_tokens=16)
    assert "".join(f.text for f in frames) == "🙂"
    assert frames[0].kind == FIRST and frames[0].text == ""  # TTFT even before any text
    assert frames[-1].usage.completion_tokens == 5
    assert frames[-1].finish_reason == STOP


async def test_byte_fallback_hits_max_tokens_exactly_on_a_multi_token_character(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses.append(disaggregated(c.prefill, c.decode))
    # the worker said STOP, but its count reached max_tokens: the worker's rule says length
    c.decode.decode_scripts.append([admitted(), tokens(""), tokens(""), final("🙂", 3, STOP)])
    c.prefill.prefill_scripts.append(prefill_reply("", 1))
    done = await complete(c, prompt="hi", max_tokens=4)
    assert done.text == "🙂" and done.usage.completion_tokens == 4 and done.finish_reason == LENGTH


async def test_immediate_eos_at_prefill_aborts_decode(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses.append(disaggregated(c.prefill, c.decode))
    c.decode.decode_scripts.append([admitted(), Hang()])
    c.prefill.prefill_scripts.append(prefill_reply("", 0, STOP))
    frames = await generate(c, prompt="hi", max_tokens=8)
    assert [f.kind for f in frames] == [FINAL]
    assert frames[0].usage.completion_tokens == 0 and frames[0].finish_reason == STOP
    await asyncio.wait_for(c.decode.aborted.wait(), 5)
    assert c.decode.aborts == [frames[0].request_id]


async def test_chat_messages_use_the_chat_template(cluster: Cluster, tokenizer: PromptTokenizer) -> None:
    c = cluster
    c.scheduler.responses.append(aggregated(c.decode))
    c.decode.decode_scripts.append([final("ok", 1, STOP)])
    msgs = [
        gateway_pb2.ChatMessage(role="system", content="Be brief."),
        gateway_pb2.ChatMessage(role="user", content="Hi"),
    ]
    frames = await generate(c, messages=msgs, max_tokens=4)
    assert frames[-1].text == "ok"
    sent = list(c.decode.decode_requests[0].prompt_token_ids)
    text = tokenizer._tok.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in msgs], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert sent == list(tokenizer.encode_prompt(text))


async def test_client_request_id_is_kept(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses.append(aggregated(c.decode))
    c.decode.decode_scripts.append([final("x", 1, STOP)])
    done = await complete(c, prompt="hi", request_id="my-req 1")
    assert done.request_id == "my-req 1"
    assert c.decode.decode_requests[0].request_id == "my-req 1"


async def test_cancel_mid_stream_aborts_both_workers(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses.append(disaggregated(c.prefill, c.decode))
    c.decode.decode_scripts.append([admitted(), tokens("b"), Hang()])
    c.prefill.prefill_scripts.append(prefill_reply("a", 1))
    call = c.stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", max_tokens=50), timeout=30)
    first = await call.read()
    second = await call.read()
    assert (first.kind, second.kind) == (FIRST, CONT)
    call.cancel()
    await asyncio.wait_for(asyncio.gather(c.decode.aborted.wait(), c.prefill.aborted.wait()), 5)
    assert c.decode.aborts == [first.request_id] and c.prefill.aborts == [first.request_id]
    for _ in range(100):
        if c.decode.decode_cancelled:
            break
        await asyncio.sleep(0.02)
    assert c.decode.decode_cancelled == 1  # the decode stream itself was cancelled too


async def test_cancel_while_prefill_runs_aborts_both_workers(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses.append(disaggregated(c.prefill, c.decode))
    c.decode.decode_scripts.append([admitted(), Hang()])
    c.prefill.prefill_scripts.append(Hang())
    task = asyncio.ensure_future(complete(c, prompt="hi", request_id="cancel-me"))
    await asyncio.wait_for(c.prefill.prefill_started.wait(), 5)
    task.cancel()
    await asyncio.wait_for(asyncio.gather(c.decode.aborted.wait(), c.prefill.aborted.wait()), 5)
    assert c.decode.aborts == ["cancel-me"] and c.prefill.aborts == ["cancel-me"]


async def test_client_deadline_aborts_both_workers(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses.append(disaggregated(c.prefill, c.decode))
    c.decode.decode_scripts.append([admitted(), tokens("b"), Hang()])
    c.prefill.prefill_scripts.append(prefill_reply("a", 1))
    call = c.stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", request_id="slow"), timeout=1.0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [f async for f in call]
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(asyncio.gather(c.decode.aborted.wait(), c.prefill.aborted.wait()), 5)


async def test_retry_before_handoff_on_unavailable_decode(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses += [disaggregated(c.prefill, c.decode), disaggregated(c.prefill, c.decode2)]
    c.decode.decode_scripts.append([Fail(grpc.StatusCode.UNAVAILABLE, "draining")])
    c.decode2.decode_scripts.append([admitted(), final("b", 1, STOP)])
    c.prefill.prefill_scripts.append(prefill_reply("a", 1))
    done = await complete(c, prompt="hi", max_tokens=8)
    assert done.text == "ab" and done.usage.completion_tokens == 2
    assert list(c.scheduler.requests[1].exclude_worker_ids) == ["decode-1"]
    assert c.prefill.prefill_requests[0].kv_target.address == c.decode2.address


async def test_retry_before_handoff_on_unavailable_prefill(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses += [disaggregated(c.prefill, c.decode), aggregated(c.decode2)]
    c.decode.decode_scripts.append([admitted(), Hang()])
    c.prefill.prefill_scripts.append(Fail(grpc.StatusCode.UNAVAILABLE, "prefill worker is gone"))
    c.decode2.decode_scripts.append([tokens("x"), final("", 1, STOP)])
    frames = await generate(c, prompt="hi", max_tokens=8, request_id="r-retry")
    assert "".join(f.text for f in frames) == "x" and frames[-1].usage.completion_tokens == 1
    assert list(c.scheduler.requests[1].exclude_worker_ids) == ["prefill-1"]
    # the client keeps its id; the second attempt runs under a fresh worker-side id
    assert all(f.request_id == "r-retry" for f in frames)
    assert c.decode2.decode_requests[0].request_id == "r-retry:retry1"
    # the first decode worker had admitted the request: its KV reservation is released
    await asyncio.wait_for(c.decode.aborted.wait(), 5)
    assert c.decode.aborts == ["r-retry"]


async def test_last_unavailable_is_reported(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses += [Fail(grpc.StatusCode.UNAVAILABLE, "no decode worker")] * 3
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await complete(c, prompt="hi")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no decode worker" in (err.value.details() or "")
    assert len(c.scheduler.requests) == 3  # the first try + two reschedules


async def test_out_of_capacity_retries_elsewhere_then_keeps_its_code(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses += [aggregated(c.decode), aggregated(c.decode2), aggregated(c.decode2)]
    c.decode.decode_scripts.append([Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV pool full")])
    c.decode2.decode_scripts.append([Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV pool full")])
    c.decode2.decode_scripts.append([Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV pool full")])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await complete(c, prompt="hi")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "decode-2" in (err.value.details() or "") and "KV pool full" in (err.value.details() or "")
    assert list(c.scheduler.requests[1].exclude_worker_ids) == ["decode-1"]


async def test_no_retry_after_first_token(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses += [disaggregated(c.prefill, c.decode), disaggregated(c.prefill, c.decode2)]
    c.decode.decode_scripts.append(
        [admitted(), tokens("b"), Fail(grpc.StatusCode.UNAVAILABLE, "worker died")]
    )
    c.prefill.prefill_scripts.append(prefill_reply("a", 1))
    call = c.stub.Generate(gateway_pb2.GenerateRequest(prompt="hi"), timeout=30)
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for f in call:
            got.append(f)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [f.kind for f in got] == [FIRST, CONT]
    assert len(c.scheduler.requests) == 1


@pytest.mark.parametrize(
    ("worker_code", "client_code", "detail"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT, "bad sampling"),
        (grpc.StatusCode.INTERNAL, grpc.StatusCode.INTERNAL, "internal error; see the server log"),
        (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.FAILED_PRECONDITION, "bad sampling"),
    ],
)
async def test_prefill_errors_map_to_statuses(
    cluster: Cluster, worker_code: grpc.StatusCode, client_code: grpc.StatusCode, detail: str
) -> None:
    c = cluster
    c.scheduler.responses.append(disaggregated(c.prefill, c.decode))
    c.decode.decode_scripts.append([admitted(), Hang()])
    c.prefill.prefill_scripts.append(Fail(worker_code, "bad sampling"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(c, prompt="hi", request_id=f"err-{worker_code.name}")
    assert err.value.code() == client_code
    assert detail in (err.value.details() or "")
    await asyncio.wait_for(c.decode.aborted.wait(), 5)  # the admitted decode side is released


async def test_scheduler_not_found_maps_to_not_found(cluster: Cluster) -> None:
    cluster.scheduler.responses.append(Fail(grpc.StatusCode.NOT_FOUND, "no worker serves model"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await complete(cluster, prompt="hi")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("fields", "code", "detail"),
    [
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "set exactly one of prompt"),
        (
            {"prompt": "a", "prompt_token_ids": [1]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "sets prompt and prompt_token_ids",
        ),
        ({"prompt": "a", "max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1"),
        ({"prompt": "a", "top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
        ({"prompt": "a", "temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, "temperature must be"),
        ({"prompt": "a", "min_p": 2.0}, grpc.StatusCode.INVALID_ARGUMENT, "min_p must be in [0, 1]"),
        (
            {"prompt_token_ids": [10**6]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "is not a token of the served model",
        ),
        ({"prompt": "a", "stop": ["x"] * 17}, grpc.StatusCode.INVALID_ARGUMENT, "at most 16 stop strings"),
        ({"prompt": "a", "request_id": "x" * 129}, grpc.StatusCode.INVALID_ARGUMENT, "the limit is 128"),
        (
            {"messages": [gateway_pb2.ChatMessage(role="bot", content="x")]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "role",
        ),
        ({"prompt": "a", "model": "gpt-9"}, grpc.StatusCode.NOT_FOUND, "'gpt-9' is not served"),
    ],
)
async def test_invalid_requests_start_nothing(
    cluster: Cluster, fields: dict[str, object], code: grpc.StatusCode, detail: str
) -> None:
    for call in (generate, complete):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(cluster, **fields)
        assert err.value.code() == code
        assert detail in (err.value.details() or "")
    assert cluster.scheduler.requests == []


async def test_max_model_len_from_schedule_response(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses.append(aggregated(c.decode, max_model_len=8))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await complete(c, prompt_token_ids=[1, 2, 3, 4], max_tokens=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens <= 4" in (err.value.details() or "")
    assert c.decode.decode_requests == []


async def test_budget_resolved_on_the_listed_max_model_len_before_scheduling(cluster: Cluster) -> None:
    """The cluster lists model tiny at 8 tokens (its smallest worker): an explicit max_tokens that
    does not fit is refused before any Schedule call; an unset one is resolved to what fits (4 of
    the default 256), which is what the scheduler is told and the worker gets."""
    c = cluster
    c.scheduler.state = scheduler_pb2.GetStateResponse(
        workers=[
            scheduler_pb2.SchedulerWorker(info=common_pb2.WorkerInfo(model_id="tiny", max_model_len=n))
            for n in (8, 16)
        ]
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await complete(c, prompt_token_ids=[1, 2, 3, 4], max_tokens=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens <= 4" in (err.value.details() or "")
    assert c.scheduler.requests == [] and c.decode.decode_requests == []
    c.scheduler.responses.append(aggregated(c.decode, max_model_len=8))
    c.decode.decode_scripts.append([admitted(), tokens("ab", 5), tokens("cd", 6), final("", 4, LENGTH)])
    resp = await complete(c, prompt_token_ids=[1, 2, 3, 4])
    assert c.scheduler.requests[0].max_tokens == 4
    assert c.decode.decode_requests[0].sampling.max_tokens == 4
    assert resp.finish_reason == LENGTH and resp.usage.completion_tokens == 4


async def test_duplicate_in_flight_request_id(cluster: Cluster) -> None:
    c = cluster
    release = asyncio.Event()
    c.scheduler.responses.append(aggregated(c.decode))
    c.decode.decode_scripts.append([tokens("a"), Hang(release), final("", 2, STOP)])
    call = c.stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", request_id="dup"), timeout=30)
    await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await complete(c, prompt="hi", request_id="dup")
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    release.set()
    rest = await read_rest(call)
    assert rest[-1].kind == FINAL


async def test_drain_past_grace_cancels_and_aborts_on_workers(cluster: Cluster) -> None:
    c = cluster
    c.scheduler.responses.append(disaggregated(c.prefill, c.decode))
    c.decode.decode_scripts.append([admitted(), tokens("b"), Hang()])
    c.prefill.prefill_scripts.append(prefill_reply("a", 1))
    call = c.stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", request_id="stuck"), timeout=30)
    await call.read()
    await c.app.drain()  # drain_grace_s=1 in these tests
    assert c.decode.aborts == ["stuck"] and c.prefill.aborts == ["stuck"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await read_rest(call)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shut down before this request finished" in (err.value.details() or "")


async def test_list_models_from_scheduler_state(cluster: Cluster) -> None:
    def worker(model: str, n: int) -> scheduler_pb2.SchedulerWorker:
        return scheduler_pb2.SchedulerWorker(info=common_pb2.WorkerInfo(model_id=model, max_model_len=n))

    cluster.scheduler.state = scheduler_pb2.GetStateResponse(
        workers=[
            worker("tiny", 0),
            worker("tiny", 2048),
            worker("tiny", 1024),
            worker("other", 512),
            worker("", 9),
        ]
    )
    resp = await cluster.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
    assert [(m.id, m.max_model_len) for m in resp.models] == [("other", 512), ("tiny", 1024)]


async def test_list_models_scheduler_down(tiny_model: Path) -> None:
    app = build_app(gateway_settings(tiny_model, "127.0.0.1:1", worker_rpc_timeout_s=2.0))
    await app.start()
    try:
        async with grpc.aio.insecure_channel(app.server.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
    finally:
        await app.stop(0)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "scheduler 127.0.0.1:1 is unavailable" in (err.value.details() or "")


async def test_metrics_count_usage(cluster: Cluster) -> None:
    before = (
        sample_total("pdserve_generation_tokens_total"),
        sample_total("pdserve_requests_total", finish_reason="length"),
    )
    c = cluster
    c.scheduler.responses.append(disaggregated(c.prefill, c.decode))
    c.decode.decode_scripts.append([admitted(), tokens("b"), final("", 10**9, STOP)])
    c.prefill.prefill_scripts.append(prefill_reply("a", 1))
    await complete(c, prompt="hi", max_tokens=6)
    after = (
        sample_total("pdserve_generation_tokens_total"),
        sample_total("pdserve_requests_total", finish_reason="length"),
    )
    assert after[0] - before[0] == 6
    assert after[1] - before[1] == 1


async def test_health_not_serving_until_tokenizer_loaded(tiny_model: Path, cluster: Cluster) -> None:
    app = build_app(gateway_settings(tiny_model, cluster.scheduler.address))
    await app.server.start()
    async with grpc.aio.insecure_channel(app.server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="pdserve.v1.Gateway")
        assert (await health.Check(check, timeout=5)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await gateway_complete(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await app.load()
        await app.server.set_serving(True)
        assert (await health.Check(check, timeout=5)).status == health_pb2.HealthCheckResponse.SERVING
    await app.stop(0)


async def gateway_complete(channel: grpc.aio.Channel) -> None:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    await stub.Complete(gateway_pb2.GenerateRequest(prompt="hi"), timeout=5)


async def test_drain_rejects_new_requests_and_finishes_in_flight(cluster: Cluster) -> None:
    c = cluster
    release = asyncio.Event()
    c.scheduler.responses.append(aggregated(c.decode))
    c.decode.decode_scripts.append([tokens("a"), Hang(release), final("b", 2, STOP)])
    call = c.stub.Generate(gateway_pb2.GenerateRequest(prompt="hi"), timeout=30)
    await call.read()
    drain = asyncio.ensure_future(c.app.drain())  # waits for the stream, up to drain_grace_s
    await asyncio.sleep(0.1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await complete(c, prompt="hi")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not drain.done()
    release.set()
    await drain
    rest = await read_rest(call)
    assert rest[-1].kind == FINAL and rest[-1].usage.completion_tokens == 2
