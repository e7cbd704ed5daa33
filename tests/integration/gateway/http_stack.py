"""A real gateway (gRPC + HTTP on 127.0.0.1:0) in front of real in-process workers (prefill,
decode, unified) over a tiny model, with a stand-in scheduler that routes by the test's choice of
mode (or refuses, to provoke scheduler errors). For the HTTP API's integration tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai

from services.gateway.server import GatewayApp, build_app
from services.worker.server import WorkerApp
from services.worker.settings import WorkerSettings
from shared.cluster import Role
from shared.proto import common_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from .conftest import gateway_settings

MAX_MODEL_LEN = 2048
BLOCK_SIZE = 4


@dataclass
class Router(scheduler_pb2_grpc.SchedulerServicer):
    targets: dict[str, scheduler_pb2.WorkerTarget] = field(default_factory=dict)
    model_id: str = ""
    mode: str = "disaggregated"
    refuse: grpc.StatusCode | None = None  # every Schedule fails with this code while set
    max_model_len: int = MAX_MODEL_LEN  # what Schedule and GetState report

    async def Schedule(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ScheduleResponse:
        if self.refuse is not None:
            await context.abort(self.refuse, "refused by the test's scheduler")
        if self.mode == "disaggregated":
            return scheduler_pb2.ScheduleResponse(
                mode=scheduler_pb2.SERVING_MODE_DISAGGREGATED,
                prefill=self.targets["prefill"],
                decode=self.targets["decode"],
                max_model_len=self.max_model_len,
            )
        return scheduler_pb2.ScheduleResponse(
            mode=scheduler_pb2.SERVING_MODE_AGGREGATED,
            decode=self.targets["unified"],
            max_model_len=self.max_model_len,
        )

    async def GetState(
        self, request: scheduler_pb2.GetStateRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetStateResponse:
        return scheduler_pb2.GetStateResponse(
            workers=[
                scheduler_pb2.SchedulerWorker(
                    info=common_pb2.WorkerInfo(
                        worker_id=t.worker_id,
                        address=t.address,
                        model_id=self.model_id,
                        max_model_len=self.max_model_len,
                    )
                )
                for t in self.targets.values()
            ]
        )


@dataclass
class HttpStack:
    model: Path
    router: Router
    workers: dict[str, WorkerApp]
    gateway: GatewayApp
    channel: grpc.aio.Channel

    @property
    def stub(self) -> gateway_pb2_grpc.GatewayStub:
        return gateway_pb2_grpc.GatewayStub(self.channel)

    @property
    def base_url(self) -> str:
        assert self.gateway.http_url is not None
        return self.gateway.http_url + "/v1"

    def pools_full(self) -> bool:
        for app in self.workers.values():
            engine = app.engine
            assert engine is not None
            if engine.num_free_blocks(0) != engine.num_total_blocks(0):
                return False
        return True

    async def wait_idle(self, timeout_s: float = 15.0) -> None:
        """Until the gateway has nothing in flight and every worker's KV pool is full again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.gateway.service.num_in_flight or not self.pools_full():
            assert loop.time() < deadline, (
                f"not idle: in flight {self.gateway.service.num_in_flight}, pools full {self.pools_full()}"
            )
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def gateway_on(stack: HttpStack, **overrides: Any) -> AsyncIterator[GatewayApp]:
    """Another gateway (e.g. with API keys) in front of the same scheduler and workers."""
    app = build_app(
        gateway_settings(
            stack.model,
            stack.gateway.settings.scheduler_address,
            block_size=BLOCK_SIZE,
            http_port=0,
            **overrides,
        )
    )
    await app.start()
    try:
        yield app
    finally:
        await app.stop(0)


@contextlib.asynccontextmanager
async def http_stack(
    model: Path, worker_overrides: dict[str, Any] | None = None, **gateway_overrides: Any
) -> AsyncIterator[HttpStack]:
    """A prefill, a decode and a unified worker (each with `worker_overrides`) behind the
    Router and a gateway (with `gateway_overrides`) serving HTTP on a free port."""
    router = Router(model_id=model.name)
    workers: dict[str, WorkerApp] = {}
    sched = grpc.aio.server()
    gateway: GatewayApp | None = None
    channel: grpc.aio.Channel | None = None
    try:
        for role in ("prefill", "decode", "unified"):
            app = WorkerApp(
                WorkerSettings(
                    role=Role(role),
                    listen="127.0.0.1:0",
                    metrics_port=-1,
                    model=str(model),
                    device="cpu",
                    dtype="float32",
                    block_size=BLOCK_SIZE,
                    kv_cache_tokens=4096,
                    max_model_len=MAX_MODEL_LEN,
                    torch_threads=1,
                    drain_grace_s=1.0,
                    **(worker_overrides or {}),
                )
            )
            workers[role] = app
            await app.start()
            router.targets[role] = scheduler_pb2.WorkerTarget(worker_id=app.worker_id, address=app.address)
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(router, sched)
        port = sched.add_insecure_port("127.0.0.1:0")
        await sched.start()
        address = f"127.0.0.1:{port}"
        settings = gateway_settings(model, address, block_size=BLOCK_SIZE, http_port=0, **gateway_overrides)
        gateway = build_app(settings)
        await gateway.start()
        channel = grpc.aio.insecure_channel(gateway.server.address)
        yield HttpStack(model, router, workers, gateway, channel)
    finally:
        if channel is not None:
            await channel.close()
        if gateway is not None:
            await gateway.stop(0)
        await sched.stop(0)
        for app in workers.values():
            await app.stop()


def client_of(url: str | None, key: str = "none") -> openai.AsyncOpenAI:
    """The `openai` client of a gateway's HTTP face (no retries: a test sees every answer)."""
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def model_with_template(folder: Path, template: str) -> Path:
    """A tiny BPE model in `folder` whose tokenizer's chat template is `template`."""
    from transformers import AutoTokenizer

    from tests.support.tiny_models import build_tiny_model

    build_tiny_model(folder, "bpe")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(folder))
    return folder


def reassembled(chunks: list[Any]) -> tuple[str, list[tuple[str, ...]], str | None]:
    """A chat stream's content, tool calls (id, name, arguments) from their deltas (the id and
    name first, once per call), finish_reason."""
    content, reason = "", None
    calls: dict[int, list[str]] = {}
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            call = calls.setdefault(tc.index, ["", "", ""])
            if tc.id:
                assert call[0] == "" and tc.function.name  # the id and name come first, once
                call[0], call[1] = tc.id, tc.function.name
            call[2] += tc.function.arguments or ""
        reason = c.choices[0].finish_reason or reason
    return content, [tuple(calls[k]) for k in sorted(calls)], reason
