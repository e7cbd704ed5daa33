"""Entry point of the load-monitor: settings, logging, metrics, tracing, gRPC server, poll loop."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from services.load_monitor.monitor import LoadMonitor
from services.load_monitor.registry import Registry
from services.load_monitor.servicer import LoadMonitorServicer
from services.load_monitor.settings import Settings
from services.load_monitor.worker_client import WorkerLoadClient
from shared.channels import ChannelCache
from shared.cluster_auth import token_metadata
from shared.logs import configure_logging
from shared.metrics import start_metrics_server
from shared.proto import load_monitor_pb2, load_monitor_pb2_grpc
from shared.server import Server, exit_on_port_in_use, serve_until_stopped
from shared.settings import otel_env, parse_settings
from shared.tracing import configure_tracing, server_interceptors

log = structlog.get_logger(__name__)

SERVICE_NAME = load_monitor_pb2.DESCRIPTOR.services_by_name["LoadMonitor"].full_name


@dataclass
class LoadMonitorApp:
    """A built (not yet started) load-monitor: the server, the domain object and its client."""

    server: Server
    monitor: LoadMonitor
    client: WorkerLoadClient

    async def start(self) -> None:
        """Start serving, start polling, then report SERVING (for in-process use and tests)."""
        await self.server.start()
        self.monitor.start()
        await self.server.set_serving(True)

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.server.stop(grace_s)
        await self.monitor.stop()
        await self.client.close()


def build(settings: Settings, interceptors: Sequence[object] = ()) -> LoadMonitorApp:
    tls = settings.tls_config()
    # the same TLS settings as the server; its calls to workers carry the cluster token
    client = WorkerLoadClient(ChannelCache(tls=tls, call_metadata=token_metadata(settings.cluster_token)))
    registry = Registry(lease_ttl_s=settings.lease_ttl_s, stale_after_s=settings.stale_after_s)
    monitor = LoadMonitor(
        registry,
        fetch=client.fetch,
        load_interval_s=settings.load_interval_s,
        load_timeout_s=settings.load_timeout_s,
        forget=client.forget,
        info=client.info,
    )
    server = Server(
        settings.listen,
        [SERVICE_NAME],
        interceptors=list(interceptors),
        tls=tls,
        cluster_token=settings.cluster_token,
    )
    load_monitor_pb2_grpc.add_LoadMonitorServicer_to_server(LoadMonitorServicer(monitor), server.grpc)
    return LoadMonitorApp(server, monitor, client)


async def _serve(settings: Settings) -> None:
    app = build(settings, server_interceptors())

    async def on_ready() -> None:
        app.monitor.start()

    async def on_drain() -> None:
        await app.monitor.stop()

    try:
        await serve_until_stopped(app.server, on_ready, on_drain, grace_s=settings.drain_grace_s)
    finally:
        await app.client.close()


@exit_on_port_in_use
def main(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    settings = parse_settings(Settings, args, prog="pdserve load-monitor")
    configure_logging("load-monitor", settings.log_level, settings.log_format)
    configure_tracing("load-monitor", otel_env())
    port = start_metrics_server(settings.metrics_port)
    log.info(
        "starting",
        listen=settings.listen,
        metrics_port=port,
        load_interval_s=settings.load_interval_s,
        lease_ttl_s=settings.lease_ttl_s,
        stale_after_s=settings.stale_after_s,
    )
    asyncio.run(_serve(settings))
