"""Gateway process: settings, logging, tracing, metrics, the gRPC server and the HTTP API on one
asyncio loop over one GatewayService, API keys, tokenizer loading (health NOT_SERVING until it is
loaded), graceful SIGTERM drain."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from services.gateway.batch_runner import RunnerSettings
from services.gateway.clients import GrpcMembership, GrpcScheduler, GrpcWorkers
from services.gateway.http_api import HttpApi
from services.gateway.http_batches import BatchApi
from services.gateway.http_server import HttpServer
from services.gateway.lora_admin import LoraAdmin
from services.gateway.sampling_defaults import SamplingDefaults
from services.gateway.service import GatewayService
from services.gateway.servicer import GatewayServicer
from services.gateway.settings import GatewaySettings, load_settings
from services.gateway.tokenization import PromptTokenizer
from shared.auth import load_api_keys
from shared.channels import ChannelCache
from shared.cluster_auth import token_metadata
from shared.grpc_auth import ApiKeyInterceptor
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
    http_api: HttpApi
    http: HttpServer | None  # None when --http-port -1
    batches: BatchApi

    @property
    def http_url(self) -> str | None:
        """The HTTP API's base URL, e.g. http://127.0.0.1:8000 (the OpenAI base URL adds /v1)."""
        return None if self.http is None else self.http.base_url

    async def start_http(self) -> None:
        if self.http is not None:
            await self.http.start()

    async def load(self) -> None:
        """Load the tokenizer (off the event loop); the service is usable afterwards."""
        folder = await asyncio.to_thread(
            resolve_model, self.settings.model, self.settings.model_cache_dir or None
        )
        tokenizer = await asyncio.to_thread(PromptTokenizer.load, folder)
        defaults = (
            await asyncio.to_thread(SamplingDefaults.of_model, folder)
            if self.settings.generation_config == "auto"
            else SamplingDefaults()
        )
        self.service.set_tokenizer(tokenizer, defaults)
        log.info("model_ready", model=tokenizer.model_id)

    async def start(self) -> None:
        """Start serving (health NOT_SERVING), load, then SERVING. For tests; main() uses
        serve_until_stopped."""
        await self.server.start()
        await self.start_http()
        await self.load()
        self.batches.start()
        self.http_api.stored.start()
        await self.server.set_serving(True)

    async def drain(self) -> None:
        """SIGTERM: refuse new requests, let in-flight streams finish within drain_grace_s, then
        abort what is left on its workers (the server stops afterwards)."""
        log.info("drain_started", in_flight=self.service.num_in_flight)
        # batches send no new request; theirs in flight finish with the rest (the next gateway
        # resumes the batches)
        grace_s = self.settings.drain_grace_s
        await asyncio.gather(
            self.batches.drain(grace_s), self.http_api.stored.drain(grace_s), self.service.drain(grace_s)
        )
        if self.http is not None:
            await self.http.stop()
        log.info("drained")

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.batches.close()
        await self.http_api.stored.close()
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace_s)
        await self.service.close()
        await self.channels.close()


def build_app(settings: GatewaySettings) -> GatewayApp:
    tls = settings.tls_config()
    # scheduler and worker channels use the same TLS settings; internal calls carry the token
    channels = ChannelCache(tls=tls, call_metadata=token_metadata(settings.cluster_token))
    scheduler = GrpcScheduler(channels, settings.scheduler_address, settings.worker_rpc_timeout_s)
    workers = GrpcWorkers(channels, settings.worker_rpc_timeout_s)
    service = GatewayService(
        settings,
        scheduler,
        workers,
        membership=GrpcMembership(channels, settings.scheduler_address),
        # the scheduler shows a change within a registration's round trip: its control timeout
        lora_admin=LoraAdmin(
            scheduler, workers, settings.lora_update_timeout_s, settings.worker_rpc_timeout_s
        ),
    )
    keys = load_api_keys(settings.api_keys, settings.api_key_file)
    # The API key check runs first: an unauthenticated call reaches nothing else.
    auth = ApiKeyInterceptor(keys, [SERVICE_NAME])
    server = Server(settings.listen, [SERVICE_NAME], interceptors=[auth, *server_interceptors()], tls=tls)
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(service), server.grpc)
    http_api = HttpApi(
        service,
        keys,
        lambda: server.serving,
        settings.http_max_body_bytes,
        response_dir=settings.response_dir,
        response_retention_s=settings.response_retention_s,
    )
    http = None
    if settings.http_port >= 0:
        http = HttpServer(
            http_api.app,
            settings.listen.rsplit(":", 1)[0],
            settings.http_port,
            ssl_cert_file=settings.tls_cert_file if tls else "",
            ssl_key_file=settings.tls_key_file if tls else "",
            ssl_ca_file=settings.tls_ca_file if tls else "",
            client_auth=settings.tls_client_auth,
            reuse_port=settings.http_reuse_port,
        )
    batches = BatchApi(
        http_api.app,
        keys,
        http_api.inner_authorization,
        settings.batch_dir,
        RunnerSettings(
            settings.batch_concurrency,
            settings.batch_priority,
            settings.max_batch_lines,
            settings.batch_poll_s,
            retention_s=settings.batch_retention_s,
        ),
        settings.max_batch_file_bytes,
        settings.http_max_body_bytes,
    )
    log.info("api_keys", enabled=keys.enabled, count=len(keys))  # how many, never which
    return GatewayApp(settings, server, service, channels, http_api, http, batches)


async def serve(settings: GatewaySettings) -> None:
    try:
        app = build_app(settings)
    except (ValueError, RuntimeError) as exc:  # an unreadable key file, a port in use: say so
        log.error("gateway_failed", error=str(exc))
        raise SystemExit(1) from None
    metrics_port = start_metrics_server(settings.metrics_port)
    log.info("gateway_starting", scheduler=settings.scheduler_address, metrics_port=metrics_port)

    async def ready() -> None:
        await app.start_http()  # /health answers 503 while the tokenizer loads
        await app.load()
        app.batches.start()
        app.http_api.stored.start()

    try:
        await serve_until_stopped(
            app.server, on_ready=ready, on_drain=app.drain, grace_s=settings.drain_grace_s
        )
    except Exception as exc:  # e.g. the model folder is missing: say so and exit non-zero
        log.error("gateway_failed", error=str(exc) or type(exc).__name__)
        await app.server.stop(0)
        raise SystemExit(1) from None
    finally:
        await app.batches.close()
        await app.http_api.stored.close()
        if app.http is not None:
            await app.http.stop()
        await app.service.close()
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
