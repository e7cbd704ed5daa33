"""Who may call internal RPCs: members of the cluster. With mutual TLS, a peer's certificate
(checked against the cluster CA) is its identity; without TLS, or in addition to it, a shared
cluster token (`--cluster-token`, env PDSERVE_CLUSTER_TOKEN, a Secret in the Helm chart) travels
as `x-pdserve-cluster-token` metadata on every internal call (Register, Heartbeat, Deregister,
Schedule, GetState, GetLoads, WatchLoads, Prefill, Decode, PushKv, Abort, GetLoad, Info).

Server side: `ClusterTokenInterceptor` ends calls to the internal services without the token with
UNAUTHENTICATED before the servicer runs (health and reflection stay open). Client side:
`token_metadata` is the ChannelCache `call_metadata` hook that adds it. The token is compared in
constant time and never logged. An empty token turns the check off (development stacks).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection, Sequence

import grpc
import structlog

from shared.grpc_auth import metadata_value, refusal

log = structlog.get_logger(__name__)

TOKEN_HEADER = "x-pdserve-cluster-token"
# The services only cluster members may call (full names).
INTERNAL_SERVICES = ("pdserve.v1.Scheduler", "pdserve.v1.LoadMonitor", "pdserve.v1.Worker")
UNAUTHENTICATED_MESSAGE = (
    "this is an internal pdserve RPC: send the cluster token as 'x-pdserve-cluster-token' "
    "metadata (the --cluster-token / PDSERVE_CLUSTER_TOKEN every service of the cluster shares)"
)


def check_token(token: str) -> str:
    """The token as given, after checking it can travel as metadata (printable ASCII)."""
    if token and not all("!" <= ch <= "~" for ch in token):
        raise ValueError("cluster_token has a space or a non-printable/non-ASCII character")
    return token


def token_metadata(token: str) -> Callable[[], Sequence[tuple[str, str]]] | None:
    """The ChannelCache `call_metadata` hook for `token` (None when there is no token)."""
    if not token:
        return None
    pairs = ((TOKEN_HEADER, token),)
    return lambda: pairs


class ClusterTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to `protected_services` without the cluster token (UNAUTHENTICATED)."""

    def __init__(self, token: str, protected_services: Collection[str] = INTERNAL_SERVICES) -> None:
        self._token = check_token(token).encode("ascii")
        self._prefixes = tuple(f"/{name}/" for name in protected_services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self._token or not method.startswith(self._prefixes):
            return handler
        presented = metadata_value(handler_call_details, TOKEN_HEADER)
        if presented is not None and hmac.compare_digest(presented.encode("latin-1", "replace"), self._token):
            return handler
        log.warning("internal_rpc_refused", method=method, token_present=presented is not None)
        return refusal(handler, UNAUTHENTICATED_MESSAGE)


def server_interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    """What a service puts before its other interceptors ([] without a token)."""
    return [ClusterTokenInterceptor(token)] if token else []
