"""Mapping of domain errors to gRPC status codes, as one server interceptor for every service."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from shared import errors

log = structlog.get_logger(__name__)

STATUS_BY_ERROR: dict[type[errors.PdserveError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}

GENERIC_INTERNAL_MESSAGE = "internal error; see the server log"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and client-facing message for an exception."""
    for cls in type(exc).__mro__:
        code = STATUS_BY_ERROR.get(cls)  # type: ignore[call-overload]
        if code is not None:
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, GENERIC_INTERNAL_MESSAGE


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("unhandled_error", method=method, exc_info=exc)
    else:
        log.info("request_error", method=method, code=code.name, error=message)
    await context.abort(code, message)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns domain exceptions raised by servicers into proper statuses (unary and streaming)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method

        def wrap_unary(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await fn(request, context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await _abort(context, exc, method)

            return wrapper

        def wrap_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async for item in fn(request, context):
                        yield item
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await _abort(context, exc, method)

            return wrapper

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                wrap_stream(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
