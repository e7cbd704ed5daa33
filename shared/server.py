"""gRPC server bootstrap shared by every service: reflection, health, error mapping, graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ParamSpec

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared import cluster_auth
from shared.grpc_errors import ErrorMappingInterceptor
from shared.server_streams import CloseStreamsInterceptor
from shared.tls import TlsConfig

log = structlog.get_logger(__name__)
P = ParamSpec("P")

# KV chunks and long prompts exceed gRPC's 4 MB default (bytes).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Clients ping an idle connection every KEEPALIVE_TIME_MS, calls or not, so that a dead peer (a
# node gone, a NAT entry dropped) is noticed within KEEPALIVE_TIMEOUT_MS; servers must allow
# exactly that, or they answer GOAWAY too_many_pings (ENHANCE_YOUR_CALM) and idle channels flap.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000


def channel_options(keepalive_time_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, Any]]:
    """Client channel options: large messages, keepalive pings also without calls."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging a long idle stream
    ]


def server_options(keepalive_time_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, Any]]:
    """Server options matching `channel_options(keepalive_time_ms)` of the clients: pings without
    calls allowed, at most one per half interval (slack for timer jitter); the server pings its
    idle clients on the same interval. SO_REUSEPORT is off, so a port already in use fails
    start-up instead of two servers silently sharing it."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", keepalive_time_ms // 2),
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_time_ms // 2),
        ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a client for pinging as agreed
        ("grpc.http2.max_pings_without_data", 0),
    ]


CHANNEL_OPTIONS: list[tuple[str, Any]] = channel_options()
SERVER_OPTIONS: list[tuple[str, Any]] = server_options()


class PortInUse(RuntimeError):
    """A listen address or metrics port could not be bound (another process holds it, or the
    address is not local). A service ends with one log line and exit status 1."""


def exit_on_port_in_use(main: Callable[P, None]) -> Callable[P, None]:
    """Wraps a service's `main`: a PortInUse becomes one error line and exit status 1."""

    @functools.wraps(main)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            main(*args, **kwargs)
        except PortInUse as exc:
            log.error("cannot_start", error=str(exc))
            raise SystemExit(1) from None

    return wrapper


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
        options: Sequence[tuple[str, Any]] | None = None,
        cluster_token: str = "",
    ) -> None:
        """`cluster_token`: required on calls to pdserve's internal services (shared.cluster_auth);
        checked before every other interceptor, so an unauthenticated call reaches nothing."""
        self.service_names = list(service_names)
        self.grpc = grpc.aio.server(
            interceptors=[
                CloseStreamsInterceptor(),
                *cluster_auth.server_interceptors(cluster_token),
                *interceptors,
                ErrorMappingInterceptor(),
            ],
            options=list(SERVER_OPTIONS if options is None else options),
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.grpc
        )
        try:
            if tls is None:
                self.port = self.grpc.add_insecure_port(address)
            else:
                self.port = self.grpc.add_secure_port(address, tls.server_credentials())
        except RuntimeError as exc:  # grpcio raises when the port cannot be bound
            raise PortInUse(f"cannot listen on {address}: the address is in use or not local") from exc
        if self.port == 0:
            raise PortInUse(f"cannot listen on {address}: the address is in use or not local")
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
