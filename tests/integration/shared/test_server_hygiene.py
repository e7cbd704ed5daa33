"""Server process hygiene over real sockets: a busy port fails start-up (no SO_REUSEPORT
sharing), and the keepalive policies of servers and clients agree, so a long idle stream lives on
(shown with short intervals: clients ask for a ping every 200 ms, which grpc rounds up to one a
second, instead of every 30 s; the default server policy sends GOAWAY after 3 such pings)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.metrics import start_metrics_server
from shared.server import PortInUse, Server, channel_options, server_options

ROOT = Path(__file__).resolve().parents[3]
PING_MS = 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_second_server_on_a_busy_port_fails() -> None:
    first = Server("127.0.0.1:0", ["x"])
    await first.start()
    try:
        with pytest.raises(PortInUse, match="cannot listen"):
            Server(first.address, ["x"])
    finally:
        await first.stop(0)


def test_busy_metrics_port_is_port_in_use() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(PortInUse, match="cannot serve metrics"):
            start_metrics_server(s.getsockname()[1], addr="127.0.0.1")


@pytest.mark.parametrize("which", ["listen", "metrics"])
def test_service_on_a_busy_port_exits_1_with_one_line(which: str) -> None:
    """A second load-monitor on the first one's port (grpc would share it with SO_REUSEPORT)."""
    port, metrics = _free_port(), _free_port()
    args = [sys.executable, "-m", "services.load_monitor", "--log-format", "json"]
    first = subprocess.Popen(
        [*args, "--listen", f"127.0.0.1:{port}", "--metrics-port", str(metrics)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(300):  # until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            time.sleep(0.05)
        second_args = (
            ["--listen", f"127.0.0.1:{port}", "--metrics-port", "-1"]
            if which == "listen"
            else ["--listen", "127.0.0.1:0", "--metrics-port", str(metrics)]
        )
        second = subprocess.run([*args, *second_args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        first.terminate()
        first.wait(timeout=30)
    out = second.stdout + second.stderr
    assert second.returncode == 1, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if "cannot_start" in line]
    assert len(errors) == 1, out
    assert str(port if which == "listen" else metrics) in errors[0]


async def _idle_watch_survives(server_opts: Sequence[tuple[str, Any]], idle_s: float) -> bool:
    """Open a health Watch, stay idle `idle_s` with the client pinging every PING_MS, then flip
    the status: True when the change still arrives on the same stream."""
    server = Server("127.0.0.1:0", ["svc"], options=server_opts)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address, options=channel_options(PING_MS)) as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="svc"))
            first = await call.read()
            assert first.status == health_pb2.HealthCheckResponse.NOT_SERVING
            await asyncio.sleep(idle_s)
            await server.set_serving(True)
            try:
                changed = await asyncio.wait_for(call.read(), 5.0)
            except grpc.aio.AioRpcError:
                return False
            return bool(changed.status == health_pb2.HealthCheckResponse.SERVING)
    finally:
        await server.stop(0)


async def test_long_idle_stream_survives_matching_keepalive_policy() -> None:
    assert await _idle_watch_survives(server_options(PING_MS), idle_s=6.0)


async def test_default_server_policy_would_goaway_the_pinging_client() -> None:
    """The control: grpc's default server policy refuses pings this frequent (too_many_pings)."""
    defaults = [("grpc.so_reuseport", 0)]
    assert not await _idle_watch_survives(defaults, idle_s=6.0)


def test_sibling_gateways_share_the_http_port_and_a_foreign_holder_still_blocks_it() -> None:
    """`pdserve up --gateways N`: gateways bound with reuse_port share one HTTP port; a process
    holding the port without SO_REUSEPORT (anything else) still makes start-up fail."""
    from fastapi import FastAPI

    from services.gateway.http_server import HttpServer

    port = _free_port()
    first = HttpServer(FastAPI(), "127.0.0.1", port, reuse_port=True)
    second = HttpServer(FastAPI(), "127.0.0.1", port, reuse_port=True)
    assert first.port == second.port == port
    with pytest.raises(RuntimeError, match=f"cannot bind the HTTP API to 127.0.0.1:{port}"):
        HttpServer(FastAPI(), "127.0.0.1", port)  # a gateway of another stack, without the flag
    for server in (first, second):
        server._sock.close()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        with pytest.raises(RuntimeError, match="cannot bind the HTTP API"):
            HttpServer(FastAPI(), "127.0.0.1", port, reuse_port=True)
