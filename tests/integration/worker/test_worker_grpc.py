"""Worker RPCs over real channels: unified and disaggregated generation vs HF generate, accounting
fields, abort, validation, layout checks, Info/GetLoad, health."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.worker.engine.api import Engine, EngineConfig
from services.worker.server import WorkerApp, default_engine_factory
from shared.cluster import LORA_RUNTIME_CAPABILITY, NIXL_PARTS_CAPABILITY
from shared.proto import common_pb2, worker_pb2, worker_pb2_grpc
from shared.server import CHANNEL_OPTIONS
from tests.support.reference import hf_greedy, tokenize

from .harness import (
    BLOCK_SIZE,
    KV_CACHE_TOKENS,
    MAX_MODEL_LEN,
    RunningWorker,
    collect,
    running_worker,
    sampling,
    worker_settings,
)

PROMPT = "Prefill and decode run on different workers; the KV cache moves between them."
ADMITTED = worker_pb2.DECODE_FRAME_KIND_ADMITTED
TOKENS = worker_pb2.DECODE_FRAME_KIND_TOKENS
FINAL = worker_pb2.DECODE_FRAME_KIND_FINAL


@pytest.fixture
async def unified(tiny_model: Path) -> AsyncIterator[RunningWorker]:
    async with running_worker(worker_settings(tiny_model, "unified")) as w:
        yield w


def prompt_ids(model: Path, text: str = PROMPT) -> list[int]:
    ids = tokenize(model, text)
    assert len(ids) > 3 * BLOCK_SIZE  # spans several blocks (and a partial one, usually)
    return ids


def all_blocks_free(w: RunningWorker, rank: int = 0) -> bool:
    engine = w.app.engine
    assert engine is not None
    return engine.num_free_blocks(rank) == engine.num_total_blocks(rank)


async def wait_blocks_free(w: RunningWorker, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not all_blocks_free(w):
        assert loop.time() < deadline, "KV blocks were not freed"
        await asyncio.sleep(0.02)


def token_ids_of(frames: list[worker_pb2.DecodeFrame]) -> list[int]:
    return [t for f in frames for t in f.token_ids]


async def test_unified_local_prefill_matches_hf_generate(unified: RunningWorker, tiny_model: Path) -> None:
    ids = prompt_ids(tiny_model)
    max_tokens = 24
    want = hf_greedy(tiny_model, ids, max_tokens)
    frames = await collect(
        unified.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="u1",
                prompt_token_ids=ids,
                sampling=sampling(max_tokens),
                local_prefill=True,
                return_token_ids=True,
            )
        )
    )
    assert frames[0].kind == ADMITTED
    assert frames[-1].kind == FINAL
    assert all(f.kind == TOKENS for f in frames[1:-1])
    assert token_ids_of(frames) == want
    final = frames[-1]
    assert final.HasField("generated_tokens")
    assert final.generated_tokens == len(want)
    expected_reason = (
        common_pb2.FINISH_REASON_LENGTH if len(want) == max_tokens else common_pb2.FINISH_REASON_STOP
    )
    assert final.finish_reason == expected_reason
    for f in frames[:-1]:
        assert not f.HasField("generated_tokens")
        assert f.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    for f in frames:
        assert f.request_id == "u1"
        assert f.prompt_tokens == len(ids)
        assert f.transferred_cached_tokens == 0
    await wait_blocks_free(unified)


async def test_token_ids_only_when_asked(unified: RunningWorker, tiny_model: Path) -> None:
    ids = prompt_ids(tiny_model)
    frames = await collect(
        unified.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="u2",
                prompt_token_ids=ids,
                sampling=sampling(8),
                local_prefill=True,
            )
        )
    )
    assert token_ids_of(frames) == []
    assert frames[-1].generated_tokens == len(hf_greedy(tiny_model, ids, 8))
    assert "".join(f.text for f in frames)


async def disaggregated(
    prefill: RunningWorker,
    decode: RunningWorker,
    request_id: str,
    ids: list[int],
    max_tokens: int,
    kv_transport: worker_pb2.KvTransport | None = None,
    nixl_parts: bool | None = None,
    reply_before_handoff: bool | None = None,
) -> tuple[worker_pb2.PrefillResponse, list[worker_pb2.DecodeFrame]]:
    """The gateway's sequence: Decode (admit) -> Prefill with kv_target (the decode worker's
    trim passed on, when it sent one) -> the rest of Decode."""
    stream = decode.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling=sampling(max_tokens),
            return_token_ids=True,
        )
    )
    admitted = await stream.read()
    assert admitted.kind == ADMITTED
    assert admitted.transfer_ticket
    reply = await prefill.stub.Prefill(
        worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling=sampling(max_tokens),
            return_token_ids=True,
            kv_target=worker_pb2.KvTarget(
                address=decode.address,
                dp_rank=0,
                transfer_ticket=admitted.transfer_ticket,
                skip_blocks=admitted.cached_blocks,
                trim_blocks=admitted.trim_blocks if admitted.HasField("trim_blocks") else None,
                kv_transport=kv_transport,
                nixl_parts=nixl_parts,
                reply_before_handoff=reply_before_handoff,
            ),
        )
    )
    frames = [admitted, *await collect(stream)]
    return reply, frames


def _hold_kv_receipts(w: RunningWorker) -> asyncio.Event:
    """The decode worker's PushKv handler waits for the returned event before it takes the KV
    (a slow link); returns the event."""
    core = w.app.core
    assert core is not None
    receiver = core._receiver
    real = receiver.receive
    go = asyncio.Event()

    async def receive(chunks: Any) -> Any:
        await go.wait()
        return await real(chunks)

    receiver.receive = receive  # type: ignore[method-assign]
    return go


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
async def test_the_first_token_goes_out_before_the_handoff_ends(
    decode: RunningWorker, tiny_model: Path, transport: str
) -> None:
    """KvTarget.reply_before_handoff: the Prefill reply (the first token) comes while the decode
    worker has not taken the KV yet; the prefill worker holds its blocks until the handoff
    ended; the tokens equal those of a handoff the reply waits for. Then the gateway's Abort of a
    request whose handoff is in flight after its reply frees both workers' blocks, the decode
    side's request ending ABORT before any token."""
    if transport == "nixl":
        pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed")
    nixl = (worker_pb2.KV_TRANSPORT_NIXL, True) if transport == "nixl" else (None, None)
    async with running_worker(
        worker_settings(tiny_model, "prefill", max_batch_tokens=2 * BLOCK_SIZE)
    ) as prefill:
        ids = prompt_ids(tiny_model)
        waited_reply, waited = await disaggregated(prefill, decode, "w1", ids, 8, *nixl)
        go = _hold_kv_receipts(decode)

        async def early(request_id: str) -> tuple[Any, worker_pb2.PrefillResponse]:
            """Admit on the decode worker, then Prefill answering before its handoff ends
            (which cannot end: the decode worker holds the KV until `go`)."""
            stream = decode.stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id=request_id, prompt_token_ids=ids, sampling=sampling(8), return_token_ids=True
                )
            )
            admitted = await stream.read()
            reply = await prefill.stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=request_id,
                    prompt_token_ids=ids,
                    sampling=sampling(8),
                    return_token_ids=True,
                    kv_target=worker_pb2.KvTarget(
                        address=decode.address,
                        transfer_ticket=admitted.transfer_ticket,
                        skip_blocks=admitted.cached_blocks,
                        kv_transport=nixl[0],
                        nixl_parts=nixl[1],
                        reply_before_handoff=True,
                    ),
                ),
                timeout=30,
            )
            return stream, reply

        stream, reply = await early("e1")
        assert list(reply.token_ids) == list(waited_reply.token_ids)
        assert reply.kv_bytes_sent == 0 and not reply.HasField("kv_transport")
        assert not all_blocks_free(prefill), "the blocks are held while the handoff is in flight"
        go.set()
        frames = await collect(stream)
        assert token_ids_of(frames) == token_ids_of(waited[1:]) and frames[-1].kind == FINAL
        await wait_blocks_free(prefill)
        await wait_blocks_free(decode)

        # the gateway's Abort of both workers while the handoff is in flight after the reply
        go.clear()
        stream, reply = await early("a1")
        assert len(reply.token_ids) == 1 and not all_blocks_free(prefill)
        for w in (prefill, decode):
            assert (await w.stub.Abort(worker_pb2.AbortRequest(request_id="a1"))).found
        await wait_blocks_free(prefill)
        go.set()
        rest = await collect(stream)
        assert [f.kind for f in rest] == [FINAL]
        assert rest[0].finish_reason == common_pb2.FINISH_REASON_ABORT
        await wait_blocks_free(decode)


async def test_disaggregated_matches_unified_and_hf_generate(
    prefill: RunningWorker, decode: RunningWorker, unified: RunningWorker, tiny_model: Path
) -> None:
    ids = prompt_ids(tiny_model)
    max_tokens = 20
    reply, frames = await disaggregated(prefill, decode, "d1", ids, max_tokens)

    # The first-token reply: authoritative count 1, not finished, KV pushed in several chunks.
    assert reply.HasField("generated_tokens") and reply.generated_tokens == 1
    assert reply.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert len(reply.token_ids) == 1
    assert reply.prompt_tokens == len(ids)
    assert reply.kv_bytes_sent > 0
    assert reply.num_chunks >= 1
    assert reply.prefill_ns > 0 and reply.kv_transfer_ns > 0

    # Decode frames: counts only on FINAL, the decode worker's own post-handoff count.
    assert frames[-1].kind == FINAL
    assert all(not f.HasField("generated_tokens") for f in frames[:-1])
    disagg = list(reply.token_ids) + token_ids_of(frames)
    assert frames[-1].generated_tokens == len(disagg) - 1
    assert frames[-1].transferred_cached_tokens + frames[-1].local_cached_tokens == len(ids)
    assert frames[-1].transferred_cached_tokens > 0
    for f in frames:
        assert f.prompt_tokens == len(ids)

    unified_frames = await collect(
        unified.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="d1-unified",
                prompt_token_ids=ids,
                sampling=sampling(max_tokens),
                local_prefill=True,
                return_token_ids=True,
            )
        )
    )
    assert disagg == token_ids_of(unified_frames)
    assert disagg == hf_greedy(tiny_model, ids, max_tokens)
    assert frames[-1].finish_reason == unified_frames[-1].finish_reason
    # Text continues seamlessly across the handoff.
    text = reply.text + "".join(f.text for f in frames)
    assert text == "".join(f.text for f in unified_frames)

    await wait_blocks_free(decode)
    await wait_blocks_free(prefill)


def _on_kv_parts(engine: Any, seen: Callable[[int], None]) -> None:
    """Calls seen(first block) after each part of a handoff the decode engine imported (a gRPC
    chunk) or READ (a NIXL part)."""
    real_import, real_read = engine.import_kv, engine.import_kv_direct

    def import_kv(ticket: str, chunk: Any) -> None:
        real_import(ticket, chunk)
        seen(chunk.first_block)

    def import_kv_direct(ticket: str, first_block: int, num_blocks: int, read: Any) -> int:
        nbytes = real_read(ticket, first_block, num_blocks, read)
        seen(first_block)
        return nbytes

    engine.import_kv = import_kv
    engine.import_kv_direct = import_kv_direct


@pytest.mark.parametrize("transport", ["grpc", "nixl", "nixl-at-end"])
async def test_a_prefill_in_several_chunks_pushes_each_chunks_blocks_before_the_next(
    decode: RunningWorker, unified: RunningWorker, tiny_model: Path, transport: str
) -> None:
    """A prompt prefilled BLOCK_SIZE tokens per step: over the gRPC push (and over NIXL with
    KvTarget.nixl_parts, 1.10) each chunk's complete blocks reach the decode worker while later
    chunks compute (the prefill's last chunk is held until the decode worker imported, or READ,
    a first part; without the early handoff that never happens), the rest with the first token
    at the end. Over NIXL without nixl_parts (what a decode worker without the kv_nixl_parts
    capability gets) everything is READ at the end, in one message. Either way the tokens are
    unified serving's and every block is freed."""
    nixl = transport.startswith("nixl")
    if nixl:
        pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed")
        info = await decode.stub.Info(worker_pb2.InfoRequest())
        assert NIXL_PARTS_CAPABILITY in info.capabilities
    settings = worker_settings(tiny_model, "prefill", max_batch_tokens=BLOCK_SIZE)
    async with running_worker(settings) as prefill:
        prefill_engine, decode_engine = prefill.app.engine, decode.app.engine
        assert prefill_engine is not None and decode_engine is not None
        imported = threading.Event()
        first_parts: list[int] = []

        def seen(first_block: int) -> None:
            first_parts.append(first_block)
            imported.set()

        _on_kv_parts(decode_engine, seen)
        rank = prefill_engine._ranks[0]  # type: ignore[attr-defined]
        real_execute = rank._execute
        before_last_chunk: list[bool] = []

        def execute(plan: Any, batch: Any) -> Any:
            if any(s.samples and s.request.request_id == "e1" for s in plan.scheduled):
                # the last prompt chunk (it samples the first token): the decode worker has a part?
                early = transport != "nixl-at-end"
                before_last_chunk.append(imported.wait(30) if early else imported.is_set())
            return real_execute(plan, batch)

        rank._execute = execute
        ids = prompt_ids(tiny_model)
        kv_transport = worker_pb2.KV_TRANSPORT_NIXL if nixl else None
        nixl_parts = True if transport == "nixl" else None
        reply, frames = await disaggregated(prefill, decode, "e1", ids, 12, kv_transport, nixl_parts)
        assert reply.num_chunks >= 3  # prefill chunks
        assert before_last_chunk == [transport != "nixl-at-end"]
        assert first_parts[0] == 0 and sorted(first_parts) == first_parts
        if nixl:
            assert reply.kv_transport == worker_pb2.KV_TRANSPORT_NIXL
            # every prompt block READ once: one READ per prefill chunk, or one at the end
            layout = decode_engine.kv_layout
            block_bytes = layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * 4
            assert reply.kv_bytes_sent == -(-len(ids) // layout.block_size) * layout.block_size * block_bytes
            assert len(first_parts) == (1 if transport == "nixl-at-end" else reply.num_chunks)
        assert frames[-1].transferred_cached_tokens == len(ids)
        expected = await collect(
            unified.stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id="e1-unified",
                    prompt_token_ids=ids,
                    sampling=sampling(12),
                    local_prefill=True,
                    return_token_ids=True,
                )
            )
        )
        assert list(reply.token_ids) + token_ids_of(frames) == token_ids_of(expected)
        await wait_blocks_free(decode)
        await wait_blocks_free(prefill)


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
async def test_a_prefill_cancelled_after_an_early_push_aborts_the_decode_request(
    decode: RunningWorker, tiny_model: Path, transport: str
) -> None:
    """The Prefill call goes away after the decode worker imported (or, NIXL in parts, READ) a
    first part of the KV: the PushKv call breaks, the decode worker aborts the request (its KV
    can never complete) and both workers free every block."""
    if transport == "nixl":
        pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed")
    settings = worker_settings(tiny_model, "prefill", max_batch_tokens=BLOCK_SIZE)
    async with running_worker(settings) as prefill:
        prefill_engine, decode_engine = prefill.app.engine, decode.app.engine
        assert prefill_engine is not None and decode_engine is not None
        imported, cancelled = threading.Event(), threading.Event()
        _on_kv_parts(decode_engine, lambda first: imported.set())
        rank = prefill_engine._ranks[0]  # type: ignore[attr-defined]
        real_execute = rank._execute

        def execute(plan: Any, batch: Any) -> Any:
            if any(s.samples for s in plan.scheduled):  # hold the last chunk until cancelled
                cancelled.wait(30)
            return real_execute(plan, batch)

        rank._execute = execute
        ids = prompt_ids(tiny_model)
        nixl = (worker_pb2.KV_TRANSPORT_NIXL, True) if transport == "nixl" else (None, None)
        task = asyncio.ensure_future(disaggregated(prefill, decode, "x1", ids, 8, *nixl))
        assert await asyncio.to_thread(imported.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        cancelled.set()
        await wait_blocks_free(decode)
        await wait_blocks_free(prefill)


async def test_kv_push_skips_blocks_cached_on_the_decode_worker(
    prefill: RunningWorker, decode: RunningWorker, tiny_model: Path
) -> None:
    ids = prompt_ids(tiny_model)
    first_reply, first = await disaggregated(prefill, decode, "c1", ids, 6)
    second_reply, second = await disaggregated(prefill, decode, "c2", ids, 6)
    assert second[0].cached_blocks > 0  # the decode worker's prefix cache holds the prompt
    assert second_reply.kv_bytes_sent < first_reply.kv_bytes_sent
    assert second[-1].local_cached_tokens >= second[0].cached_blocks * BLOCK_SIZE
    assert list(second_reply.token_ids) + token_ids_of(second) == list(first_reply.token_ids) + token_ids_of(
        first
    )


async def test_prefill_without_kv_target_frees_its_blocks(prefill: RunningWorker, tiny_model: Path) -> None:
    ids = prompt_ids(tiny_model)
    reply = await prefill.stub.Prefill(
        worker_pb2.PrefillRequest(
            request_id="p1",
            prompt_token_ids=ids,
            sampling=sampling(1),
        )
    )
    assert reply.generated_tokens == 1
    assert list(reply.token_ids) == []  # not asked for
    assert reply.finish_reason == common_pb2.FINISH_REASON_LENGTH  # max_tokens = 1
    assert reply.kv_bytes_sent == 0
    assert reply.num_chunks >= 1
    await wait_blocks_free(prefill)


async def test_abort_frees_admitted_blocks(decode: RunningWorker, tiny_model: Path) -> None:
    ids = prompt_ids(tiny_model)
    stream = decode.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id="a1",
            prompt_token_ids=ids,
            sampling=sampling(16),
        )
    )
    admitted = await stream.read()
    assert admitted.kind == ADMITTED
    assert not all_blocks_free(decode)  # blocks reserved for the incoming KV
    found = await decode.stub.Abort(worker_pb2.AbortRequest(request_id="a1"))
    assert found.found
    rest = await collect(stream)
    assert rest[-1].kind == FINAL
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert rest[-1].generated_tokens == 0
    await wait_blocks_free(decode)
    unknown = await decode.stub.Abort(worker_pb2.AbortRequest(request_id="nope"))
    assert not unknown.found


async def test_client_cancel_frees_blocks(unified: RunningWorker, tiny_model: Path) -> None:
    ids = prompt_ids(tiny_model)
    stream = unified.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id="x1",
            prompt_token_ids=ids,
            sampling=sampling(MAX_MODEL_LEN - len(ids), ignore_eos=True),
            local_prefill=True,
        )
    )
    assert (await stream.read()).kind == ADMITTED
    await stream.read()
    stream.cancel()
    await wait_blocks_free(unified)


@pytest.mark.parametrize("rpc", ["Prefill", "Decode"])
async def test_invalid_inputs_are_invalid_argument(
    prefill: RunningWorker, decode: RunningWorker, tiny_model: Path, rpc: str
) -> None:
    ids = prompt_ids(tiny_model)
    bad: list[dict[str, Any]] = [
        dict(prompt_token_ids=ids, sampling=sampling(4), dp_rank=1),  # one rank only
        dict(prompt_token_ids=[], sampling=sampling(4)),
        dict(prompt_token_ids=[5] * (MAX_MODEL_LEN + 1), sampling=sampling(4)),
        dict(prompt_token_ids=ids, sampling=sampling(0)),
    ]
    for i, fields in enumerate(bad):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if rpc == "Prefill":
                await prefill.stub.Prefill(worker_pb2.PrefillRequest(request_id=f"b{i}", **fields))
            else:
                await collect(decode.stub.Decode(worker_pb2.DecodeRequest(request_id=f"b{i}", **fields)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert info.value.details()
    await wait_blocks_free(decode)


async def test_role_mismatch_is_failed_precondition(prefill: RunningWorker, tiny_model: Path) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(
            prefill.stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id="r1",
                    prompt_token_ids=prompt_ids(tiny_model),
                    sampling=sampling(4),
                )
            )
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def kv_chunk(ticket: str, layout: common_pb2.KvLayout, **kw: Any) -> worker_pb2.KvChunk:
    fields: dict[str, Any] = dict(first_block=0, num_blocks=0, data=b"")
    fields.update(kw)
    return worker_pb2.KvChunk(request_id="k1", transfer_ticket=ticket, layout=layout, **fields)


async def test_push_kv_layout_mismatch_and_unknown_ticket(
    decode: RunningWorker, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.worker import kv_receive

    monkeypatch.setattr(kv_receive, "ADMISSION_WAIT_S", 0.1)  # how long an unknown ticket waits
    info = await decode.stub.Info(worker_pb2.InfoRequest())
    stream = decode.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id="k1",
            prompt_token_ids=prompt_ids(tiny_model),
            sampling=sampling(4),
        )
    )
    ticket = (await stream.read()).transfer_ticket
    wrong = common_pb2.KvLayout()
    wrong.CopyFrom(info.kv_layout)
    wrong.block_size = info.kv_layout.block_size * 2

    async def one(chunk: worker_pb2.KvChunk) -> AsyncIterator[worker_pb2.KvChunk]:
        yield chunk

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await decode.stub.PushKv(
            one(kv_chunk(ticket, wrong, last=True, num_tokens=4, first_token_id=5, generated_tokens=1))
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "layout" in (err.value.details() or "")
    # The refused handoff ended the request waiting under its ticket (the prefill worker may
    # have answered the gateway already: nobody else would end it); its blocks are free.
    frames = await collect(stream)
    assert [f.kind for f in frames] == [FINAL] and frames[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    await wait_blocks_free(decode)

    # A push under a ticket nobody waits on ends nothing else.
    stream = decode.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id="k2", prompt_token_ids=prompt_ids(tiny_model), sampling=sampling(4)
        )
    )
    await stream.read()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await decode.stub.PushKv(
            one(kv_chunk("no-such-ticket", info.kv_layout, num_blocks=1, data=b"\0" * 4, last=False))
        )
    assert err.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
    assert (await decode.stub.Abort(worker_pb2.AbortRequest(request_id="k2"))).found
    frames = await collect(stream)
    assert frames[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    await wait_blocks_free(decode)


async def test_info_and_get_load(decode: RunningWorker, tiny_model: Path) -> None:
    info = await decode.stub.Info(worker_pb2.InfoRequest())
    assert info.worker_id == decode.app.worker_id
    assert info.address == decode.address
    assert info.role == common_pb2.WORKER_ROLE_DECODE
    assert info.model_id
    assert info.dp_size == 1
    assert info.kv_layout.block_size == BLOCK_SIZE
    assert info.kv_layout.dtype == "float32"
    assert info.kv_layout.num_layers == 2
    assert info.kv_layout.num_kv_heads == 2
    assert info.kv_layout.head_dim == 16
    assert set(info.capabilities) >= {"generated_tokens", "kv_block_skip", "local_prefill"}
    # 1.3 first_output_index, 1.4 penalties, 1.5 logprobs, 1.6 structured, 1.7 kv_transport
    assert info.proto_version == "1.19"
    assert info.max_model_len == MAX_MODEL_LEN
    assert info.device == "cpu"

    load = await decode.stub.GetLoad(worker_pb2.GetLoadRequest())
    assert load.worker_id == info.worker_id
    assert [r.dp_rank for r in load.ranks] == [0]
    rank = load.ranks[0]
    assert rank.kv_capacity_tokens > 0
    assert rank.kv_capacity_tokens <= KV_CACHE_TOKENS
    assert rank.num_used_tokens == 0 and rank.num_running == 0 and rank.num_waiting == 0

    ids = prompt_ids(tiny_model)
    stream = decode.stub.Decode(
        worker_pb2.DecodeRequest(request_id="l1", prompt_token_ids=ids, sampling=sampling(4))
    )
    await stream.read()
    busy = (await decode.stub.GetLoad(worker_pb2.GetLoadRequest())).ranks[0]
    assert busy.num_used_tokens >= len(ids)
    await decode.stub.Abort(worker_pb2.AbortRequest(request_id="l1"))
    await collect(stream)


async def test_dp_ranks(tiny_model: Path) -> None:
    async with running_worker(worker_settings(tiny_model, "unified", dp_size=2)) as w:
        load = await w.stub.GetLoad(worker_pb2.GetLoadRequest())
        assert [r.dp_rank for r in load.ranks] == [0, 1]
        ids = prompt_ids(tiny_model)
        outs = []
        for rank in (0, 1):
            frames = await collect(
                w.stub.Decode(
                    worker_pb2.DecodeRequest(
                        request_id=f"r{rank}",
                        prompt_token_ids=ids,
                        sampling=sampling(8),
                        dp_rank=rank,
                        local_prefill=True,
                        return_token_ids=True,
                    )
                )
            )
            outs.append(token_ids_of(frames))
        assert outs[0] == outs[1] == hf_greedy(tiny_model, ids, 8)


async def test_health_not_serving_until_loaded(tiny_model: Path) -> None:
    release = threading.Event()

    def slow_factory(config: EngineConfig) -> Engine:
        release.wait(30)
        return default_engine_factory(config)

    app = WorkerApp(worker_settings(tiny_model, "unified"), engine_factory=slow_factory)
    start = asyncio.create_task(app.start())
    try:
        async with grpc.aio.insecure_channel(app.server.address, options=CHANNEL_OPTIONS) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            check = health_pb2.HealthCheckRequest(service="pdserve.v1.Worker")
            await asyncio.wait_for(ch.channel_ready(), 10)
            resp = await health.Check(check)
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.InfoRequest())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in (err.value.details() or "")
            release.set()
            await start
            for service in ("", "pdserve.v1.Worker"):
                resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
        if not start.done():
            await start
        await app.stop()


async def test_byte_fallback_disaggregated_text_and_counts_match_unified(
    tiny_byte_fallback_model: Path,
) -> None:
    model = tiny_byte_fallback_model
    ids = tokenize(model, "日本語のテキスト 🙂🚀 ok, the quick brown fox")
    max_tokens = 24
    async with (
        running_worker(worker_settings(model, "prefill")) as p,
        running_worker(worker_settings(model, "decode")) as d,
        running_worker(worker_settings(model, "unified")) as u,
    ):
        reply, frames = await disaggregated(p, d, "bf1", ids, max_tokens)
        unified_frames = await collect(
            u.stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id="bf1",
                    prompt_token_ids=ids,
                    sampling=sampling(max_tokens),
                    local_prefill=True,
                    return_token_ids=True,
                )
            )
        )
    disagg = list(reply.token_ids) + token_ids_of(frames)
    assert disagg == token_ids_of(unified_frames) == hf_greedy(model, ids, max_tokens)
    assert reply.text + "".join(f.text for f in frames) == "".join(f.text for f in unified_frames)
    assert reply.generated_tokens + frames[-1].generated_tokens == (unified_frames[-1].generated_tokens)
    assert frames[-1].finish_reason == unified_frames[-1].finish_reason


async def test_lora_calls_of_a_worker_without_lora_say_how_to_turn_it_on(unified: RunningWorker) -> None:
    """A worker started without --enable-lora advertises "lora" (it reads the field) but not
    "lora_runtime", and refuses a load with the flag that allows it; an unload of an adapter it
    does not have is NOT_FOUND. Its identity does not change."""
    info = await unified.stub.Info(worker_pb2.InfoRequest())
    assert "lora" in info.capabilities and LORA_RUNTIME_CAPABILITY not in info.capabilities
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await unified.stub.LoadLoraAdapter(worker_pb2.LoadLoraAdapterRequest(name="sql", path="/nowhere"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enable-lora" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await unified.stub.UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(name="sql"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await unified.stub.LoadLoraAdapter(worker_pb2.LoadLoraAdapterRequest(name="sql"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await unified.stub.Info(worker_pb2.InfoRequest()) == info
