"""Worker lifecycle over real servers: load-monitor membership, drain, handoff edge cases, and KV
freed on every failure path."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
import structlog.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.worker.engine.api import EngineRequest, RequestKind, SamplingConfig
from shared.cluster_convert import kv_layout_to_pb
from shared.proto import common_pb2, load_monitor_pb2, load_monitor_pb2_grpc, worker_pb2
from tests.support.reference import hf_greedy

from .harness import RunningWorker, collect, running_worker, sampling, worker_settings
from .test_worker_grpc import (
    ADMITTED,
    FINAL,
    disaggregated,
    prompt_ids,
    token_ids_of,
    wait_blocks_free,
)


class FakeLoadMonitor(load_monitor_pb2_grpc.LoadMonitorServicer):
    """Records membership calls; `forget()` makes the next Heartbeat answer known=False."""

    def __init__(self) -> None:
        self.registered: list[common_pb2.WorkerInfo] = []
        self.heartbeats: list[str] = []
        self.deregistered: list[str] = []
        self._forget = False
        self.changed = asyncio.Event()

    def forget(self) -> None:
        self._forget = True

    async def Register(
        self, request: load_monitor_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> load_monitor_pb2.RegisterResponse:
        self.registered.append(request.worker)
        self.changed.set()
        return load_monitor_pb2.RegisterResponse(
            worker_id=request.worker.worker_id, lease_ttl_ms=1000, heartbeat_interval_ms=50
        )

    async def Heartbeat(
        self, request: load_monitor_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> load_monitor_pb2.HeartbeatResponse:
        self.heartbeats.append(request.worker_id)
        known, self._forget = not self._forget, False
        self.changed.set()
        return load_monitor_pb2.HeartbeatResponse(known=known)

    async def Deregister(
        self, request: load_monitor_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> load_monitor_pb2.DeregisterResponse:
        self.deregistered.append(request.worker_id)
        self.changed.set()
        return load_monitor_pb2.DeregisterResponse(found=True)


async def start_load_monitor(address: str) -> tuple[grpc.aio.Server, FakeLoadMonitor, str]:
    fake = FakeLoadMonitor()
    server = grpc.aio.server()
    load_monitor_pb2_grpc.add_LoadMonitorServicer_to_server(fake, server)
    port = server.add_insecure_port(address)
    await server.start()
    return server, fake, f"127.0.0.1:{port}"


async def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_registers_heartbeats_reregisters_and_deregisters(tiny_model: Path) -> None:
    lm_server, lm, lm_address = await start_load_monitor("127.0.0.1:0")
    try:
        settings = worker_settings(tiny_model, "prefill", load_monitor_address=lm_address)
        async with running_worker(settings) as w:
            await wait_until(lambda: lm.registered and len(lm.heartbeats) >= 2)
            info = lm.registered[0]
            assert info.worker_id == w.app.worker_id
            assert info.address == w.address
            assert info.role == common_pb2.WORKER_ROLE_PREFILL
            assert info.model_id == "tiny-bpe"
            assert info.dp_size == 1
            assert info.kv_layout.block_size == settings.block_size
            assert info.kv_layout.dtype == "float32"
            assert list(info.capabilities) == [
                "generated_tokens",
                "kv_block_skip",
                "local_prefill",
                "draft_token_ids",
                "first_output_index",
                "sampling_penalties",
                "logprobs",
                "structured_outputs",
                "prompt_logprobs",
                "min_p",
                "priority",
                "structured_grammar",
                "cache_salt",
                "lora",
                "show_special_tokens",
                "allowed_token_ids",
                "bad_words",
                "thinking_token_budget",
                "kv_gateway_ticket",
                *(["kv_transport_nixl", "kv_nixl_parts"] if w.app.nixl is not None else []),
            ]
            assert info.proto_version == "1.19"
            assert info.max_model_len == settings.max_model_len
            assert info.device == "cpu"
            assert set(lm.heartbeats) == {w.app.worker_id}

            lm.forget()  # lease expired on the load-monitor's side: the worker registers again
            await wait_until(lambda: len(lm.registered) >= 2)

            await w.app.drain()
            assert lm.deregistered == [w.app.worker_id]
            health = health_pb2_grpc.HealthStub(w.channel)
            resp = await health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Worker"))
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
            beats = len(lm.heartbeats)
            await asyncio.sleep(0.2)
            assert len(lm.heartbeats) == beats  # no heartbeat after deregistering
    finally:
        await lm_server.stop(0)


async def test_keeps_serving_while_load_monitor_is_down(tiny_model: Path) -> None:
    port = free_port()
    settings = worker_settings(
        tiny_model, "unified", load_monitor_address=f"127.0.0.1:{port}", register_retry_s=0.05
    )
    async with running_worker(settings) as w:
        # Nothing listens there yet: the worker serves anyway.
        frames = await collect(
            w.stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id="lm-down",
                    prompt_token_ids=prompt_ids(tiny_model),
                    sampling=sampling(3),
                    local_prefill=True,
                )
            )
        )
        assert frames[-1].kind == FINAL
        lm_server, lm, _ = await start_load_monitor(f"127.0.0.1:{port}")
        try:
            await wait_until(lambda: lm.registered, timeout_s=20.0)
            assert lm.registered[0].worker_id == w.app.worker_id
        finally:
            await lm_server.stop(0)


@pytest.fixture
async def pair(tiny_model: Path) -> AsyncIterator[tuple[RunningWorker, RunningWorker]]:
    async with (
        running_worker(worker_settings(tiny_model, "prefill")) as p,
        running_worker(worker_settings(tiny_model, "decode")) as d,
    ):
        yield p, d


async def test_handoff_when_finished_at_first_token(
    pair: tuple[RunningWorker, RunningWorker], tiny_model: Path
) -> None:
    prefill, decode = pair
    ids = prompt_ids(tiny_model)
    # max_tokens = 1: LENGTH at the first token; the decode side ends at once with count 0.
    reply, frames = await disaggregated(prefill, decode, "f1", ids, 1)
    assert reply.generated_tokens == 1
    assert reply.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert reply.kv_bytes_sent == 0  # nothing to decode: no KV moves
    assert [f.kind for f in frames] == [ADMITTED, FINAL]
    assert frames[-1].HasField("generated_tokens") and frames[-1].generated_tokens == 0
    assert frames[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    # A stop token id as the first token: STOP, counted by the prefill worker.
    first = hf_greedy(tiny_model, ids, 1)[0]
    stream = decode.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id="f2", prompt_token_ids=ids, sampling=sampling(8, stop_token_ids=[first])
        )
    )
    admitted = await stream.read()
    reply = await prefill.stub.Prefill(
        worker_pb2.PrefillRequest(
            request_id="f2",
            prompt_token_ids=ids,
            sampling=sampling(8, stop_token_ids=[first]),
            kv_target=worker_pb2.KvTarget(address=decode.address, transfer_ticket=admitted.transfer_ticket),
        )
    )
    assert reply.generated_tokens == 1
    assert reply.finish_reason == common_pb2.FINISH_REASON_STOP
    rest = await collect(stream)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert rest[-1].generated_tokens == 0
    await wait_blocks_free(decode)
    await wait_blocks_free(prefill)


async def test_failed_push_frees_prefill_blocks(
    pair: tuple[RunningWorker, RunningWorker], tiny_model: Path
) -> None:
    prefill, decode = pair
    ids = prompt_ids(tiny_model)
    # Nobody listens at the target.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await prefill.stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id="e1",
                prompt_token_ids=ids,
                sampling=sampling(4),
                kv_target=worker_pb2.KvTarget(address=f"127.0.0.1:{free_port()}", transfer_ticket="t"),
            ),
            timeout=30,
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    await wait_blocks_free(prefill)
    # The decode worker does not know the ticket (e.g. the request was aborted there).
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await prefill.stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id="e2",
                prompt_token_ids=ids,
                sampling=sampling(4),
                kv_target=worker_pb2.KvTarget(address=decode.address, transfer_ticket="0-gone"),
            )
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    await wait_blocks_free(prefill)
    await wait_blocks_free(decode)


async def test_drain_finishes_in_flight_streams(tiny_model: Path) -> None:
    async with running_worker(worker_settings(tiny_model, "unified", drain_grace_s=60)) as w:
        ids = prompt_ids(tiny_model)
        max_tokens = 200
        stream = w.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="dr1",
                prompt_token_ids=ids,
                sampling=sampling(max_tokens, ignore_eos=True),
                local_prefill=True,
                return_token_ids=True,
            )
        )
        assert (await stream.read()).kind == ADMITTED
        drain = asyncio.create_task(w.app.drain())
        await wait_until(lambda: w.app.core is not None and w.app.core._draining)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # no new work while draining
            await collect(
                w.stub.Decode(
                    worker_pb2.DecodeRequest(
                        request_id="dr2", prompt_token_ids=ids, sampling=sampling(4), local_prefill=True
                    )
                )
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        frames = await collect(stream)
        await drain
        assert frames[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert frames[-1].generated_tokens == max_tokens
        assert len(token_ids_of(frames)) == max_tokens


async def test_drain_aborts_what_outlives_the_grace(tiny_model: Path) -> None:
    async with running_worker(worker_settings(tiny_model, "unified", drain_grace_s=0)) as w:
        ids = prompt_ids(tiny_model)
        max_tokens = 512 - len(ids) - 1
        stream = w.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="ab1",
                prompt_token_ids=ids,
                sampling=sampling(max_tokens, ignore_eos=True),
                local_prefill=True,
            )
        )
        assert (await stream.read()).kind == ADMITTED
        await w.app.drain()
        frames = await collect(stream)
        final = frames[-1]
        assert final.kind == FINAL
        assert final.finish_reason == common_pb2.FINISH_REASON_ABORT
        assert final.generated_tokens < max_tokens
        await wait_blocks_free(w)


async def test_push_from_an_old_prefill_worker_without_generated_tokens(
    pair: tuple[RunningWorker, RunningWorker], tiny_model: Path
) -> None:
    """A v1.0 prefill worker's last KvChunk has no generated_tokens (field 10 absent on the wire):
    the decode worker counts its one first token and still stops at max_tokens."""
    prefill, decode = pair
    ids = prompt_ids(tiny_model)
    max_tokens = 8
    stream = decode.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id="o1", prompt_token_ids=ids, sampling=sampling(max_tokens), return_token_ids=True
        )
    )
    admitted = await stream.read()
    # Run the prefill with the prefill worker's engine and send the chunks the old way.
    engine = prefill.app.engine
    assert engine is not None
    handle = engine.add_request(
        EngineRequest(
            request_id="o1",
            prompt_token_ids=tuple(ids),
            kind=RequestKind.PREFILL_ONLY,
            sampling=SamplingConfig(max_tokens=max_tokens, temperature=0),
        )
    )
    outs = [out async for out in handle]
    first_token = outs[-1].new_token_ids[-1]
    chunks = list(engine.export_kv("o1", admitted.cached_blocks, 4096))
    engine.release("o1")
    layout = kv_layout_to_pb(engine.kv_layout)
    messages = [
        worker_pb2.KvChunk(
            request_id="o1",
            transfer_ticket=admitted.transfer_ticket,
            first_block=c.first_block,
            num_blocks=c.num_blocks,
            data=c.data,
            layout=layout,
        )
        for c in chunks
    ]
    messages[-1].num_tokens = len(ids)
    messages[-1].first_token_id = first_token
    messages[-1].last = True
    assert not messages[-1].HasField("generated_tokens")

    async def send() -> AsyncIterator[worker_pb2.KvChunk]:
        for m in messages:
            yield m

    receipt = await decode.stub.PushKv(send())
    assert receipt.blocks_received == sum(c.num_blocks for c in chunks)
    frames = await collect(stream)
    assert [first_token, *token_ids_of(frames)] == hf_greedy(tiny_model, ids, max_tokens)
    assert frames[-1].generated_tokens == max_tokens - 1
    assert frames[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    await wait_blocks_free(decode)
    await wait_blocks_free(prefill)


@pytest.mark.parametrize("log_prompts", [False, True])
async def test_prompt_and_completion_text_logged_only_with_log_prompts(
    tiny_model: Path, log_prompts: bool
) -> None:
    ids = prompt_ids(tiny_model)
    settings = worker_settings(tiny_model, "unified", log_prompts=log_prompts)
    async with running_worker(settings) as w:
        with structlog.testing.capture_logs() as logs:
            frames = await collect(
                w.stub.Decode(
                    worker_pb2.DecodeRequest(
                        request_id="lp", prompt_token_ids=ids, sampling=sampling(6), local_prefill=True
                    )
                )
            )
    text = "".join(f.text for f in frames)
    assert text
    with_text = [entry for entry in logs if "text" in entry or "prompt_token_ids" in entry]
    if log_prompts:
        assert any(entry.get("text") == text for entry in with_text)
    else:
        assert with_text == []
