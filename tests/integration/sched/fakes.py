"""Fake workers for scheduler/load-monitor integration tests: a real gRPC server implementing
Worker/GetLoad, Info and a minimal Decode (it holds the prompt's tokens on the requested rank
until released), registering and heartbeating with the load-monitor like a real worker."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import grpc

from shared.proto import common_pb2, load_monitor_pb2, load_monitor_pb2_grpc, worker_pb2, worker_pb2_grpc
from shared.server import CHANNEL_OPTIONS

_ids = itertools.count(1)


def layout(dtype: str = "float32", block_size: int = 16) -> common_pb2.KvLayout:
    return common_pb2.KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=block_size, dtype=dtype)


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        role: common_pb2.WorkerRole = common_pb2.WORKER_ROLE_UNIFIED,
        dp_size: int = 2,
        model_id: str = "tiny",
        kv_layout: common_pb2.KvLayout | None = None,
        worker_id: str = "",
    ) -> None:
        self.role = role
        self.dp_size = dp_size
        self.model_id = model_id
        self.kv_layout = kv_layout or layout()
        self.worker_id = worker_id or f"fake-{next(_ids)}"
        self.used_tokens = [0] * dp_size
        self.requests: dict[str, tuple[int, int]] = {}  # request_id -> (rank, tokens)
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._task: asyncio.Task[None] | None = None
        self._lm_channel: grpc.aio.Channel | None = None

    # --- Worker service ---

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetLoadResponse:
        return worker_pb2.GetLoadResponse(
            worker_id=self.worker_id,
            ranks=[
                common_pb2.RankLoad(
                    dp_rank=r,
                    num_used_tokens=u,
                    num_running=sum(1 for rank, _ in self.requests.values() if rank == r),
                    kv_capacity_tokens=100_000,
                )
                for r, u in enumerate(self.used_tokens)
            ],
        )

    async def Info(
        self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerInfo:
        return self.info()

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeFrame]:
        if request.dp_rank >= self.dp_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such rank")
        tokens = len(request.prompt_token_ids)
        self.used_tokens[request.dp_rank] += tokens
        self.requests[request.request_id] = (request.dp_rank, tokens)
        yield worker_pb2.DecodeFrame(
            request_id=request.request_id,
            kind=worker_pb2.DECODE_FRAME_KIND_FINAL,
            generated_tokens=0,
            prompt_tokens=tokens,
        )

    def release(self, request_id: str) -> None:
        rank, tokens = self.requests.pop(request_id)
        self.used_tokens[rank] -= tokens

    def info(self) -> common_pb2.WorkerInfo:
        return common_pb2.WorkerInfo(
            worker_id=self.worker_id,
            address=self.address,
            role=self.role,
            model_id=self.model_id,
            dp_size=self.dp_size,
            kv_layout=self.kv_layout,
            capabilities=["generated_tokens"],
            proto_version="1.1",
            max_model_len=4096,
            device="cpu",
        )

    # --- lifecycle ---

    async def start(self, load_monitor_address: str, heartbeat_s: float = 0.1) -> None:
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await self.server.start()
        self._lm_channel = grpc.aio.insecure_channel(load_monitor_address)
        stub = load_monitor_pb2_grpc.LoadMonitorStub(self._lm_channel)
        registered = asyncio.Event()
        self._task = asyncio.create_task(self._membership(stub, heartbeat_s, registered))
        await asyncio.wait_for(registered.wait(), 10)

    async def _membership(
        self, stub: load_monitor_pb2_grpc.LoadMonitorStub, heartbeat_s: float, registered: asyncio.Event
    ) -> None:
        known = False
        while True:
            try:
                if not known:
                    await stub.Register(load_monitor_pb2.RegisterRequest(worker=self.info()), timeout=2)
                    known = True
                    registered.set()
                else:
                    reply = await stub.Heartbeat(
                        load_monitor_pb2.HeartbeatRequest(worker_id=self.worker_id), timeout=2
                    )
                    known = reply.known
            except grpc.aio.AioRpcError:
                known = False
            await asyncio.sleep(heartbeat_s)

    async def stop_heartbeats(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def deregister(self) -> None:
        await self.stop_heartbeats()
        assert self._lm_channel is not None
        stub = load_monitor_pb2_grpc.LoadMonitorStub(self._lm_channel)
        await stub.Deregister(load_monitor_pb2.DeregisterRequest(worker_id=self.worker_id), timeout=2)

    async def stop(self) -> None:
        await self.stop_heartbeats()
        if self._lm_channel is not None:
            await self._lm_channel.close()
        if self.server is not None:
            await self.server.stop(0)
