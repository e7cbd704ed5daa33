"""The gateway's gRPC clients of the scheduler and the workers (implementing `ports`): channels
from the process's ChannelCache, RPC errors mapped to domain errors that say which peer failed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway import convert
from services.gateway.ports import (
    ClusterState,
    ClusterWorker,
    DecodeEvent,
    KvDestination,
    ModelCard,
    Placement,
    PrefillResult,
    ScheduleQuery,
    WorkerGone,
    WorkerJob,
    WorkerLacksFeature,
    WorkerOutOfCapacity,
    WorkerTarget,
    WorkerUnavailable,
)
from shared import errors
from shared.channels import ChannelCache
from shared.cluster import DecodeFrameKind
from shared.grpc_errors import ERROR_BY_STATUS, error_from_rpc
from shared.proto import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

log = structlog.get_logger(__name__)

# How long a decode worker may take to end its call after the FINAL frame (seconds).
_END_OF_STREAM_WAIT_S = 2.0


def map_rpc_error(
    exc: grpc.aio.AioRpcError, peer: str, worker_id: str = "", lora_adapter: str = ""
) -> errors.PdserveError:
    """A peer's failure as a domain error (shared.grpc_errors), made Retryable where another
    worker may succeed: UNAVAILABLE (any peer) and RESOURCE_EXHAUSTED (a worker). A worker's
    NOT_FOUND (it no longer knows the request) is a FailedPrecondition of this request, not a
    missing thing the client named; but one saying that the request's LoRA adapter is not loaded
    there (the worker dropped it while the request was on its way: an unload in progress) is a
    worker lacking a feature, retried on another worker and else RESOURCE_EXHAUSTED (retry
    later: by then the model is listed, or 404)."""
    error = error_from_rpc(exc, peer)
    if isinstance(error, errors.Unavailable):
        return WorkerUnavailable(str(error), worker_id)
    if worker_id and isinstance(error, errors.ResourceExhausted):
        return WorkerOutOfCapacity(str(error), worker_id)
    if worker_id and isinstance(error, errors.NotFound):
        # the engine's words (services/worker/engine/rank.py, engine.py) for an adapter it lacks
        if lora_adapter and f"LoRA adapter {lora_adapter!r} is not loaded" in str(error):
            return WorkerLacksFeature(str(error), worker_id)
        return errors.FailedPrecondition(str(error))
    if exc.code() not in ERROR_BY_STATUS:  # INTERNAL, UNKNOWN, ...: the client sees a generic INTERNAL
        log.error("peer_error", peer=peer, code=exc.code().name, detail=exc.details() or "")
    return error


class GrpcScheduler:
    def __init__(self, channels: ChannelCache, address: str, control_timeout_s: float = 10.0) -> None:
        self._channels = channels
        self._address = address
        self._control_timeout_s = control_timeout_s

    def _stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        return scheduler_pb2_grpc.SchedulerStub(self._channels.get(self._address))

    async def schedule(self, query: ScheduleQuery, timeout_s: float | None) -> Placement:
        peer = f"scheduler {self._address}"
        try:
            resp = await self._stub().Schedule(convert.schedule_request(query), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc, peer) from None
        try:
            return convert.placement(resp)
        except ValueError as exc:
            raise errors.FailedPrecondition(f"{peer} returned an unusable placement: {exc}") from None

    async def list_models(self) -> Sequence[ModelCard]:
        try:
            state = await self._stub().GetState(
                scheduler_pb2.GetStateRequest(), timeout=self._control_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc, f"scheduler {self._address}") from None
        return convert.model_cards(state)

    async def cluster_state(self, timeout_s: float | None) -> ClusterState:
        try:
            state = await self._stub().GetState(scheduler_pb2.GetStateRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc, f"scheduler {self._address}") from None
        return convert.cluster_state(state)


class GrpcDecodeStream:
    """A Decode call's frames; cancel() ends the call (the worker sees the cancellation)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, target: WorkerTarget, lora_adapter: str = "") -> None:
        self._call = call
        self._target = target
        self._lora_adapter = lora_adapter  # the request's, for map_rpc_error
        self._abandoned: str | None = None  # why, once abandon() was called
        self._gone_worker_id = target.worker_id  # whose absence abandon() reported

    async def next(self) -> DecodeEvent | None:
        if self._abandoned is not None:
            raise WorkerGone(self._abandoned, self._gone_worker_id)
        try:
            frame = await self._call.read()
        except asyncio.CancelledError:
            # grpc.aio ends a read pending on a locally cancelled call with CancelledError; when
            # abandon() did that (and not a cancellation of this task), it is the worker's failure.
            task = asyncio.current_task()
            if self._abandoned is not None and (task is None or not task.cancelling()):
                raise WorkerGone(self._abandoned, self._gone_worker_id) from None
            raise
        except grpc.aio.AioRpcError as exc:
            if self._abandoned is not None:
                raise WorkerGone(self._abandoned, self._gone_worker_id) from None
            raise map_rpc_error(
                exc,
                f"decode worker {self._target.worker_id} ({self._target.address})",
                self._target.worker_id,
                self._lora_adapter,
            ) from None
        if frame is grpc.aio.EOF:
            return None
        try:
            event = convert.decode_event(frame)
        except ValueError as exc:
            raise errors.FailedPrecondition(f"decode worker {self._target.worker_id}: {exc}") from None
        if event.kind is DecodeFrameKind.FINAL:
            await self._finish()
        return event

    async def _finish(self) -> None:
        """After FINAL the worker ends the call: read its end so the call (and its trace span) is
        closed now; a worker that keeps the stream open gets cancelled."""
        try:
            await asyncio.wait_for(self._call.read(), _END_OF_STREAM_WAIT_S)
        except (TimeoutError, grpc.aio.AioRpcError):
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()

    def abandon(self, reason: str, worker_id: str | None = None) -> None:
        if self._abandoned is None:
            self._abandoned = reason
            self._gone_worker_id = worker_id or self._target.worker_id
            self._call.cancel()


class GrpcMembership:
    """Membership as the scheduler routes on it (Scheduler/GetState, so no new RPC and no address
    of the load-monitor at the gateway), and health-check probes of workers."""

    def __init__(self, channels: ChannelCache, scheduler_address: str) -> None:
        self._channels = channels
        self._scheduler_address = scheduler_address

    async def members(self, timeout_s: float) -> frozenset[str] | None:
        stub = scheduler_pb2_grpc.SchedulerStub(self._channels.get(self._scheduler_address))
        try:
            state = await stub.GetState(scheduler_pb2.GetStateRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("membership_unknown", scheduler=self._scheduler_address, code=exc.code().name)
            return None
        if state.stale:  # the scheduler lost the load-monitor: its list may be out of date
            return None
        return frozenset(w.info.worker_id for w in state.workers)

    async def responds(self, address: str, timeout_s: float) -> bool:
        stub = health_pb2_grpc.HealthStub(self._channels.get(address))
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            # No answer in time, or no connection: gone. Any other status is an answer.
            return exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        return True


class GrpcWorkers:
    def __init__(self, channels: ChannelCache, control_timeout_s: float = 10.0) -> None:
        self._channels = channels
        self._control_timeout_s = control_timeout_s

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self._channels.get(address))

    def decode(
        self,
        target: WorkerTarget,
        job: WorkerJob,
        local_prefill: bool,
        timeout_s: float | None,
        transfer_ticket: str | None = None,
    ) -> GrpcDecodeStream:
        call = self._stub(target.address).Decode(
            convert.decode_request(job, target.dp_rank, local_prefill, transfer_ticket), timeout=timeout_s
        )
        return GrpcDecodeStream(call, target, job.sampling.lora_adapter)

    async def prefill(
        self, target: WorkerTarget, job: WorkerJob, kv: KvDestination | None, timeout_s: float | None
    ) -> PrefillResult:
        try:
            resp = await self._stub(target.address).Prefill(
                convert.prefill_request(job, target.dp_rank, kv), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(
                exc,
                f"prefill worker {target.worker_id} ({target.address})",
                target.worker_id,
                job.sampling.lora_adapter,
            ) from None
        return convert.prefill_result(resp)

    async def abort(self, address: str, request_id: str) -> bool:
        resp = await self._stub(address).Abort(
            worker_pb2.AbortRequest(request_id=request_id), timeout=self._control_timeout_s
        )
        return bool(resp.found)

    # --- LoRA adapters (1.14); a worker's errors as they are (its NOT_FOUND: not loaded there) ---

    async def load_lora_adapter(self, worker: ClusterWorker, name: str, path: str, timeout_s: float) -> None:
        try:
            await self._stub(worker.address).LoadLoraAdapter(
                worker_pb2.LoadLoraAdapterRequest(name=name, path=path), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise _lora_error(exc, worker) from None

    async def unload_lora_adapter(self, worker: ClusterWorker, name: str, timeout_s: float) -> str:
        try:
            resp = await self._stub(worker.address).UnloadLoraAdapter(
                worker_pb2.UnloadLoraAdapterRequest(name=name), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise _lora_error(exc, worker) from None
        return str(resp.path)


def _lora_error(exc: grpc.aio.AioRpcError, worker: ClusterWorker) -> errors.PdserveError:
    """A worker's refusal as the domain error of its status; UNIMPLEMENTED (a worker older than
    1.14 that advertised lora_runtime anyway) is a FailedPrecondition naming it."""
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return errors.FailedPrecondition(f"{worker} cannot load or unload LoRA adapters (UNIMPLEMENTED)")
    if exc.code() not in ERROR_BY_STATUS:
        log.error("peer_error", peer=str(worker), code=exc.code().name, detail=exc.details() or "")
    return error_from_rpc(exc, str(worker))
