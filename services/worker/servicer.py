"""pdserve.v1.Worker servicer: convert the request, make one core call, convert the reply."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog

from services.worker import convert
from services.worker.core import WorkerCore
from services.worker.messages import IncomingKvChunk
from shared import errors
from shared.cluster_convert import worker_info_to_pb
from shared.proto import common_pb2, worker_pb2, worker_pb2_grpc


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Answers UNAVAILABLE until `core` is set (the model is still loading)."""

    def __init__(self, core: WorkerCore | None = None) -> None:
        self.core = core

    def _core(self) -> WorkerCore:
        if self.core is None:
            raise errors.Unavailable("worker is still loading its model; retry shortly")
        return self.core

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        result = await self._core().prefill(convert.prefill_call_from_pb(request))
        return convert.prefill_result_to_pb(result)

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeFrame]:
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        events = self._core().decode(convert.decode_call_from_pb(request))
        try:
            async for event in events:
                yield convert.decode_event_to_pb(event)
        finally:
            await events.aclose()  # a cancelled client aborts the request and frees its KV

    async def PushKv(
        self,
        request_iterator: AsyncIterator[worker_pb2.KvChunk],
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.PushKvResponse:
        async def chunks() -> AsyncIterator[IncomingKvChunk]:
            async for pb in request_iterator:
                structlog.contextvars.bind_contextvars(request_id=pb.request_id)
                yield convert.kv_chunk_from_pb(pb)

        receipt = await self._core().receive_kv(chunks())
        return convert.kv_receipt_to_pb(receipt)

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        return worker_pb2.AbortResponse(found=self._core().abort(request.request_id))

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetLoadResponse:
        core = self._core()
        core.refresh_metrics()
        return convert.get_load_to_pb(core.identity.worker_id, core.rank_loads())

    async def Info(
        self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerInfo:
        return worker_info_to_pb(self._core().identity)

    async def LoadLoraAdapter(
        self, request: worker_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadLoraAdapterResponse:
        change = await self._core().load_lora_adapter(request.name, request.path)
        return convert.lora_load_response(change)

    async def UnloadLoraAdapter(
        self, request: worker_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.UnloadLoraAdapterResponse:
        change = await self._core().unload_lora_adapter(request.name)
        return convert.lora_unload_response(change)
