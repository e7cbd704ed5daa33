"""pdserve.v1.Gateway servicer: convert -> one domain call -> convert."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from services.gateway import convert, observe
from services.gateway.service import GatewayService
from shared.grpc_errors import status_for
from shared.proto import gateway_pb2, gateway_pb2_grpc


def _client_timeout_s(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, float(remaining))


def _count_error(exc: BaseException) -> None:
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        observe.record_error(grpc.StatusCode.CANCELLED.name)
    elif not isinstance(exc, grpc.aio.AbortError):
        observe.record_error(status_for(exc)[0].name)


T = TypeVar("T")


async def _counted(call: Callable[[], Awaitable[T]]) -> T:
    """The domain call's result; a failure (conversion included) is counted by its status first."""
    try:
        return await call()
    except BaseException as exc:
        _count_error(exc)
        raise


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, service: GatewayService) -> None:
        self._service = service

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        try:
            frames = self._service.generate(convert.generate_input(request), _client_timeout_s(context))
            async with contextlib.aclosing(frames):  # closed here, in this task, when cancelled
                async for frame in frames:
                    yield convert.generate_response(frame)
        except BaseException as exc:
            _count_error(exc)
            raise

    async def Complete(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CompleteResponse:
        done = await _counted(
            lambda: self._service.complete(convert.generate_input(request), _client_timeout_s(context))
        )
        return convert.complete_response(done)

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        return convert.list_models_response(await self._service.list_models())

    async def Tokenize(
        self, request: gateway_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.TokenizeResponse:
        done = await _counted(
            lambda: self._service.tokenize(convert.tokenize_input(request), request.return_token_strs)
        )
        return convert.tokenize_response(done)

    async def Detokenize(
        self, request: gateway_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.DetokenizeResponse:
        text, model = await _counted(
            lambda: self._service.detokenize(request.model, tuple(request.token_ids))
        )
        return gateway_pb2.DetokenizeResponse(text=text, model=model)

    async def LoadLoraAdapter(
        self, request: gateway_pb2.GatewayLoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GatewayLoadLoraAdapterResponse:
        update = await _counted(
            lambda: self._service.load_lora_adapter(request.model, request.lora_name, request.lora_path)
        )
        return convert.load_lora_adapter_response(update)

    async def UnloadLoraAdapter(
        self, request: gateway_pb2.GatewayUnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GatewayUnloadLoraAdapterResponse:
        update = await _counted(lambda: self._service.unload_lora_adapter(request.model, request.lora_name))
        return convert.unload_lora_adapter_response(update)
