"""Helpers: worker gRPC servers in process on 127.0.0.1:0 over a tiny model, real channels."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.worker.server import WorkerApp
from services.worker.settings import WorkerSettings
from shared.cluster import Role
from shared.proto import common_pb2, worker_pb2, worker_pb2_grpc
from shared.server import CHANNEL_OPTIONS

# Small blocks and chunks so a short prompt spans several blocks and several KV messages.
BLOCK_SIZE = 4
KV_CHUNK_BYTES = 4096
MAX_MODEL_LEN = 512
KV_CACHE_TOKENS = 1024


def worker_settings(model: Path, role: str, **overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = dict(
        role=Role(role),
        listen="127.0.0.1:0",
        metrics_port=-1,
        model=str(model),
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_tokens=KV_CACHE_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        kv_chunk_bytes=KV_CHUNK_BYTES,
        torch_threads=1,
        drain_grace_s=5.0,
        load_refresh_s=0.2,
    )
    values.update(overrides)
    return WorkerSettings(**values)


@dataclass
class RunningWorker:
    app: WorkerApp
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub

    @property
    def address(self) -> str:
        return self.app.address


@contextlib.asynccontextmanager
async def running_worker(settings: WorkerSettings) -> AsyncIterator[RunningWorker]:
    app = WorkerApp(settings)
    await app.start()
    channel = grpc.aio.insecure_channel(app.server.address, options=CHANNEL_OPTIONS)
    try:
        yield RunningWorker(app, channel, worker_pb2_grpc.WorkerStub(channel))
    finally:
        await channel.close()
        await app.stop()


def sampling(max_tokens: int, **kw: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, **kw)


async def collect(call: Any) -> list[worker_pb2.DecodeFrame]:
    """The remaining frames of a Decode call (read API, so it can follow call.read())."""
    frames: list[worker_pb2.DecodeFrame] = []
    while True:
        frame = await call.read()
        if frame is grpc.aio.EOF:
            return frames
        frames.append(frame)
