"""Mixed-version clusters (issue 5, item 5), with real v1.0 peers built from compat/v1.0:

(a) an old worker (never sets generated_tokens) behind a new gateway: the gateway counts frames,
    still clamps to max_tokens, and derives finish_reason with the worker's rule;
(b) new worker messages read by an old gateway: the unknown field is ignored (and kept intact);
(c) a prefill worker that offers NIXL paired with an old decode worker pushes over gRPC;
(d) an old worker (no lora_adapters) never gets a LoRA adapter's request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.gateway.server import GatewayApp, build_app
from services.gateway.settings import GatewaySettings
from services.scheduler.router import Router
from services.scheduler.types import RequestFeatures
from shared.cluster import NIXL_CAPABILITY, LoadSnapshot, RankLoad, WorkerLoad
from shared.cluster_convert import worker_info_from_pb
from shared.errors import Unavailable
from shared.proto import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.integration.worker.harness import running_worker, worker_settings

from .conftest import run_old_peer

STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


@dataclass
class OneWorkerScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Routes every request to one worker, in the mode the test sets."""

    address: str
    mode: int = scheduler_pb2.SERVING_MODE_DISAGGREGATED
    requests: list[scheduler_pb2.ScheduleRequest] = field(default_factory=list)

    async def Schedule(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ScheduleResponse:
        self.requests.append(request)
        target = scheduler_pb2.WorkerTarget(worker_id="old-1", address=self.address)
        resp = scheduler_pb2.ScheduleResponse(mode=self.mode, decode=target, model="tiny")  # type: ignore[arg-type]
        if self.mode == scheduler_pb2.SERVING_MODE_DISAGGREGATED:
            resp.prefill.CopyFrom(target)
        return resp


@dataclass
class Gateway:
    app: GatewayApp
    scheduler: OneWorkerScheduler
    stub: gateway_pb2_grpc.GatewayStub


@pytest.fixture
async def gateway(old_worker: str, tiny_model: Path) -> AsyncIterator[Gateway]:
    async with gateway_over(OneWorkerScheduler(old_worker), tiny_model) as served:
        yield served


@contextlib.asynccontextmanager
async def gateway_over(
    scheduler: OneWorkerScheduler, tiny_model: Path, **overrides: Any
) -> AsyncIterator[Gateway]:
    """A real gateway (GatewaySettings `overrides`) in front of `scheduler` (which routes to the
    old worker)."""
    sched_server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, sched_server)
    port = sched_server.add_insecure_port("127.0.0.1:0")
    await sched_server.start()
    settings = GatewaySettings(
        listen="127.0.0.1:0",
        metrics_port=-1,
        scheduler_address=f"127.0.0.1:{port}",
        model=str(tiny_model),
        **overrides,
    )
    app = build_app(settings)
    await app.start()
    channel = grpc.aio.insecure_channel(app.server.address)
    try:
        yield Gateway(app, scheduler, gateway_pb2_grpc.GatewayStub(channel))
    finally:
        await channel.close()
        await app.stop(0)
        await sched_server.stop(0)


DISAGG, AGG = scheduler_pb2.SERVING_MODE_DISAGGREGATED, scheduler_pb2.SERVING_MODE_AGGREGATED


@pytest.mark.parametrize(
    ("scenario", "mode", "max_tokens", "count", "reason", "text"),
    [
        ("stop", DISAGG, 10, 3, STOP, "pss"),  # prefill's token + 2 decode frames
        ("length", DISAGG, 5, 5, LENGTH, "pllll"),
        ("length", AGG, 3, 3, LENGTH, "lll"),
        ("overrun", DISAGG, 4, 4, LENGTH, "p" + "o" * 9),  # 10 frames, clamped; worker said stop
        ("overrun", AGG, 4, 4, LENGTH, "o" * 9),
        ("bytes", DISAGG, 16, 6, STOP, "p\U0001f642"),  # empty-text frames still count
        ("bytes", DISAGG, 6, 6, LENGTH, "p\U0001f642"),  # max_tokens hit on the multi-token char
        ("ids", DISAGG, 16, 7, STOP, "piiiiii"),  # 2 token ids per frame: counted exactly
        ("eos", DISAGG, 16, 0, STOP, ""),  # immediate EOS at prefill
    ],
)
async def test_old_worker_new_gateway_falls_back_to_counting_frames(
    gateway: Gateway, scenario: str, mode: int, max_tokens: int, count: int, reason: int, text: str
) -> None:
    gateway.scheduler.mode = mode
    fields: dict[str, Any] = dict(
        prompt="hello old worker", max_tokens=max_tokens, return_token_ids=scenario == "ids"
    )
    frames = [
        f
        async for f in gateway.stub.Generate(
            gateway_pb2.GenerateRequest(request_id=f"{scenario}-stream", **fields), timeout=30
        )
    ]
    done = await gateway.stub.Complete(
        gateway_pb2.GenerateRequest(request_id=f"{scenario}-unary", **fields), timeout=30
    )
    last = frames[-1]
    assert last.kind == gateway_pb2.FRAME_KIND_FINAL
    assert "".join(f.text for f in frames) == done.text == text
    assert last.usage.completion_tokens == done.usage.completion_tokens == count
    assert last.finish_reason == done.finish_reason == reason
    assert last.usage.total_tokens == last.usage.prompt_tokens + count
    assert done.usage == last.usage


def _new_messages() -> dict[str, Any]:
    return {
        "DecodeFrame": worker_pb2.DecodeFrame(
            request_id="r",
            kind=worker_pb2.DECODE_FRAME_KIND_FINAL,
            text="end",
            generated_tokens=7,
            finish_reason=STOP,
            local_cached_tokens=16,
            transferred_cached_tokens=32,
        ),
        "PrefillResponse": worker_pb2.PrefillResponse(
            request_id="r", text="a", generated_tokens=1, prompt_tokens=48, local_cached_tokens=16
        ),
        "KvChunk": worker_pb2.KvChunk(
            request_id="r",
            transfer_ticket="t",
            num_blocks=2,
            data=b"\x00\x01",
            last=True,
            num_tokens=48,
            first_token_id=5,
            generated_tokens=1,
        ),
    }


def test_new_worker_messages_parse_in_an_old_gateway(v1_0_stubs: Path) -> None:
    new = _new_messages()
    payload = json.dumps({name: msg.SerializeToString().hex() for name, msg in new.items()})
    parsed = json.loads(run_old_peer(v1_0_stubs, "parse", stdin=payload))
    for name, msg in new.items():
        old = parsed[name]
        assert not old["knows_generated_tokens"]  # really the v1.0 schema
        assert "generated_tokens" not in old["fields"]
        assert old["fields"]["request_id"] == "r"
        # every v1.0 field reads the same as the new writer meant
        for fname, value in old["fields"].items():
            if fname in ("kind", "finish_reason"):
                continue
            got = getattr(msg, fname)
            if isinstance(got, bytes):
                assert value  # base64 in JSON; presence is enough here
            else:
                assert str(got) == str(value), (name, fname)
        # an old relay that re-serializes keeps the unknown field intact for newer readers
        again = type(msg)()
        again.ParseFromString(bytes.fromhex(old["reserialized"]))
        assert again.HasField("generated_tokens") and again.generated_tokens == msg.generated_tokens
    assert parsed["DecodeFrame"]["fields"]["finish_reason"] == "FINISH_REASON_STOP"
    assert parsed["DecodeFrame"]["fields"]["text"] == "end"


class NewWorker(worker_pb2_grpc.WorkerServicer):
    """A current worker: sets generated_tokens on the prefill reply and the FINAL frame."""

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        return worker_pb2.PrefillResponse(request_id=request.request_id, text="Hi", generated_tokens=1)

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeFrame]:
        rid = request.request_id
        yield worker_pb2.DecodeFrame(request_id=rid, kind=worker_pb2.DECODE_FRAME_KIND_ADMITTED)
        yield worker_pb2.DecodeFrame(request_id=rid, kind=worker_pb2.DECODE_FRAME_KIND_TOKENS, text="Hi")
        yield worker_pb2.DecodeFrame(request_id=rid, kind=worker_pb2.DECODE_FRAME_KIND_TOKENS, text=" there")
        yield worker_pb2.DecodeFrame(
            request_id=rid, kind=worker_pb2.DECODE_FRAME_KIND_FINAL, finish_reason=STOP, generated_tokens=3
        )


async def test_old_gateway_talks_to_a_new_worker(v1_0_stubs: Path) -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(NewWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        out = await asyncio.to_thread(run_old_peer, v1_0_stubs, "client", f"127.0.0.1:{port}")
    finally:
        await server.stop(0)
    seen = json.loads(out)
    assert seen["prefill"] == {"request_id": "old-gw", "text": "Hi"}
    kinds = [f["kind"] for f in seen["frames"]]
    assert kinds == [
        "DECODE_FRAME_KIND_ADMITTED",
        "DECODE_FRAME_KIND_TOKENS",
        "DECODE_FRAME_KIND_TOKENS",
        "DECODE_FRAME_KIND_FINAL",
    ]
    assert "".join(f.get("text", "") for f in seen["frames"]) == "Hi there"
    assert seen["frames"][-1]["finish_reason"] == "FINISH_REASON_STOP"
    assert all("generated_tokens" not in f for f in seen["frames"])


def test_snapshot_really_predates_generated_tokens(v1_0_stubs: Path) -> None:
    new = worker_pb2.DecodeFrame.DESCRIPTOR.fields_by_name
    assert new["generated_tokens"].number == 5 and new["generated_tokens"].has_presence
    payload = json.dumps(
        {"DecodeFrame": worker_pb2.DecodeFrame(generated_tokens=0).SerializeToString().hex()}
    )
    # generated_tokens=0 is present on the wire (optional): the old parser sees an unknown field
    old = json.loads(run_old_peer(v1_0_stubs, "parse", stdin=payload))["DecodeFrame"]
    assert old["reserialized"] != ""
    assert not old["knows_generated_tokens"]


def test_an_old_decode_worker_ignores_draft_token_ids(v1_0_stubs: Path) -> None:
    """A speculating (1.2) prefill worker's last KvChunk, read by an older decode worker: every
    field it knows reads the same, the proposals are an unknown field it skips (and keeps when it
    re-serializes); GetLoad's new per-rank speculation counts likewise."""
    chunk = worker_pb2.KvChunk(
        request_id="r",
        transfer_ticket="t",
        num_blocks=1,
        data=b"\x01",
        last=True,
        num_tokens=48,
        first_token_id=5,
        generated_tokens=1,
        draft_token_ids=[7, 8, 9],
    )
    load = worker_pb2.GetLoadResponse(
        worker_id="w",
        ranks=[common_pb2.RankLoad(dp_rank=0, num_running=2, spec_draft_tokens=40, spec_accepted_tokens=30)],
    )
    payload = json.dumps(
        {"KvChunk": chunk.SerializeToString().hex(), "GetLoadResponse": load.SerializeToString().hex()}
    )
    parsed = json.loads(run_old_peer(v1_0_stubs, "parse", stdin=payload))
    old = parsed["KvChunk"]
    assert "draft_token_ids" not in old["fields"]
    assert (old["fields"]["first_token_id"], old["fields"]["num_tokens"]) == (5, "48")
    assert old["fields"]["last"] is True
    again = worker_pb2.KvChunk()
    again.ParseFromString(bytes.fromhex(old["reserialized"]))
    assert list(again.draft_token_ids) == [7, 8, 9]
    old_load = parsed["GetLoadResponse"]["fields"]["ranks"][0]
    assert old_load["num_running"] == 2 and "spec_draft_tokens" not in old_load


@dataclass
class PairScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Pairs one prefill worker with one decode worker, with the capabilities they registered."""

    prefill: scheduler_pb2.WorkerTarget
    decode: scheduler_pb2.WorkerTarget

    async def Schedule(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ScheduleResponse:
        return scheduler_pb2.ScheduleResponse(
            mode=scheduler_pb2.SERVING_MODE_DISAGGREGATED,
            prefill=self.prefill,
            decode=self.decode,
            model="tiny",
        )


async def test_an_old_decode_worker_gets_the_grpc_push_from_a_nixl_prefill_worker(
    old_worker: str, tiny_model: Path
) -> None:
    """A 1.4 prefill worker that offers NIXL, paired with a v1.0 decode worker (no
    kv_transport_nixl capability): the gateway asks for no transport, so the KV arrives as the
    PushKv chunks with data that the old worker understands; the prompt is prefilled 4 tokens
    per step, so they start before the prefill ends (the early push: the same messages)."""
    async with running_worker(worker_settings(tiny_model, "prefill", max_batch_tokens=4)) as prefill:
        caps = list((await prefill.stub.Info(worker_pb2.InfoRequest())).capabilities)
        if prefill.app.nixl is not None:
            assert NIXL_CAPABILITY in caps  # the new side really offers NIXL
        scheduler = PairScheduler(
            scheduler_pb2.WorkerTarget(worker_id="new-p", address=prefill.address, capabilities=caps),
            scheduler_pb2.WorkerTarget(worker_id="old-d", address=old_worker),
        )
        sched_server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, sched_server)
        port = sched_server.add_insecure_port("127.0.0.1:0")
        await sched_server.start()
        app = build_app(
            GatewaySettings(
                listen="127.0.0.1:0",
                metrics_port=-1,
                scheduler_address=f"127.0.0.1:{port}",
                model=str(tiny_model),
            )
        )
        await app.start()
        channel = grpc.aio.insecure_channel(app.server.address)
        try:
            done = await gateway_pb2_grpc.GatewayStub(channel).Complete(
                gateway_pb2.GenerateRequest(
                    request_id="push-nixl-peer", prompt="the KV cache of this prompt", max_tokens=8
                ),
                timeout=30,
            )
        finally:
            await channel.close()
            await app.stop(0)
            await sched_server.stop(0)
    m = re.search(r"kv(\d+)/(\d+)$", done.text)
    assert m, done.text
    assert int(m.group(1)) > 0 and int(m.group(2)) >= 1  # KV bytes in PushKv chunks
    assert done.finish_reason == STOP


def test_an_adapter_request_never_reaches_a_worker_older_than_lora(v1_0_stubs: Path) -> None:
    """An old worker reads a PrefillRequest naming a LoRA adapter without the field (it would
    answer with the base model), so nothing may send it one: its registration lists no adapters
    (the field is new), and the scheduler routes an adapter's requests only to workers listing
    it, however idle the old worker is."""
    prefill = worker_pb2.PrefillRequest(
        request_id="r",
        prompt_token_ids=[1, 2],
        sampling=common_pb2.SamplingParams(max_tokens=4, lora_adapter="sql"),
    )
    old = json.loads(
        run_old_peer(
            v1_0_stubs, "parse", stdin=json.dumps({"PrefillRequest": prefill.SerializeToString().hex()})
        )
    )
    assert "lora_adapter" not in old["PrefillRequest"]["fields"]["sampling"]
    assert old["PrefillRequest"]["fields"]["sampling"]["max_tokens"] == 4

    layout = common_pb2.KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")

    def registered(worker_id: str, version: str, adapters: tuple[str, ...] = ()) -> common_pb2.WorkerInfo:
        return common_pb2.WorkerInfo(
            worker_id=worker_id,
            address=f"{worker_id}:1",
            role=common_pb2.WORKER_ROLE_UNIFIED,
            model_id="m",
            dp_size=1,
            kv_layout=layout,
            proto_version=version,
            capabilities=["lora"] if adapters else [],
            lora_adapters=adapters,
        )

    as_registered = {  # an old worker's WorkerInfo has no field 11: what it sends reads as empty
        "old": registered("old", "1.0"),
        "new": registered("new", "1.13", ("sql",)),
    }
    loads = {"old": 0, "new": 100_000}  # the old worker is idle, the new one busy
    snapshot = LoadSnapshot(
        workers=tuple(
            WorkerLoad(worker_info_from_pb(pb), (RankLoad(0, num_used_tokens=loads[name]),), 0, False)
            for name, pb in as_registered.items()
        ),
        version=1,
        timestamp_ms=0,
    )
    assert snapshot.workers[0].info.lora_adapters == ()
    router = Router(seed=0)
    router.apply_snapshot(snapshot)
    chosen = {router.schedule(RequestFeatures(f"r{i}", 10, model="sql")).decode.worker_id for i in range(20)}
    assert chosen == {"new"}
    # the base model's requests still go to the idle old worker
    assert router.schedule(RequestFeatures("base", 10)).decode.worker_id == "old"
    with pytest.raises(Unavailable, match="every worker of model 'sql' is excluded"):
        router.schedule(RequestFeatures("x", 10, model="sql", exclude_worker_ids=frozenset({"new"})))


@dataclass
class CapableScheduler(OneWorkerScheduler):
    """Routes every request to one worker (aggregated), with the capabilities it registered."""

    capabilities: tuple[str, ...] = ()

    async def Schedule(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ScheduleResponse:
        self.requests.append(request)
        target = scheduler_pb2.WorkerTarget(
            worker_id="old-1", address=self.address, capabilities=self.capabilities
        )
        return scheduler_pb2.ScheduleResponse(mode=AGG, decode=target, model="tiny")


async def test_allowed_token_ids_and_bad_words_never_reach_a_worker_older_than_1_15(
    old_worker: str, tiny_model: Path, v1_0_stubs: Path
) -> None:
    """An older worker reads SamplingParams without allowed_token_ids and bad_words (it would
    draw any token, write any word), so a gateway facing one that advertises capabilities but
    not these (a 1.14 worker) refuses such a request, naming what it lacks, and still serves
    the others through it."""
    sampling = common_pb2.SamplingParams(max_tokens=4, allowed_token_ids=[3, 4])
    sampling.bad_words.add(token_ids=[5, 6])
    prefill = worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1, 2], sampling=sampling)
    old = json.loads(
        run_old_peer(
            v1_0_stubs, "parse", stdin=json.dumps({"PrefillRequest": prefill.SerializeToString().hex()})
        )
    )
    assert old["PrefillRequest"]["fields"]["sampling"] == {"max_tokens": 4}

    from services.worker.messages import CAPABILITIES

    before = tuple(c for c in CAPABILITIES if c not in ("allowed_token_ids", "bad_words"))
    async with gateway_over(CapableScheduler(old_worker, capabilities=before), tiny_model) as served:
        for field_name, extra in (
            ("allowed_token_ids", {"allowed_token_ids": [3]}),
            ("bad_words", {"bad_words": ["fox"]}),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await served.stub.Complete(
                    gateway_pb2.GenerateRequest(request_id=f"stop-{field_name}", prompt="hi", **extra)
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"lacks {field_name}" in (err.value.details() or "")
        done = await served.stub.Complete(
            gateway_pb2.GenerateRequest(request_id="stop-plain", prompt="hi", max_tokens=8)
        )
        assert done.finish_reason == STOP


async def test_a_thinking_token_budget_never_reaches_a_worker_older_than_1_17(
    old_worker: str, tiny_model: Path, v1_0_stubs: Path
) -> None:
    """An older worker reads SamplingParams without thinking_budget (the model would think on),
    so a gateway facing one that advertises capabilities but not thinking_token_budget (a 1.16
    worker) refuses such a request, naming what it lacks, and serves the others through it. A
    gateway without --reasoning-parser refuses the field: INVALID_ARGUMENT naming it."""
    sampling = common_pb2.SamplingParams(max_tokens=4)
    sampling.thinking_budget.max_tokens = 3
    sampling.thinking_budget.end_token_ids.extend([5, 6])
    prefill = worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1, 2], sampling=sampling)
    old = json.loads(
        run_old_peer(
            v1_0_stubs, "parse", stdin=json.dumps({"PrefillRequest": prefill.SerializeToString().hex()})
        )
    )
    assert old["PrefillRequest"]["fields"]["sampling"] == {"max_tokens": 4}

    from services.worker.messages import CAPABILITIES

    before = tuple(c for c in CAPABILITIES if c != "thinking_token_budget")
    budget = gateway_pb2.GenerateRequest(request_id="think", prompt="hi", thinking_token_budget=3)
    scheduler = CapableScheduler(old_worker, capabilities=before)
    async with gateway_over(scheduler, tiny_model, reasoning_parser="qwen3") as served:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await served.stub.Complete(budget)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "lacks thinking_token_budget" in (err.value.details() or "")
        done = await served.stub.Complete(
            gateway_pb2.GenerateRequest(request_id="plain", prompt="hi", max_tokens=8)
        )
        assert done.finish_reason == STOP
    async with gateway_over(CapableScheduler(old_worker, capabilities=CAPABILITIES), tiny_model) as served:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await served.stub.Complete(budget)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "thinking_token_budget" in (err.value.details() or "")
        assert "--reasoning-parser" in (err.value.details() or "")
