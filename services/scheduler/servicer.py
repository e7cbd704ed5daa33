"""The Scheduler gRPC servicer: convert -> one domain call -> convert."""

from __future__ import annotations

import grpc
import structlog

from services.scheduler import convert
from services.scheduler.router import Router
from shared.proto import scheduler_pb2, scheduler_pb2_grpc


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, router: Router) -> None:
        self._router = router

    async def Schedule(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ScheduleResponse:
        # Each RPC runs in its own task (own context): nothing to unbind.
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        return convert.decision_to_pb(self._router.schedule(convert.features_from_pb(request)))

    async def GetState(
        self, request: scheduler_pb2.GetStateRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetStateResponse:
        return convert.state_to_pb(self._router.state())
