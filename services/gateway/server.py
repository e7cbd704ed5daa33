"""Gateway process: settings, logging, tracing, metrics, the gRPC server, tokenizer loading
(health NOT_SERVING until it is loaded), graceful SIGTERM drain."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from services.gateway.clients import GrpcScheduler, GrpcWorkers
from services.gateway.service import GatewayService
from services.gateway.servicer import GatewayServicer
from services.gateway.settings import GatewaySettings, load_settings
from services.gateway.tokenization import PromptTokenizer
from shared.channels import ChannelCache
from shared.logs import configure_logging
from shared.metrics import start_metrics_server
from shared.model_store import resolve_model
from shared.proto import gateway_pb2, gateway_pb2_grpc
from shared.server import Server, exit_on_port_in_use, serve_until_stopped
from shared.settings import otel_env
from shared.tracing import configure_tracing, server_interceptors

log = structlog.get_logger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


@dataclass
class GatewayApp:
    """Everything one gateway process runs; tests build one on 127.0.0.1:0."""

    settings: GatewaySettings
    server: Server
    service: GatewayService
    channels: ChannelCache

    async def load(self) -> None:
        """Load the tokenizer (off the event loop); the service is usable afterwards."""
        folder = await asyncio.to_thread(
            resolve_model, self.settings.model, self.settings.model_cache_dir or None
        )
        tokenizer = await asyncio.to_thread(PromptTokenizer.load, folder)
        self.service.set_tokenizer(tokenizer)
        log.info("model_ready", model=tokenizer.model_id)

    async def start(self) -> None:
        """Start serving (health NOT_SERVING), load, then SERVING. For tests; main() uses
        serve_until_stopped."""
        await self.server.start()
        await self.load()
        await self.server.set_serving(True)

    async def drain(self) -> None:
        """SIGTERM: refuse new requests, let in-flight streams finish within drain_grace_s, then
        abort what is left on its workers (the server stops afterwards)."""
        log.info("drain_started", in_flight=self.service.num_in_flight)
        await self.service.drain(self.settings.drain_grace_s)
        log.info("drained")

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.server.stop(grace_s)
        await self.service.dispatcher.wait_for_aborts(timeout_s=5.0)
        await self.channels.close()


def build_app(settings: GatewaySettings) -> GatewayApp:
    tls = settings.tls_config()
    channels = ChannelCache(tls=tls)  # scheduler and worker channels use the same TLS settings
    service = GatewayService(
        settings,
        GrpcScheduler(channels, settings.scheduler_address, settings.worker_rpc_timeout_s),
        GrpcWorkers(channels, settings.worker_rpc_timeout_s),
    )
    server = Server(settings.listen, [SERVICE_NAME], interceptors=server_interceptors(), tls=tls)
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(service), server.grpc)  # type: ignore[no-untyped-call]
    return GatewayApp(settings, server, service, channels)


async def serve(settings: GatewaySettings) -> None:
    app = build_app(settings)
    metrics_port = start_metrics_server(settings.metrics_port)
    log.info("gateway_starting", scheduler=settings.scheduler_address, metrics_port=metrics_port)
    try:
        await serve_until_stopped(
            app.server, on_ready=app.load, on_drain=app.drain, grace_s=settings.drain_grace_s
        )
    except Exception as exc:  # e.g. the model folder is missing: say so and exit non-zero
        log.error("gateway_failed", error=str(exc) or type(exc).__name__)
        await app.server.stop(0)
        raise SystemExit(1) from None
    finally:
        await app.service.dispatcher.wait_for_aborts(timeout_s=5.0)
        await app.channels.close()


@exit_on_port_in_use
def main(argv: Sequence[str] | None = None) -> None:
    """`pdserve gateway [flags]` / `python -m services.gateway [flags]` (argv None: sys.argv)."""
    settings = load_settings(sys.argv[1:] if argv is None else argv)
    configure_logging("gateway", settings.log_level, settings.log_format)
    configure_tracing("gateway", otel_env())
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
