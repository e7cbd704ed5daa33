"""The gateway as a real process (`python -m services.gateway`): health and graceful SIGTERM drain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.proto import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2_grpc, worker_pb2_grpc

from .fakes import FakeScheduler, FakeWorker, Hang, aggregated, final, start_server, tokens

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.e2e


@dataclass
class Peers:
    scheduler: FakeScheduler
    worker: FakeWorker


@pytest.fixture
async def peers() -> AsyncIterator[Peers]:
    scheduler, worker = FakeScheduler(), FakeWorker("w-1")
    s1, scheduler.address = await start_server(scheduler_pb2_grpc.add_SchedulerServicer_to_server, scheduler)
    s2, worker.address = await start_server(worker_pb2_grpc.add_WorkerServicer_to_server, worker)
    yield Peers(scheduler, worker)
    await s1.stop(0)
    await s2.stop(0)


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[str]
    address: str
    lines: list[str]


@pytest.fixture
def start_gateway(tiny_model: Path) -> Iterator[object]:
    started: list[GatewayProcess] = []

    def start(scheduler_address: str, grace_s: float) -> GatewayProcess:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.gateway",
                "--listen",
                "127.0.0.1:0",
                "--metrics-port",
                "-1",
                "--http-port",
                "-1",
                "--scheduler-address",
                scheduler_address,
                "--model",
                str(tiny_model),
                "--log-format",
                "json",
                "--drain-grace-s",
                str(grace_s),
            ],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        lines: list[str] = []
        found = threading.Event()
        address: list[str] = []

        def pump() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append(line)
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "listening":
                    address.append(event["address"])
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        assert found.wait(60), "gateway did not start:\n" + "".join(lines)
        gw = GatewayProcess(proc, address[0], lines)
        started.append(gw)
        return gw

    yield start
    for gw in started:
        if gw.proc.poll() is None:
            gw.proc.kill()
            gw.proc.wait(10)


async def wait_serving(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(600):
            resp = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
            await asyncio.sleep(0.05)
    raise AssertionError("gateway never became SERVING")


async def wait_exit(proc: subprocess.Popen[str], timeout_s: float) -> int:
    for _ in range(int(timeout_s * 20)):
        if (rc := proc.poll()) is not None:
            return rc
        await asyncio.sleep(0.05)
    raise AssertionError("gateway did not exit")


async def test_sigterm_finishes_in_flight_stream_then_exits(
    peers: Peers, start_gateway: Callable[[str, float], Any]
) -> None:
    gw = start_gateway(peers.scheduler.address, 20.0)
    await wait_serving(gw.address)
    release = asyncio.Event()
    peers.scheduler.responses.append(aggregated(peers.worker))
    peers.worker.decode_scripts.append(
        [tokens("a"), Hang(release), final("b", 2, common_pb2.FINISH_REASON_STOP)]
    )
    async with grpc.aio.insecure_channel(gw.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        call = stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", max_tokens=5), timeout=60)
        first = await call.read()
        assert first.text == "a"
        gw.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert gw.proc.poll() is None  # still draining: the stream is in flight
        release.set()
        rest = []
        while (frame := await call.read()) is not grpc.aio.EOF:
            rest.append(frame)
        assert rest[-1].kind == gateway_pb2.FRAME_KIND_FINAL
        assert rest[-1].usage.completion_tokens == 2
    assert await wait_exit(gw.proc, 30) == 0
    assert any('"draining"' in line for line in gw.lines)


async def test_sigterm_past_grace_aborts_the_stream_on_the_worker(
    peers: Peers, start_gateway: Callable[[str, float], Any]
) -> None:
    gw = start_gateway(peers.scheduler.address, 0.5)
    await wait_serving(gw.address)
    peers.scheduler.responses.append(aggregated(peers.worker))
    peers.worker.decode_scripts.append([tokens("a"), Hang()])
    async with grpc.aio.insecure_channel(gw.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        call = stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", request_id="never-ends"), timeout=60)
        await call.read()
        gw.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.aio.AioRpcError):
            while await call.read() is not grpc.aio.EOF:
                pass
    assert await wait_exit(gw.proc, 30) == 0
    await asyncio.wait_for(peers.worker.aborted.wait(), 10)
    assert peers.worker.aborts == ["never-ends"]
