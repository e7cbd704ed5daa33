"""Worker process bootstrap: settings, logs, tracing, metrics, model load, gRPC server,
load-monitor membership and the SIGTERM drain (through shared.server.serve_until_stopped, like
every service). `main` is the entry point of every worker role."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence

import structlog

from services.worker.core import WorkerCore
from services.worker.engine.api import Engine, EngineConfig, engine_options
from services.worker.kv_nixl import NixlKvAgent
from services.worker.kv_receive import KvLoadFailurePolicy
from services.worker.kv_send_nixl import NixlKvSender
from services.worker.kv_transfer import GrpcKvPusher
from services.worker.messages import CAPABILITIES, PROTO_VERSION
from services.worker.registration import Registration
from services.worker.servicer import WorkerServicer
from services.worker.settings import WorkerSettings
from shared.channels import ChannelCache
from shared.cluster import (
    LORA_RUNTIME_CAPABILITY,
    NIXL_CAPABILITY,
    NIXL_PARTS_CAPABILITY,
    KvTransport,
    Role,
    WorkerInfo,
)
from shared.cluster_auth import token_metadata
from shared.cluster_convert import worker_info_to_pb
from shared.errors import InvalidArgument, PdserveError
from shared.logs import configure_logging
from shared.memory import trim_heap
from shared.metrics import start_metrics_server
from shared.model_store import model_id_for, resolve_model
from shared.proto import worker_pb2_grpc
from shared.server import Server, exit_on_port_in_use, serve_until_stopped
from shared.settings import otel_env, parse_settings
from shared.tracing import configure_tracing, server_interceptors

log = structlog.get_logger(__name__)

SERVICE_NAME = "pdserve.v1.Worker"
# Time left to streams that were aborted at the end of the drain to send their last frame (s).
_ABORT_FLUSH_S = 5.0
# After the drain, RPCs still open get this long before the server cancels them (s).
_SERVER_STOP_GRACE_S = 1.0
# Channels kept open to peers (decode workers for KV pushes, the load-monitor); decode workers
# come and go, so the least recently used are closed beyond this (count).
_MAX_CACHED_CHANNELS = 64

EngineFactory = Callable[[EngineConfig], Engine]


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" when a GPU is visible, else "cpu"."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """ "auto" -> float32 on CPU (exact, token-identical), bfloat16 on CUDA."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" else "float32"


def default_engine_factory(config: EngineConfig) -> Engine:
    from services.worker.engine import create_engine

    return create_engine(config)


def new_worker_id(role: Role) -> str:
    return f"{role.value}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


# Seconds between malloc_trim calls (a few ms each on a 2 GB heap).
_HEAP_TRIM_INTERVAL_S = 10.0


class WorkerApp:
    """One worker: gRPC server first (health NOT_SERVING), then the model, then SERVING."""

    def __init__(
        self, settings: WorkerSettings, engine_factory: EngineFactory = default_engine_factory
    ) -> None:
        self.settings = settings
        self._engine_factory = engine_factory
        self.servicer = WorkerServicer()
        tls = settings.tls_config()
        self.server = Server(
            settings.listen,
            [SERVICE_NAME],
            interceptors=server_interceptors(),
            tls=tls,
            cluster_token=settings.cluster_token,
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server.grpc)
        self.address = settings.advertise_address or self.server.address
        self.worker_id = settings.worker_id or new_worker_id(settings.role)
        # KV pushes and registration dial peers with the same TLS settings as the server.
        self.channels = ChannelCache(
            tls=tls,
            call_metadata=token_metadata(settings.cluster_token),
            max_channels=_MAX_CACHED_CHANNELS,
        )
        self.pusher = GrpcKvPusher(self.channels, timeout_s=settings.kv_push_timeout_s)
        self.engine: Engine | None = None
        self.nixl: NixlKvAgent | None = None
        self.core: WorkerCore | None = None
        self.registration: Registration | None = None
        self._refresher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen, get ready, then report SERVING (tests and in-process use; `serve` runs the
        same steps through serve_until_stopped)."""
        await self.server.start()
        self._log_identity()
        await self.ready()
        await self.server.set_serving(True)
        log.info("serving", address=self.address)

    def _log_identity(self) -> None:
        log.info(
            "worker_starting",
            address=self.server.address,
            advertise_address=self.address,
            role=self.settings.role.value,
            worker_id=self.worker_id,
        )

    async def ready(self) -> None:
        """Load and warm up the model, start the load gauges, register with the load-monitor."""
        await self.load()
        self._refresher = asyncio.create_task(self._refresh_loop(), name="load-gauges")
        if self.settings.load_monitor_address:
            assert self.core is not None
            self.registration = Registration(
                self.channels,
                self.settings.load_monitor_address,
                worker_info_to_pb(self.core.identity),
                heartbeat_interval_s=self.settings.heartbeat_interval_s,
                retry_s=self.settings.register_retry_s,
            )
            self.registration.start()

    async def load(self) -> None:
        s = self.settings
        started = time.perf_counter()
        log.info("model_resolving", model=s.model)
        path = await asyncio.to_thread(resolve_model, s.model, s.model_cache_dir or None)
        draft_path = ""
        if s.speculative == "draft":
            try:
                resolved = await asyncio.to_thread(resolve_model, s.draft_model, s.model_cache_dir or None)
            except FileNotFoundError as exc:
                raise FileNotFoundError(f"--draft-model: {exc}") from None
            draft_path = str(resolved)
        device = resolve_device(s.device)
        dtype = resolve_dtype(s.dtype, device)
        prefill = s.role is Role.PREFILL
        config = EngineConfig(
            model_path=str(path),
            device=device,
            dtype=dtype,
            draft_model_path=draft_path,
            **engine_options(
                s,
                # a prefill worker runs prompts (many rows), hardly ever a static step: no row
                # copy of the weights, no graph capture at start
                cpu_row_copy=s.cpu_row_copy and not prefill,
                cuda_graph_warm_tokens=0 if prefill else s.cuda_graph_warm_tokens,
            ),
        )
        log.info("model_loading", path=str(path), device=device, dtype=dtype, dp_size=s.dp_size)
        # Off the event loop, so health checks are answered (NOT_SERVING) while loading.
        engine = await asyncio.to_thread(self._create_engine, config)
        self.engine = engine
        # NIXL: every rank's pool registered once, now that the pools are committed
        if s.kv_transport == "auto":
            self.nixl = NixlKvAgent.create(
                engine.kv_pools(),
                engine.kv_layout,
                progress_thread=s.kv_nixl_progress == "thread",
                direct=s.kv_cuda_ipc,
            )
        nixl = (NIXL_CAPABILITY, NIXL_PARTS_CAPABILITY) if self.nixl is not None else ()
        # adapters load while it runs where the engine's LoRA machinery is on
        runtime_lora = (LORA_RUNTIME_CAPABILITY,) if s.lora_enabled else ()
        capabilities = CAPABILITIES + nixl + runtime_lora
        model_id = engine.model_id or model_id_for(path)
        if model_id in s.lora_adapters:  # requests naming it would mean the base model
            raise InvalidArgument(
                f"--lora-modules: {model_id!r} is the base model's id; give the adapter another name"
            )
        identity = WorkerInfo(
            worker_id=self.worker_id,
            address=self.address,
            role=s.role,
            model_id=model_id,
            dp_size=s.dp_size,
            kv_layout=engine.kv_layout,
            capabilities=capabilities,
            proto_version=PROTO_VERSION,
            max_model_len=engine.max_model_len,
            device=device,
            lora_adapters=s.lora_adapters,
        )
        self.core = WorkerCore(
            engine,
            identity,
            self.pusher,
            kv_chunk_bytes=s.kv_chunk_bytes,
            log_prompts=s.log_prompts,
            nixl=self.nixl,
            senders=(
                {KvTransport.NIXL: NixlKvSender(engine, self.nixl, self.channels, s.kv_push_timeout_s)}
                if self.nixl is not None
                else None
            ),
            kv_load_failure_policy=KvLoadFailurePolicy(s.kv_load_failure_policy),
            kv_read_timeout_s=s.kv_read_timeout_s,
            lora_paths=s.lora_module_paths,
            on_identity_change=self._identity_changed,
        )
        self.core.refresh_metrics()
        self.servicer.core = self.core
        log.info(
            "model_ready",
            model_id=identity.model_id,
            kv_transports="nixl+grpc" if self.nixl is not None else "grpc",
            kv_layout=str(identity.kv_layout),
            max_model_len=identity.max_model_len,
            lora_adapters=list(identity.lora_adapters),
            seconds=round(time.perf_counter() - started, 3),
        )

    def _identity_changed(self, identity: WorkerInfo) -> None:
        """LoRA adapters were loaded or unloaded: Info says so already; the load-monitor (and
        through it the scheduler's pools) learns it from a new registration."""
        if self.registration is not None:
            self.registration.update(worker_info_to_pb(identity))

    def _create_engine(self, config: EngineConfig) -> Engine:
        engine = self._engine_factory(config)
        engine.start()  # loads the replicas and runs the warm-up step
        return engine

    async def _refresh_loop(self) -> None:
        last_trim_s = time.monotonic()
        while True:
            await asyncio.sleep(self.settings.load_refresh_s)
            if time.monotonic() - last_trim_s >= _HEAP_TRIM_INTERVAL_S:
                last_trim_s = time.monotonic()
                trim_heap()  # RSS stays at what is in use (see shared.memory)
            if self.core is not None:
                try:
                    self.core.refresh_metrics()
                except Exception:
                    log.exception("load_gauges_refresh_failed")

    def begin_drain(self) -> None:
        """Refuse new work from now on (called before health says NOT_SERVING)."""
        if self.core is not None:
            self.core.begin_drain()

    async def drain(self) -> None:
        """NOT_SERVING, leave the cluster, let in-flight requests finish, abort what's left."""
        self.begin_drain()  # first: once health says NOT_SERVING, new work is refused
        await self.server.set_serving(False)
        await self.finish_in_flight()

    async def finish_in_flight(self) -> None:
        """Leave the cluster, let in-flight requests finish within drain_grace_s, then abort
        what is left (after `begin_drain` and NOT_SERVING)."""
        grace_s = self.settings.drain_grace_s
        if self.registration is not None:
            await self.registration.deregister()
            self.registration = None
        if self.core is None:
            return
        log.info("drain_started", in_flight=self.core.num_active, grace_s=grace_s)
        if not await self.core.wait_idle(grace_s):
            aborted = self.core.abort_all()
            log.warning("drain_grace_expired_aborting", aborted=len(aborted))
            if not await self.core.wait_idle(_ABORT_FLUSH_S):
                log.warning("drain_incomplete", in_flight=self.core.num_active)
        log.info("drained")

    async def stop(self) -> None:
        """Stop the server and the engine (after `drain`, nothing is in flight); safe to call
        after serve_until_stopped already stopped the server."""
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        if self.registration is not None:
            await self.registration.deregister()
        await self.server.stop(_SERVER_STOP_GRACE_S)
        if self.core is not None:
            await self.core.cancel_handoffs()  # before their channels close
        await self.channels.close()
        if self.engine is not None:
            self.engine.shutdown()


async def serve(settings: WorkerSettings) -> None:
    """Serve until SIGTERM/SIGINT: listen (NOT_SERVING), load, register, SERVING; on the signal
    refuse new work, NOT_SERVING, drain, stop. A signal while loading stops at once."""
    app = WorkerApp(settings)
    app._log_identity()
    try:
        await serve_until_stopped(
            app.server,
            on_ready=app.ready,
            on_drain=app.finish_in_flight,
            grace_s=_SERVER_STOP_GRACE_S,
            on_stop_requested=app.begin_drain,
        )
    finally:
        await app.stop()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (it comes with uvicorn[standard]), else asyncio's.

    Every streamed token crosses this loop several times (the engine thread's per-step handoff,
    grpc's completion-queue wakeup and its write, the frame's tasks): uvloop's handles, callbacks
    and selector are C, asyncio's are Python, which made them a large part of the worker's host CPU
    per token with many requests in flight."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


@exit_on_port_in_use
def main(argv: Sequence[str] | None = None, prog: str = "pdserve worker") -> None:
    settings = parse_settings(WorkerSettings, sys.argv[1:] if argv is None else argv, prog=prog)
    configure_logging(settings.service_name, settings.log_level, settings.log_format)
    configure_tracing(settings.service_name, otel_env())
    port = start_metrics_server(settings.metrics_port)
    if port >= 0:
        log.info("metrics_listening", port=port)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve(settings))
    except (FileNotFoundError, ValueError, PdserveError) as exc:  # a configuration problem: say what
        log.error("worker_failed", error=str(exc))
        raise SystemExit(1) from None
    except Exception:
        log.exception("worker_failed")
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
