"""gRPC server interceptor that requires an API key (`authorization: Bearer <key>` metadata) on the
services it protects; every other service (health, reflection) stays open. Also the pieces every
credential interceptor shares (shared.cluster_auth uses them): reading one metadata value and a
refusal handler of the refused method's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import grpc
import structlog

from shared.auth import AUTH_HEADER, UNAUTHENTICATED_MESSAGE, ApiKeys

log = structlog.get_logger(__name__)


def metadata_value(details: grpc.HandlerCallDetails, key: str) -> str | None:
    """The first value of metadata `key` on the call (bytes read as latin-1), None without one."""
    for item in details.invocation_metadata or ():
        k, v = item[0], item[1]
        if k == key:
            return v.decode("latin-1") if isinstance(v, bytes) else str(v)
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Calls to `protected_services` (full names, e.g. "pdserve.v1.Gateway") without a valid key end
    with UNAUTHENTICATED before the servicer runs."""

    def __init__(self, keys: ApiKeys, protected_services: Collection[str]) -> None:
        self._keys = keys
        self._prefixes = tuple(f"/{name}/" for name in protected_services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self._keys.enabled or not method.startswith(self._prefixes):
            return handler
        if self._keys.accepts(metadata_value(handler_call_details, AUTH_HEADER)):
            return handler
        log.info("unauthenticated", method=method)  # never the key itself
        return refusal(handler, UNAUTHENTICATED_MESSAGE)


def refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED, `message`."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    kw: dict[str, Any] = dict(
        request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    return grpc.stream_stream_rpc_method_handler(stream, **kw)
