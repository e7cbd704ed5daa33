"""The gateway's gRPC clients of the scheduler and the workers (implementing `ports`): one cached
channel per address, RPC errors mapped to domain errors that say which peer failed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import structlog

from services.gateway import convert
from services.gateway.ports import (
    DecodeEvent,
    DecodeEventKind,
    KvDestination,
    ModelCard,
    Placement,
    PrefillResult,
    ScheduleQuery,
    WorkerJob,
    WorkerOutOfCapacity,
    WorkerTarget,
    WorkerUnavailable,
)
from shared import errors
from shared.channels import make_channel
from shared.proto import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

log = structlog.get_logger(__name__)

# How long a decode worker may take to end its call after the FINAL frame (seconds).
_END_OF_STREAM_WAIT_S = 2.0


class ChannelPool:
    """One grpc.aio channel per address, created on first use, closed together."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = make_channel(address)
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


def map_rpc_error(exc: grpc.aio.AioRpcError, peer: str, worker_id: str = "") -> errors.PdserveError:
    """A peer's failure as a domain error. UNAVAILABLE (any peer) and RESOURCE_EXHAUSTED (a worker)
    are Retryable elsewhere; the status code and the peer's message are kept for the client."""
    code, detail = exc.code(), exc.details() or ""
    where = f"{peer}: {detail}" if detail else peer
    if code == grpc.StatusCode.UNAVAILABLE:
        return WorkerUnavailable(f"{peer} is unavailable ({detail or 'no details'})", worker_id)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if worker_id:
            return WorkerOutOfCapacity(f"{peer} is out of capacity ({detail or 'no details'})", worker_id)
        return errors.ResourceExhausted(where)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.InvalidArgument(f"rejected by {where}")
    if code == grpc.StatusCode.NOT_FOUND:
        return errors.NotFound(where) if not worker_id else errors.FailedPrecondition(f"{where}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return errors.FailedPrecondition(where)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.DeadlineExceeded(f"the request ran past its deadline at {peer}")
    if code == grpc.StatusCode.CANCELLED:
        return errors.Cancelled(f"{peer} cancelled the request")
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return errors.AlreadyExists(where)
    # INTERNAL, UNKNOWN, DATA_LOSS, ...: the interceptor turns this into a generic INTERNAL.
    log.error("peer_error", peer=peer, code=code.name, detail=detail)
    return errors.PdserveError(f"{peer} failed with {code.name}: {detail}")


class GrpcScheduler:
    def __init__(self, pool: ChannelPool, address: str, control_timeout_s: float = 10.0) -> None:
        self._pool = pool
        self._address = address
        self._control_timeout_s = control_timeout_s

    def _stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        return scheduler_pb2_grpc.SchedulerStub(self._pool.get(self._address))  # type: ignore[no-untyped-call]

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


class GrpcDecodeStream:
    """A Decode call's frames; cancel() ends the call (the worker sees the cancellation)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, target: WorkerTarget) -> None:
        self._call = call
        self._target = target

    async def next(self) -> DecodeEvent | None:
        try:
            frame = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(
                exc,
                f"decode worker {self._target.worker_id} ({self._target.address})",
                self._target.worker_id,
            ) from None
        if frame is grpc.aio.EOF:
            return None
        try:
            event = convert.decode_event(frame)
        except ValueError as exc:
            raise errors.FailedPrecondition(f"decode worker {self._target.worker_id}: {exc}") from None
        if event.kind is DecodeEventKind.FINAL:
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


class GrpcWorkers:
    def __init__(self, pool: ChannelPool, control_timeout_s: float = 10.0) -> None:
        self._pool = pool
        self._control_timeout_s = control_timeout_s

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self._pool.get(address))  # type: ignore[no-untyped-call]

    def decode(
        self, target: WorkerTarget, job: WorkerJob, local_prefill: bool, timeout_s: float | None
    ) -> GrpcDecodeStream:
        call = self._stub(target.address).Decode(
            convert.decode_request(job, target.dp_rank, local_prefill), timeout=timeout_s
        )
        return GrpcDecodeStream(call, target)

    async def prefill(
        self, target: WorkerTarget, job: WorkerJob, kv: KvDestination | None, timeout_s: float | None
    ) -> PrefillResult:
        try:
            resp = await self._stub(target.address).Prefill(
                convert.prefill_request(job, target.dp_rank, kv), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(
                exc, f"prefill worker {target.worker_id} ({target.address})", target.worker_id
            ) from None
        return convert.prefill_result(resp)

    async def abort(self, address: str, request_id: str) -> bool:
        resp = await self._stub(address).Abort(
            worker_pb2.AbortRequest(request_id=request_id), timeout=self._control_timeout_s
        )
        return bool(resp.found)
