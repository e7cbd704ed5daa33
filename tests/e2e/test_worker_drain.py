"""A real worker process (`python -m services.worker`) drains on SIGTERM: in-flight streams finish
(or, past the grace, end with a clear ABORT frame), new work is refused, the process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.proto import common_pb2, worker_pb2, worker_pb2_grpc
from shared.server import CHANNEL_OPTIONS
from tests.support.tiny_models import build_tiny_model

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PROMPT_IDS = [436, 433, 3, 223, 319, 450, 455, 425, 300, 301, 302, 303]
MAX_TOKENS = 1500  # long enough to still run when SIGTERM arrives


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_worker(
    model: Path, log_path: Path, grace_s: float, role: str = "unified", extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m services.worker` on a free port (extra: more flags); (process, address)."""
    address = f"127.0.0.1:{free_port()}"
    cmd = [
        sys.executable,
        "-m",
        "services.worker",
        "--role",
        role,
        "--model",
        str(model),
        "--listen",
        address,
        "--metrics-port",
        "-1",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--kv-cache-tokens",
        "4096",
        "--torch-threads",
        "1",
        "--drain-grace-s",
        str(grace_s),
        "--log-format",
        "json",
        *extra,
    ]
    log = open(log_path, "wb")  # noqa: SIM115 - closed by the fixture
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, address


def wait_serving(proc: subprocess.Popen[bytes], address: str, log_path: Path) -> None:
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text(errors="replace")
            try:
                resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise AssertionError("worker never became SERVING:\n" + log_path.read_text(errors="replace"))


def wait_not_serving(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        resp = health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Worker"), timeout=5)
        if resp.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            return
        time.sleep(0.01)
    raise AssertionError("health never went NOT_SERVING after SIGTERM")


@pytest.fixture(scope="module")
def drain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("drain-model") / "tiny-bpe", "bpe")


@pytest.fixture
def worker_factory(drain_model: Path, tmp_path: Path) -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    def make(grace_s: float) -> tuple[subprocess.Popen[bytes], str, Path]:
        log_path = tmp_path / f"worker-{len(procs)}.log"
        proc, address = start_worker(drain_model, log_path, grace_s)
        procs.append(proc)
        wait_serving(proc, address, log_path)
        return proc, address, log_path

    yield make
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def long_decode(address: str, request_id: str) -> tuple[grpc.Channel, Iterator[worker_pb2.DecodeFrame]]:
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = worker_pb2_grpc.WorkerStub(channel)
    stream = stub.Decode(
        worker_pb2.DecodeRequest(
            request_id=request_id,
            prompt_token_ids=PROMPT_IDS,
            local_prefill=True,
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        ),
        timeout=300,
    )
    return channel, stream


def test_sigterm_mid_stream_finishes_the_stream_and_exits_0(worker_factory: Callable[[float], Any]) -> None:
    proc, address, log_path = worker_factory(60.0)
    channel, stream = long_decode(address, "drain-1")
    try:
        frames = [next(stream), next(stream)]  # ADMITTED + first tokens: mid-stream now
        assert frames[0].kind == worker_pb2.DECODE_FRAME_KIND_ADMITTED
        proc.send_signal(signal.SIGTERM)
        wait_not_serving(channel)
        # Draining: new work is refused with a clear status while the stream goes on.
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(
                stub.Decode(
                    worker_pb2.DecodeRequest(
                        request_id="late",
                        prompt_token_ids=PROMPT_IDS,
                        local_prefill=True,
                        sampling=common_pb2.SamplingParams(max_tokens=4),
                    ),
                    timeout=10,
                )
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in (err.value.details() or "")
        frames.extend(stream)  # the stream still completes
    finally:
        channel.close()
    final = frames[-1]
    assert final.kind == worker_pb2.DECODE_FRAME_KIND_FINAL
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.generated_tokens == MAX_TOKENS
    assert proc.wait(timeout=60) == 0
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    events = [line.get("event") for line in lines]
    assert "draining" in events and "stopped" in events
    assert all(line.get("service") == "unified-worker" for line in lines)


def test_sigterm_past_grace_aborts_cleanly_and_exits_0(worker_factory: Callable[[float], Any]) -> None:
    proc, address, _log = worker_factory(0.2)
    channel, stream = long_decode(address, "drain-2")
    try:
        frames = [next(stream), next(stream)]
        proc.send_signal(signal.SIGTERM)
        frames.extend(stream)
    finally:
        channel.close()
    final = frames[-1]
    assert final.kind == worker_pb2.DECODE_FRAME_KIND_FINAL
    assert final.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert final.HasField("generated_tokens") and final.generated_tokens < MAX_TOKENS
    assert proc.wait(timeout=60) == 0
