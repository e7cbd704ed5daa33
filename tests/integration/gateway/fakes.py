"""Scripted fake scheduler and workers (real gRPC servers on 127.0.0.1:0): protocol peers that
replay frames the test chose, and record what the gateway sent them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from shared.proto import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc


@dataclass(frozen=True)
class Fail:
    """Script item: end the RPC with this status."""

    code: grpc.StatusCode
    message: str = "scripted failure"


@dataclass(frozen=True)
class Hang:
    """Script item: block until the RPC is cancelled (or `release` is set)."""

    release: asyncio.Event | None = None


ScriptItem = Any  # a protobuf message, Fail or Hang


async def _play(item: ScriptItem, context: grpc.aio.ServicerContext) -> None:
    if isinstance(item, Fail):
        await context.abort(item.code, item.message)
    if isinstance(item, Hang):
        if item.release is None:
            await asyncio.Event().wait()
        else:
            await item.release.wait()


# --- frame builders ---
def admitted(
    ticket: str = "ticket-1", cached_blocks: int = 0, local_cached: int = 0
) -> worker_pb2.DecodeFrame:
    return worker_pb2.DecodeFrame(
        kind=worker_pb2.DECODE_FRAME_KIND_ADMITTED,
        transfer_ticket=ticket,
        cached_blocks=cached_blocks,
        local_cached_tokens=local_cached,
    )


def tokens(text: str, *ids: int, transferred: int = 0) -> worker_pb2.DecodeFrame:
    return worker_pb2.DecodeFrame(
        kind=worker_pb2.DECODE_FRAME_KIND_TOKENS,
        text=text,
        token_ids=ids,
        transferred_cached_tokens=transferred,
    )


def final(
    text: str = "",
    count: int | None = None,
    reason: common_pb2.FinishReason = common_pb2.FINISH_REASON_STOP,
    *ids: int,
) -> worker_pb2.DecodeFrame:
    frame = worker_pb2.DecodeFrame(
        kind=worker_pb2.DECODE_FRAME_KIND_FINAL, text=text, finish_reason=reason, token_ids=ids
    )
    if count is not None:
        frame.generated_tokens = count
    return frame


def prefill_reply(
    text: str = "",
    count: int | None = 1,
    reason: common_pb2.FinishReason = common_pb2.FINISH_REASON_UNSPECIFIED,
    ids: tuple[int, ...] = (),
    local_cached: int = 0,
) -> worker_pb2.PrefillResponse:
    resp = worker_pb2.PrefillResponse(
        text=text, finish_reason=reason, token_ids=ids, local_cached_tokens=local_cached
    )
    if count is not None:
        resp.generated_tokens = count
    return resp


# --- worker ---
class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.address = ""
        self.decode_scripts: list[list[ScriptItem]] = []
        self.prefill_scripts: list[ScriptItem] = []
        self.decode_requests: list[worker_pb2.DecodeRequest] = []
        self.prefill_requests: list[worker_pb2.PrefillRequest] = []
        self.aborts: list[str] = []
        self.decode_cancelled = 0
        self.aborted = asyncio.Event()
        self.prefill_started = asyncio.Event()

    @property
    def target(self) -> scheduler_pb2.WorkerTarget:
        return scheduler_pb2.WorkerTarget(worker_id=self.worker_id, address=self.address, dp_rank=0)

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeFrame]:
        self.decode_requests.append(request)
        script = self.decode_scripts.pop(0)
        try:
            for item in script:
                if isinstance(item, Fail | Hang):
                    await _play(item, context)
                else:
                    frame = worker_pb2.DecodeFrame()
                    frame.CopyFrom(item)
                    frame.request_id = request.request_id
                    yield frame
        except asyncio.CancelledError:
            self.decode_cancelled += 1
            raise

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        self.prefill_requests.append(request)
        self.prefill_started.set()
        item = self.prefill_scripts.pop(0)
        if isinstance(item, Fail | Hang):
            await _play(item, context)
        resp = worker_pb2.PrefillResponse()
        resp.CopyFrom(item)
        resp.request_id = request.request_id
        resp.prompt_tokens = len(request.prompt_token_ids)
        return resp

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        self.aborts.append(request.request_id)
        self.aborted.set()
        return worker_pb2.AbortResponse(found=True)


# --- scheduler ---
@dataclass
class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    address: str = ""
    responses: list[ScriptItem] = field(default_factory=list)
    requests: list[scheduler_pb2.ScheduleRequest] = field(default_factory=list)
    state: scheduler_pb2.GetStateResponse = field(default_factory=scheduler_pb2.GetStateResponse)

    async def Schedule(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ScheduleResponse:
        self.requests.append(request)
        item = self.responses.pop(0)
        if isinstance(item, Fail | Hang):
            await _play(item, context)
        return item

    async def GetState(
        self, request: scheduler_pb2.GetStateRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetStateResponse:
        return self.state


def disaggregated(
    prefill: FakeWorker, decode: FakeWorker, max_model_len: int = 0
) -> scheduler_pb2.ScheduleResponse:
    return scheduler_pb2.ScheduleResponse(
        mode=scheduler_pb2.SERVING_MODE_DISAGGREGATED,
        prefill=prefill.target,
        decode=decode.target,
        model="tiny",
        max_model_len=max_model_len,
    )


def aggregated(worker: FakeWorker, max_model_len: int = 0) -> scheduler_pb2.ScheduleResponse:
    return scheduler_pb2.ScheduleResponse(
        mode=scheduler_pb2.SERVING_MODE_AGGREGATED,
        decode=worker.target,
        model="tiny",
        max_model_len=max_model_len,
    )


async def start_server(add: Any, servicer: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
