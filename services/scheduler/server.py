"""Entry point of the scheduler: settings, logging, metrics, tracing, gRPC server, load watcher."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from services.scheduler.policies import Balance
from services.scheduler.router import Policies, Router
from services.scheduler.servicer import SchedulerServicer
from services.scheduler.settings import Settings
from services.scheduler.watcher import LoadWatcher
from shared.channels import ChannelCache
from shared.cluster_auth import token_metadata
from shared.logs import configure_logging
from shared.metrics import start_metrics_server
from shared.proto import scheduler_pb2, scheduler_pb2_grpc
from shared.server import Server, exit_on_port_in_use, serve_until_stopped
from shared.settings import otel_env, parse_settings
from shared.tracing import configure_tracing, server_interceptors

log = structlog.get_logger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


def make_router(settings: Settings) -> Router:
    return Router(
        Policies(
            prefill=settings.prefill_policy,
            decode=settings.decode_policy,
            dp_rank=settings.dp_rank_policy,
            local_prefill_threshold=settings.local_prefill_threshold,
            unified_disaggregate_threshold=settings.unified_disaggregate_threshold,
            reservation_grace_s=settings.reservation_grace_s,
            balance=Balance(
                abs_tokens=settings.cache_aware_balance_abs_tokens,
                rel=settings.cache_aware_balance_rel,
                min_match_share=settings.cache_aware_min_match_share,
            ),
        ),
        seed=None if settings.seed < 0 else settings.seed,
        prefix_entries_per_worker=settings.prefix_entries_per_worker,
    )


@dataclass
class SchedulerApp:
    """A built (not yet started) scheduler: server, router, load watcher and its channels."""

    server: Server
    router: Router
    watcher: LoadWatcher
    channels: ChannelCache

    async def start(self) -> None:
        """Serve, start watching the load-monitor, report SERVING (in-process use and tests)."""
        await self.server.start()
        self.watcher.start()
        await self.server.set_serving(True)

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.server.stop(grace_s)
        await self.watcher.stop()
        await self.channels.close()


def build(settings: Settings, interceptors: Sequence[object] = ()) -> SchedulerApp:
    router = make_router(settings)
    tls = settings.tls_config()
    # the same TLS settings for the channels this service dials; internal calls carry the token
    channels = ChannelCache(tls=tls, call_metadata=token_metadata(settings.cluster_token))
    watcher = LoadWatcher(
        channels, settings.load_monitor_address, router, backoff_max_s=settings.watch_backoff_max_s
    )
    server = Server(
        settings.listen,
        [SERVICE_NAME],
        interceptors=list(interceptors),
        tls=tls,
        cluster_token=settings.cluster_token,
    )
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(router), server.grpc)
    return SchedulerApp(server, router, watcher, channels)


async def _serve(settings: Settings) -> None:
    app = build(settings, server_interceptors())

    async def on_ready() -> None:
        # SERVING at once: until the first snapshot, Schedule answers UNAVAILABLE with the reason.
        app.watcher.start()

    async def on_drain() -> None:
        await app.watcher.stop()

    try:
        await serve_until_stopped(app.server, on_ready, on_drain, grace_s=settings.drain_grace_s)
    finally:
        await app.channels.close()


@exit_on_port_in_use
def main(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    settings = parse_settings(Settings, args, prog="pdserve scheduler")
    configure_logging("scheduler", settings.log_level, settings.log_format)
    configure_tracing("scheduler", otel_env())
    port = start_metrics_server(settings.metrics_port)
    log.info(
        "starting",
        listen=settings.listen,
        metrics_port=port,
        load_monitor_address=settings.load_monitor_address,
        prefill_policy=settings.prefill_policy,
        decode_policy=settings.decode_policy,
        dp_rank_policy=settings.dp_rank_policy,
        local_prefill_threshold=settings.local_prefill_threshold,
        unified_disaggregate_threshold=settings.unified_disaggregate_threshold,
    )
    asyncio.run(_serve(settings))
