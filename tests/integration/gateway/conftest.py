"""A real gateway server on 127.0.0.1:0 in front of scripted fake scheduler/worker servers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.gateway.server import GatewayApp, build_app
from services.gateway.settings import GatewaySettings
from services.gateway.tokenization import PromptTokenizer
from shared.proto import gateway_pb2_grpc, scheduler_pb2_grpc, worker_pb2_grpc
from tests.support.tiny_models import build_tiny_model

from .fakes import FakeScheduler, FakeWorker, start_server


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The folder name is the model id the gateway serves.
    return build_tiny_model(tmp_path_factory.mktemp("gateway-models") / "tiny", "bpe")


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> PromptTokenizer:
    return PromptTokenizer.load(tiny_model)


@dataclass
class Cluster:
    scheduler: FakeScheduler
    prefill: FakeWorker
    decode: FakeWorker
    decode2: FakeWorker
    app: GatewayApp
    channel: grpc.aio.Channel

    @property
    def stub(self) -> gateway_pb2_grpc.GatewayStub:
        return gateway_pb2_grpc.GatewayStub(self.channel)


def gateway_settings(model: Path, scheduler_address: str, **overrides: Any) -> GatewaySettings:
    values: dict[str, Any] = dict(
        listen="127.0.0.1:0",
        http_port=-1,  # the HTTP API's own tests turn it on (http_port=0)
        metrics_port=-1,
        scheduler_address=scheduler_address,
        model=str(model),
        drain_grace_s=1.0,
        worker_rpc_timeout_s=5.0,
        request_timeout_s=60.0,
    )
    values.update(overrides)
    return GatewaySettings(**values)


@pytest.fixture
async def cluster(tiny_model: Path) -> AsyncIterator[Cluster]:
    servers: list[grpc.aio.Server] = []
    scheduler = FakeScheduler()
    server, scheduler.address = await start_server(
        scheduler_pb2_grpc.add_SchedulerServicer_to_server, scheduler
    )
    servers.append(server)
    workers = [FakeWorker("prefill-1"), FakeWorker("decode-1"), FakeWorker("decode-2")]
    for worker in workers:
        server, worker.address = await start_server(worker_pb2_grpc.add_WorkerServicer_to_server, worker)
        servers.append(server)
    app = build_app(gateway_settings(tiny_model, scheduler.address))
    await app.start()
    channel = grpc.aio.insecure_channel(app.server.address)
    try:
        yield Cluster(scheduler, workers[0], workers[1], workers[2], app, channel)
    finally:
        await channel.close()
        await app.stop(0)
        for server in servers:
            await server.stop(0)
