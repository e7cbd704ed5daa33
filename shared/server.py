"""gRPC server bootstrap shared by every service: reflection, health, error mapping, graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.grpc_errors import ErrorMappingInterceptor
from shared.tls import TlsConfig

log = structlog.get_logger(__name__)

# KV chunks and long prompts exceed gRPC's 4 MB default (bytes).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Server:
    """A grpc.aio server with health + reflection; servicers are added before `start`."""

    def __init__(
        self,
        address: str,
        service_names: Sequence[str],
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        tls: TlsConfig | None = None,
    ) -> None:
        self.service_names = list(service_names)
        self.grpc = grpc.aio.server(
            interceptors=[*interceptors, ErrorMappingInterceptor()],
            options=CHANNEL_OPTIONS,
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.grpc
        )
        if tls is None:
            self.port = self.grpc.add_insecure_port(address)
        else:
            self.port = self.grpc.add_secure_port(address, tls.server_credentials())
        if self.port == 0:
            raise RuntimeError(f"cannot bind {address}")
        host = address.rsplit(":", 1)[0]
        if host in ("0.0.0.0", "[::]", ""):
            host = "127.0.0.1"
        self.address = f"{host}:{self.port}"
        self.serving = False  # what health reports for every service (False while starting/draining)

    async def start(self) -> None:
        await self.set_serving(False)
        await self.grpc.start()

    async def set_serving(self, serving: bool) -> None:
        """Overall health ("") and each service's health flip together."""
        status = SERVING if serving else NOT_SERVING
        self.serving = serving
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        self.serving = False
        await self.health.enter_graceful_shutdown()
        await self.grpc.stop(grace_s)


def install_signal_handlers(stop_event: asyncio.Event) -> None:
    """SIGTERM / SIGINT set `stop_event` (the service then drains and exits)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_event.set)


async def serve_until_stopped(
    server: Server,
    on_ready: Callable[[], Awaitable[None]] | None = None,
    on_drain: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 10.0,
    on_stop_requested: Callable[[], None] | None = None,
) -> None:
    """Start, mark SERVING after `on_ready`, wait for a signal, drain (`on_drain`), then stop.

    A signal while `on_ready` runs (e.g. a model still loading) cancels it and stops at once:
    nothing was served, so there is nothing to drain. `on_stop_requested` runs when the signal
    arrives, before health turns NOT_SERVING, so a service can refuse new work from the moment
    its peers can see it draining."""
    stop_event = asyncio.Event()
    install_signal_handlers(stop_event)
    await server.start()
    log.info("listening", address=server.address)
    if on_ready is not None and not await _unless_stopped(on_ready(), stop_event):
        log.info("stopped_while_starting")
        await server.stop(0)
        log.info("stopped")
        return
    await server.set_serving(True)
    log.info("serving")
    await stop_event.wait()
    log.info("draining", grace_s=grace_s)
    if on_stop_requested is not None:
        on_stop_requested()
    await server.set_serving(False)
    if on_drain is not None:
        await on_drain()
    await server.stop(grace_s)
    log.info("stopped")


async def _unless_stopped(work: Awaitable[None], stop_event: asyncio.Event) -> bool:
    """Run `work` unless `stop_event` is set first (then cancel it); True when it completed.
    Its exceptions propagate."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop_event.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        stopped.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False
