"""Server-streaming calls end in the task that served them: their generators are closed there.

grpc.aio iterates a generator handler itself; a client that cancels while grpc awaits a send
leaves the generator suspended at `yield`, and the garbage collector closes it later, in another
task and context: clean-up (aborts, the request's end state) runs late, and OpenTelemetry's
context tokens fail to detach ("Failed to detach context" tracebacks). Interceptors that iterate
the handler's generator (OpenTelemetry's) do not close it either. So the outermost interceptor
runs every streaming handler as a coroutine writing with context.write (the cancellation arrives
there), and on the way out closes the outer generator and every generator registered with
`close_when_call_ends` during the call (the innermost handler's, by ErrorMappingInterceptor).
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

G = TypeVar("G", bound=AsyncGenerator[Any, None])

# The generators to close when the current call ends (one list per call: each call is a task).
_OPEN_STREAMS: contextvars.ContextVar[list[AsyncGenerator[Any, None]] | None] = contextvars.ContextVar(
    "pdserve_open_streams", default=None
)


def close_when_call_ends(stream: G) -> G:
    """Register `stream` to be closed in this call's task when the call ends (no-op outside a
    call run by CloseStreamsInterceptor). Returns it."""
    streams = _OPEN_STREAMS.get()
    if streams is not None:
        streams.append(stream)
    return stream


class CloseStreamsInterceptor(grpc.aio.ServerInterceptor):
    """Must be the first (outermost) interceptor of a server."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler.response_streaming:
            return handler
        inner = handler.unary_stream or handler.stream_stream
        if inspect.iscoroutinefunction(inner):  # already writes with context.write
            return handler

        async def write_all(request: Any, context: grpc.aio.ServicerContext) -> None:
            registered: list[AsyncGenerator[Any, None]] = []
            _OPEN_STREAMS.set(registered)
            stream = inner(request, context)
            try:
                async for item in stream:
                    await context.write(item)
            finally:
                await stream.aclose()
                for inner_stream in reversed(registered):  # innermost last registered
                    await inner_stream.aclose()

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream
            else grpc.stream_stream_rpc_method_handler
        )
        return make(
            write_all,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
