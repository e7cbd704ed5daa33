"""KV over NIXL between real workers (UCX on loopback, in one process): identity with unified
serving, descriptors and prefix skipping, the capability, and the failure paths of a READ
(recompute or retry-prefill, an abort while a READ is in flight), blocks freed on both sides."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from services.worker.kv_nixl import KvTransferFailed, KvTransferUnsettled, NixlKvAgent
from shared.cluster import GATEWAY_TICKET_CAPABILITY, NIXL_CAPABILITY, KvLayout
from shared.proto import common_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.test_worker_drain import start_worker, wait_serving
from tests.support.nixl import progressed

from .harness import BLOCK_SIZE, RunningWorker, collect, running_worker, sampling, worker_settings
from .test_worker_grpc import ADMITTED, FINAL, prompt_ids, token_ids_of, wait_blocks_free

pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed")


@pytest.fixture
async def unified(tiny_model: Path) -> AsyncIterator[RunningWorker]:
    async with running_worker(worker_settings(tiny_model, "unified", kv_transport="grpc")) as w:
        yield w


async def nixl_handoff(
    prefill: RunningWorker, decode: RunningWorker, request_id: str, ids: list[int], max_tokens: int
) -> tuple[Any, list[worker_pb2.DecodeFrame]]:
    """The gateway's sequence with kv_transport = NIXL; the Prefill reply or its RpcError."""
    stream = decode.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=ids, sampling=sampling(max_tokens), return_token_ids=True
        )
    )
    admitted = await stream.read()
    assert admitted.kind == ADMITTED
    target = worker_pb2.KvTarget(
        address=decode.address,
        dp_rank=0,
        transfer_ticket=admitted.transfer_ticket,
        skip_blocks=admitted.cached_blocks,
        kv_transport=worker_pb2.KV_TRANSPORT_NIXL,
    )
    try:
        reply: Any = await prefill.stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=ids,
                sampling=sampling(max_tokens),
                return_token_ids=True,
                kv_target=target,
            )
        )
    except grpc.aio.AioRpcError as exc:
        reply = exc
        await decode.stub.Abort(worker_pb2.AbortRequest(request_id=request_id))  # as the gateway does
    return reply, [admitted, *await collect(stream)]


async def unified_tokens(unified: RunningWorker, ids: list[int], max_tokens: int) -> list[int]:
    frames = await collect(
        unified.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id=f"u-{len(ids)}-{max_tokens}",
                prompt_token_ids=ids,
                sampling=sampling(max_tokens),
                local_prefill=True,
                return_token_ids=True,
            )
        )
    )
    return token_ids_of(frames)


async def test_nixl_handoff_matches_unified_and_skips_cached_blocks(
    prefill: RunningWorker, decode: RunningWorker, unified: RunningWorker, tiny_model: Path
) -> None:
    info = await decode.stub.Info(worker_pb2.InfoRequest())
    assert NIXL_CAPABILITY in info.capabilities
    assert info.proto_version == "1.19"
    ids = prompt_ids(tiny_model)
    reply, frames = await nixl_handoff(prefill, decode, "n1", ids, 12)
    assert reply.kv_transport == worker_pb2.KV_TRANSPORT_NIXL
    engine = decode.app.engine
    assert engine is not None
    layout = engine.kv_layout
    block_bytes = layout.num_layers * 2 * layout.num_kv_heads * layout.block_size * layout.head_dim * 4
    num_blocks = -(-len(ids) // layout.block_size)
    assert reply.kv_bytes_sent == num_blocks * block_bytes  # every prompt block, READ once
    assert reply.kv_transfer_ns > 0
    assert frames[-1].kind == FINAL
    assert frames[-1].transferred_cached_tokens == len(ids)
    expected = await unified_tokens(unified, ids, 12)
    assert list(reply.token_ids) + token_ids_of(frames) == expected

    # The decode worker's prefix cache now holds the prompt's full blocks: they are not READ again.
    again, frames2 = await nixl_handoff(prefill, decode, "n2", ids, 12)
    assert frames2[0].cached_blocks > 0
    assert again.kv_bytes_sent == (num_blocks - frames2[0].cached_blocks) * block_bytes
    assert list(again.token_ids) + token_ids_of(frames2) == expected
    await wait_blocks_free(decode)
    await wait_blocks_free(prefill)


async def test_fp8_workers_hand_kv_over_as_unified_serving_computes_it_and_only_to_each_other(
    decode: RunningWorker, tiny_model: Path
) -> None:
    """--quantization fp8 on every worker: the handoff's tokens are the FP8 unified worker's; the
    layout says FP8 weights, so a decode worker of the model's own weights refuses their KV as
    other KV (FAILED_PRECONDITION, nothing left held on either side)."""
    fp8 = dict(quantization="fp8")
    async with (
        running_worker(worker_settings(tiny_model, "prefill", **fp8)) as prefill8,
        running_worker(worker_settings(tiny_model, "decode", **fp8)) as decode8,
        running_worker(worker_settings(tiny_model, "unified", kv_transport="grpc", **fp8)) as unified8,
    ):
        info = await decode8.stub.Info(worker_pb2.InfoRequest())
        assert info.kv_layout.weights == "fp8"
        ids = prompt_ids(tiny_model)
        reply, frames = await nixl_handoff(prefill8, decode8, "f1", ids, 10)
        assert reply.kv_transport == worker_pb2.KV_TRANSPORT_NIXL and frames[-1].kind == FINAL
        assert list(reply.token_ids) + token_ids_of(frames) == await unified_tokens(unified8, ids, 10)
        refused, _ = await nixl_handoff(prefill8, decode, "f2", ids, 10)
        assert isinstance(refused, grpc.aio.AioRpcError)
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and "fp8" in (refused.details() or "")
        for worker in (prefill8, decode8, decode):
            await wait_blocks_free(worker)


async def test_a_push_under_the_gateways_ticket_may_come_before_the_admission(
    prefill: RunningWorker,
    decode: RunningWorker,
    unified: RunningWorker,
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DecodeRequest.transfer_ticket (1.11): the gateway starts the Prefill with the admission,
    its KV target naming the ticket it chose and no blocks to skip. A push that arrives before
    the admission waits for it; the decode worker READs only the blocks it lacks (a second
    request finds the prompt's full blocks in its prefix cache); the tokens are the unified
    ones. A push under a ticket nobody admits fails after the wait, both workers' blocks free."""
    from services.worker import kv_receive

    info = await decode.stub.Info(worker_pb2.InfoRequest())
    assert GATEWAY_TICKET_CAPABILITY in info.capabilities
    ids = prompt_ids(tiny_model)
    expected = await unified_tokens(unified, ids, 10)
    engine = decode.app.engine
    assert engine is not None
    layout = engine.kv_layout
    block_bytes = layout.num_layers * 2 * layout.num_kv_heads * layout.block_size * layout.head_dim * 4

    async def run(
        request_id: str, ticket: str, admit_after_s: float
    ) -> tuple[Any, list[worker_pb2.DecodeFrame]]:
        target = worker_pb2.KvTarget(
            address=decode.address, transfer_ticket=ticket, kv_transport=worker_pb2.KV_TRANSPORT_NIXL
        )
        prefilling = asyncio.ensure_future(
            prefill.stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=request_id,
                    prompt_token_ids=ids,
                    sampling=sampling(10),
                    return_token_ids=True,
                    kv_target=target,
                )
            )
        )
        await asyncio.sleep(admit_after_s)  # the push is waiting for its admission by now
        stream = decode.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id=request_id,
                prompt_token_ids=ids,
                sampling=sampling(10),
                return_token_ids=True,
                transfer_ticket=ticket,
            )
        )
        return await prefilling, await collect(stream)

    reply, frames = await run("g1", "0-gateway-1", 0.3)
    assert frames[0].kind == ADMITTED and frames[0].transfer_ticket == "0-gateway-1"
    assert list(reply.token_ids) + token_ids_of(frames[1:]) == expected
    num_blocks = -(-len(ids) // layout.block_size)
    assert reply.kv_bytes_sent == num_blocks * block_bytes
    reply, frames = await run("g2", "0-gateway-2", 0.0)
    assert frames[0].cached_blocks > 0
    assert reply.kv_bytes_sent == (num_blocks - frames[0].cached_blocks) * block_bytes  # only those it lacked
    assert list(reply.token_ids) + token_ids_of(frames[1:]) == expected

    monkeypatch.setattr(kv_receive, "ADMISSION_WAIT_S", 0.2)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await prefill.stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id="g3",
                prompt_token_ids=ids,
                sampling=sampling(10),
                kv_target=worker_pb2.KvTarget(
                    address=decode.address,
                    transfer_ticket="0-never",
                    kv_transport=worker_pb2.KV_TRANSPORT_NIXL,
                ),
            ),
            timeout=30,
        )
    assert "ticket" in (err.value.details() or "")
    await wait_blocks_free(decode)
    await wait_blocks_free(prefill)


async def test_nixl_progress_thread_serves_the_read_without_the_event_loop(
    unified: RunningWorker, tiny_model: Path
) -> None:
    """`--kv-nixl-progress thread`: NIXL's own thread answers the READ of
    the prefill worker's blocks, whose event loop then never progresses the agent; identity."""
    async with (
        running_worker(worker_settings(tiny_model, "prefill", kv_nixl_progress="thread")) as p,
        running_worker(worker_settings(tiny_model, "decode", kv_nixl_progress="thread")) as d,
    ):
        assert p.app.nixl is not None and p.app.nixl.progress_thread
        calls: list[int] = []
        agent = p.app.nixl._agent
        real = agent.get_new_notifs

        def counted() -> Any:
            calls.append(1)
            return real()

        agent.get_new_notifs = counted
        ids = prompt_ids(tiny_model)
        reply, frames = await nixl_handoff(p, d, "t1", ids, 12)
        assert reply.kv_transport == worker_pb2.KV_TRANSPORT_NIXL and reply.kv_bytes_sent > 0
        assert calls == []
        assert list(reply.token_ids) + token_ids_of(frames) == await unified_tokens(unified, ids, 12)
        await wait_blocks_free(d)
        await wait_blocks_free(p)


def _failing_read(*args: Any, **kwargs: Any) -> int:
    raise KvTransferFailed("injected: the peer went away")


async def test_failed_read_recomputes_on_the_decode_worker(
    prefill: RunningWorker, decode: RunningWorker, unified: RunningWorker, tiny_model: Path
) -> None:
    ids = prompt_ids(tiny_model)
    assert decode.app.nixl is not None
    decode.app.nixl.read = _failing_read  # type: ignore[method-assign]
    reply, frames = await nixl_handoff(prefill, decode, "r1", ids, 12)
    assert isinstance(reply, worker_pb2.PrefillResponse)
    assert reply.kv_bytes_sent == 0  # nothing moved: the decode worker computed the prompt itself
    assert frames[-1].finish_reason != common_pb2.FINISH_REASON_ABORT
    assert frames[-1].transferred_cached_tokens == 0
    assert list(reply.token_ids) + token_ids_of(frames) == await unified_tokens(unified, ids, 12)
    await wait_blocks_free(decode)
    await wait_blocks_free(prefill)


async def test_failed_read_with_retry_prefill_fails_the_handoff(tiny_model: Path) -> None:
    retry_prefill = worker_settings(tiny_model, "decode", kv_load_failure_policy="retry-prefill")
    async with (
        running_worker(worker_settings(tiny_model, "prefill")) as prefill,
        running_worker(retry_prefill) as decode,
    ):
        ids = prompt_ids(tiny_model)
        assert decode.app.nixl is not None
        decode.app.nixl.read = _failing_read  # type: ignore[method-assign]
        reply, frames = await nixl_handoff(prefill, decode, "f1", ids, 8)
        assert isinstance(reply, grpc.aio.AioRpcError)
        assert reply.code() == grpc.StatusCode.UNAVAILABLE  # the gateway retries elsewhere
        assert frames[-1].kind == FINAL and frames[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        await wait_blocks_free(decode)
        await wait_blocks_free(prefill)


async def test_abort_during_a_read_frees_the_blocks_after_it(
    prefill: RunningWorker, decode: RunningWorker, tiny_model: Path
) -> None:
    """A cancel that lands while a READ writes the request's blocks ends the request at once;
    its blocks are freed when the READ returns, never while it may still write them."""
    ids = prompt_ids(tiny_model)
    nixl = decode.app.nixl
    assert nixl is not None
    real_read = nixl.read
    entered, release = threading.Event(), threading.Event()

    def slow_read(*args: Any, **kwargs: Any) -> int:
        entered.set()
        release.wait(10)
        return real_read(*args, **kwargs)

    nixl.read = slow_read  # type: ignore[method-assign]
    task = asyncio.ensure_future(nixl_handoff(prefill, decode, "a1", ids, 8))
    assert await asyncio.to_thread(entered.wait, 10)
    await decode.stub.Abort(worker_pb2.AbortRequest(request_id="a1"))
    engine = decode.app.engine
    assert engine is not None
    assert engine.num_free_blocks(0) < engine.num_total_blocks(0)  # held for the READ in flight
    release.set()
    reply, frames = await task
    assert isinstance(reply, grpc.aio.AioRpcError)  # the ticket is gone: NOT_FOUND
    assert frames[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    await wait_blocks_free(decode)
    await wait_blocks_free(prefill)


async def test_a_timed_out_read_quarantines_its_blocks_until_it_settles(
    prefill: RunningWorker, unified: RunningWorker, tiny_model: Path
) -> None:
    """The prefill worker stops progressing its agent, so the decode worker's READ times out
    still in flight: the request recomputes in fresh blocks (the same tokens as unified) while
    the blocks the READ targeted stay out of the pool; once the prefill worker progresses again
    and the READ ends, they are free."""
    ids = prompt_ids(tiny_model)
    src = prefill.app.nixl
    assert src is not None
    src.progress = lambda: None  # type: ignore[method-assign]
    async with running_worker(worker_settings(tiny_model, "decode", kv_read_timeout_s=0.3)) as decode:
        dst, engine = decode.app.nixl, decode.app.engine
        assert dst is not None and engine is not None
        reply, frames = await nixl_handoff(prefill, decode, "q1", ids, 12)
        assert isinstance(reply, worker_pb2.PrefillResponse)
        assert reply.kv_bytes_sent == 0  # recomputed
        assert frames[-1].finish_reason != common_pb2.FINISH_REASON_ABORT
        assert list(reply.token_ids) + token_ids_of(frames) == await unified_tokens(unified, ids, 12)
        assert dst.num_unsettled() == 1
        num_targets = -(-len(ids) // engine.kv_layout.block_size)
        assert engine.num_total_blocks(0) - engine.num_free_blocks(0) == num_targets  # quarantined
        # what an operator sees: the decode worker's gauge (refreshed by GetLoad)
        await decode.stub.GetLoad(worker_pb2.GetLoadRequest())
        assert REGISTRY.get_sample_value("pdserve_kv_quarantined_blocks", {"dp_rank": "0"}) == num_targets
        del src.progress  # the instance's no-op: NixlKvAgent.progress again
        with progressed(src):
            await wait_blocks_free(decode)
        assert dst.num_unsettled() == 0
        await decode.stub.GetLoad(worker_pb2.GetLoadRequest())
        assert REGISTRY.get_sample_value("pdserve_kv_quarantined_blocks", {"dp_rank": "0"}) == 0
        await wait_blocks_free(prefill)


@pytest.mark.e2e
async def test_sigkill_of_the_prefill_process_during_the_read(
    decode: RunningWorker, unified: RunningWorker, tiny_model: Path, tmp_path: Path
) -> None:
    """A prefill worker process is killed with SIGKILL while the decode worker's READ of its
    blocks is in flight (stopped first, so the READ cannot finish before the kill): the READ
    fails at once (NIXL reports the peer's disconnect; no timeout is waited for) and the
    Prefill call fails UNAVAILABLE (the gateway's cue to retry the prefill elsewhere). The
    decode worker's stream ends clearly within the bound: either aborted (the dead peer's
    PushKv call was cancelled first) or, by its default --kv-load-failure-policy, recomputed
    here with the same tokens as unified serving; its blocks are all free again and no READ is
    left unsettled."""
    log_path = tmp_path / "prefill.log"
    proc, address = start_worker(
        tiny_model, log_path, 5.0, role="prefill", extra=("--block-size", str(BLOCK_SIZE))
    )
    try:
        await asyncio.to_thread(wait_serving, proc, address, log_path)
        ids = prompt_ids(tiny_model)
        nixl, engine = decode.app.nixl, decode.app.engine
        assert nixl is not None and engine is not None
        real_read, agent = nixl.read, nixl._agent
        real_transfer = agent.transfer
        posted: list[str] = []

        def read_while_stopped(*args: Any, **kwargs: Any) -> int:
            os.kill(proc.pid, signal.SIGSTOP)  # it cannot serve the READ any more
            return real_read(*args, **kwargs)

        def transfer_then_kill(*args: Any) -> str:
            state = str(real_transfer(*args))
            posted.append(state)
            os.kill(proc.pid, signal.SIGKILL)
            return state

        nixl.read = read_while_stopped  # type: ignore[method-assign]
        agent.transfer = transfer_then_kill
        stream = decode.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="k1", prompt_token_ids=ids, sampling=sampling(12), return_token_ids=True
            )
        )
        admitted = await stream.read()
        assert admitted.kind == ADMITTED
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as died:
                await worker_pb2_grpc.WorkerStub(channel).Prefill(
                    worker_pb2.PrefillRequest(
                        request_id="k1",
                        prompt_token_ids=ids,
                        sampling=sampling(12),
                        return_token_ids=True,
                        kv_target=worker_pb2.KvTarget(
                            address=decode.address,
                            transfer_ticket=admitted.transfer_ticket,
                            skip_blocks=admitted.cached_blocks,
                            kv_transport=worker_pb2.KV_TRANSPORT_NIXL,
                        ),
                    ),
                    timeout=60,
                )
        assert died.value.code() == grpc.StatusCode.UNAVAILABLE
        assert posted == ["PROC"]  # the READ was in flight when the process died
        frames = await asyncio.wait_for(collect(stream), 60)
        assert frames[-1].kind == FINAL
        if frames[-1].finish_reason == common_pb2.FINISH_REASON_ABORT:
            # the dead peer's PushKv call was cancelled before the READ's failure was seen: the
            # request is aborted here (the gateway, whose Prefill call failed, retries it)
            assert not token_ids_of(frames)
        else:  # the failed READ won the race: recomputed here, by the policy
            assert frames[-1].transferred_cached_tokens == 0
            assert token_ids_of(frames) == (await unified_tokens(unified, ids, 12))[1:]
        # bounded; generous for a loaded machine (UCX retries its connection before it gives up)
        await wait_blocks_free(decode, timeout_s=60)
        assert nixl.num_unsettled() == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def test_kv_transport_grpc_offers_no_nixl(tiny_model: Path) -> None:
    async with running_worker(worker_settings(tiny_model, "decode", kv_transport="grpc")) as w:
        info = await w.stub.Info(worker_pb2.InfoRequest())
        assert NIXL_CAPABILITY not in info.capabilities
        assert w.app.nixl is None


def test_a_read_the_peer_never_serves_times_out_and_settles_only_after_it_landed() -> None:
    """Two agents in one process, the source never progressing (as a hung or stopped prefill
    worker): the READ ends with KvTransferUnsettled after the timeout instead of hanging. NIXL
    cannot cancel it: once the source progresses again its bytes still land (measured with
    UCX, even after release_xfer_handle or remove_remote_agent), so the agent keeps the handle
    and says the transfer settled only after that; the engine frees the target blocks then,
    never before. With the source progressing, a READ moves the blocks byte for byte."""
    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    shape = (layout.num_layers, 2, layout.num_kv_heads, 8 * layout.block_size, layout.head_dim)
    by_block = (layout.num_layers, 2, layout.num_kv_heads, 8, layout.block_size, layout.head_dim)
    src_pool, dst_pool = torch.randn(shape), torch.zeros(shape)
    src, dst = NixlKvAgent.create([src_pool], layout), NixlKvAgent.create([dst_pool], layout)
    assert src is not None and dst is not None
    source = src.source(0, [1, 2, 5], first_block=0)
    with pytest.raises(KvTransferUnsettled, match="timed out") as failed:
        dst.read(source, 0, 0, [3, 4, 6], timeout_s=0.3)
    dst.forget(source.agent_name)  # as the receiver does: deferred while the READ is unsettled
    assert dst.num_unsettled() == 1
    settled = threading.Event()
    at_settle: list[torch.Tensor] = []

    def on_settled() -> None:
        at_settle.append(dst_pool.view(by_block)[:, :, :, [3, 4, 6]].clone())
        settled.set()

    failed.value.on_settled(on_settled)
    assert not settled.wait(0.2)  # the source is silent: still in flight, blocks still held
    want = src_pool.view(by_block)[:, :, :, [1, 2, 5]]
    with progressed(src):
        assert settled.wait(10)
    assert torch.equal(at_settle[0], want)  # the late bytes landed before the blocks went free
    assert dst.num_unsettled() == 0
    late: list[str] = []
    failed.value.on_settled(lambda: late.append("ran"))  # registered after the end: at once
    assert late == ["ran"]

    dst_pool.zero_()
    with progressed(src):
        nbytes = dst.read(source, 0, 0, [3, 4, 6], timeout_s=10)
    assert nbytes == 3 * layout.num_layers * 2 * layout.num_kv_heads * layout.block_size * layout.head_dim * 4
    assert torch.equal(dst_pool.view(by_block)[:, :, :, [3, 4, 6]], want)
