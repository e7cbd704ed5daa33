"""Domain errors <-> gRPC status codes, one table for both directions: on the server side one
interceptor for every service turns domain errors into statuses; on the client side
`error_from_rpc` turns a peer's status back into the domain error of that status, so an error
crosses a chain of services (gateway -> worker -> worker) as what it is."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import grpc
import structlog

from shared import errors
from shared.server_streams import close_when_call_ends

log = structlog.get_logger(__name__)

STATUS_BY_ERROR: dict[type[errors.PdserveError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# The inverse, for clients. Codes not in it (INTERNAL, UNKNOWN, DATA_LOSS, ...) have no domain
# class: they become a plain PdserveError, which this service's own interceptor reports as INTERNAL.
ERROR_BY_STATUS: dict[grpc.StatusCode, type[errors.PdserveError]] = {
    code: cls for cls, code in STATUS_BY_ERROR.items()
}

GENERIC_INTERNAL_MESSAGE = "internal error; see the server log"


def error_from_status(
    code: grpc.StatusCode,
    detail: str,
    peer: str,
    *,
    keep: Collection[grpc.StatusCode] | None = None,
    otherwise: type[errors.PdserveError] = errors.PdserveError,
) -> errors.PdserveError:
    """The domain error for status `code` with message `detail` from `peer` (a phrase naming who
    was called, e.g. "decode worker d1 (10.0.0.7:50071)"); the message keeps the peer's detail.

    `keep` limits the codes that keep their own class (default: all in ERROR_BY_STATUS); the others
    become `otherwise` (e.g. a KV push turns everything but a refusal into Unavailable)."""
    cls = ERROR_BY_STATUS.get(code)
    if cls is None or (keep is not None and code not in keep):
        return otherwise(f"{peer} failed with {code.name}: {detail}")
    where = f"{peer}: {detail}" if detail else peer
    if code == grpc.StatusCode.UNAVAILABLE:
        message = f"{peer} is unavailable ({detail or 'no details'})"
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        message = f"{peer} is out of capacity ({detail or 'no details'})"
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        message = f"rejected by {where}"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"the request ran past its deadline at {peer}"
    elif code == grpc.StatusCode.CANCELLED:
        message = f"{peer} cancelled the request"
    else:
        message = where
    return cls(message)


def error_from_rpc(
    exc: grpc.aio.AioRpcError,
    peer: str,
    *,
    keep: Collection[grpc.StatusCode] | None = None,
    otherwise: type[errors.PdserveError] = errors.PdserveError,
) -> errors.PdserveError:
    """A failed call to `peer` as a domain error (see error_from_status)."""
    return error_from_status(exc.code(), exc.details() or "", peer, keep=keep, otherwise=otherwise)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and client-facing message for an exception."""
    for cls in type(exc).__mro__:
        code = STATUS_BY_ERROR.get(cls)
        if code is not None:
            return code, str(exc)
    if isinstance(exc, NotImplementedError):  # generated base servicers (e.g. health's List)
        return grpc.StatusCode.UNIMPLEMENTED, "this method is not implemented by the server"
    return grpc.StatusCode.INTERNAL, GENERIC_INTERNAL_MESSAGE


class _Undecodable:
    """What a guarded deserializer returns for bytes that are not a valid message (truncated,
    wrong wire types, invalid UTF-8 in a string field): the handler answers INVALID_ARGUMENT.
    grpc's own path would answer UNKNOWN (INTERNAL on client-streaming calls) with a traceback."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _guard_deserializer(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, UnicodeDecodeError, ...
            return _Undecodable(f"{type(exc).__name__}: {exc}"[:200])

    return deserialize


def _check_decoded(request: Any, method: str) -> Any:
    if isinstance(request, _Undecodable):
        log.info("undecodable_request", method=method, error=request.error)
        raise errors.InvalidArgument(
            f"the request message could not be decoded as {method.rsplit('/', 1)[-1]}'s request "
            "type (malformed protobuf or invalid UTF-8 in a string field)"
        )
    return request


async def _checked_stream(requests: AsyncIterator[Any], method: str) -> AsyncIterator[Any]:
    async for request in requests:
        yield _check_decoded(request, method)


RETRY_AFTER_MS_KEY = "retry-after-ms"  # trailing metadata of a refusal that names when to retry


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("unhandled_error", method=method, exc_info=exc)
    else:
        log.info("request_error", method=method, code=code.name, error=message)
    retry_after_s = getattr(exc, "retry_after_s", None)
    trailing: tuple[tuple[str, str], ...] = ()
    if isinstance(retry_after_s, int | float) and retry_after_s >= 0:
        trailing = ((RETRY_AFTER_MS_KEY, str(round(retry_after_s * 1000))),)
    await context.abort(code, message, trailing_metadata=trailing)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns domain exceptions raised by servicers into proper statuses (unary and streaming), and
    request bytes that do not decode into INVALID_ARGUMENT with a one-line log, on every method of
    every service of the server (health and reflection included)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        deserializer = _guard_deserializer(handler.request_deserializer)

        def wrap_unary(fn: Callable[..., Any], streaming_request: bool) -> Callable[..., Any]:
            async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    if streaming_request:
                        request = _checked_stream(request, method)
                    else:
                        request = _check_decoded(request, method)
                    result = fn(request, context)
                    return await result if inspect.isawaitable(result) else result
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await _abort(context, exc, method)

            return wrapper

        def wrap_stream(fn: Callable[..., Any], streaming_request: bool) -> Callable[..., Any]:
            # A handler may also be a coroutine that writes with context.write (grpc's health
            # Watch): it is awaited inside this generator, which then yields nothing itself. So
            # every streaming handler is a generator, as interceptors outside this one expect.
            writes_itself = inspect.iscoroutinefunction(fn)

            async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    if streaming_request:
                        request = _checked_stream(request, method)
                    else:
                        request = _check_decoded(request, method)
                    if writes_itself:
                        await fn(request, context)
                        return
                    stream = close_when_call_ends(fn(request, context))
                    async for item in stream:
                        yield item
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await _abort(context, exc, method)

            return wrapper

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary, False),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary, True),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream, False),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                wrap_stream(handler.stream_stream, True),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
