"""The client side of gRPC between pdserve services: channels, one cache of them, per-call metadata.

Every channel a service dials comes from here, so these hold for all of them:
- large-message options (shared.server.CHANNEL_OPTIONS) and trace propagation (shared.tracing);
- TLS is what the caller passes in (`tls`, from the service's settings; None = plaintext): there
  is no process-wide default to forget to set;
- metadata every call carries (a cluster token on internal RPCs, an API key towards a gateway) is
  attached in one place: pass `call_metadata`, a function returning (key, value) pairs, and one
  client interceptor adds them to every call made on the channel (unary and streaming alike).
  It is called once per call, so a rotated credential is picked up without new channels.

Errors of calls made here map to domain errors with `shared.grpc_errors.error_from_rpc`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from shared.server import CHANNEL_OPTIONS
from shared.tls import TlsConfig
from shared.tracing import client_interceptors

# Returns the (key, value) metadata pairs to attach to one call; keys are lower-case ASCII.
CallMetadata = Callable[[], Sequence[tuple[str, str]]]


class _AddMetadata:
    """Adds `call_metadata()` to a call's metadata (after what the caller set)."""

    def __init__(self, call_metadata: CallMetadata) -> None:
        self._call_metadata = call_metadata

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
        for key, value in self._call_metadata():
            metadata.add(key, value)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# grpc.aio files each interceptor under the first call kind it implements, so each kind needs
# its own object.
class _UnaryUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnary(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _StreamStream(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def metadata_interceptors(call_metadata: CallMetadata) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that add `call_metadata()` to every call, of every kind."""
    return [cls(call_metadata) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def make_channel(
    address: str, tls: TlsConfig | None = None, call_metadata: CallMetadata | None = None
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` (host:port) that propagates the trace context; TLS when
    `tls` is given (see shared.tls), plaintext otherwise; `call_metadata` on every call."""
    interceptors = client_interceptors()
    if call_metadata is not None:  # only then: an interceptor costs every call a little
        interceptors.extend(metadata_interceptors(call_metadata))
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address,
        tls.channel_credentials(),
        options=[*CHANNEL_OPTIONS, *tls.channel_options()],
        interceptors=interceptors,
    )


class ChannelCache:
    """One channel per peer address, created on first use with this process's TLS and call
    metadata, closed together by `close`. A service keeps one cache for everything it dials.

    With `max_channels`, the least recently used channel is dropped when a new address would
    exceed it (peers such as decode workers come and go); a dropped channel is closed with
    `evict_grace_s` for calls still in flight on it, and `close` waits for those too.
    Owned by one event loop."""

    def __init__(
        self,
        *,
        tls: TlsConfig | None,
        call_metadata: CallMetadata | None = None,
        max_channels: int | None = None,
        evict_grace_s: float = 60.0,
    ) -> None:
        if max_channels is not None and max_channels < 1:
            raise ValueError("max_channels must be >= 1")
        self._tls = tls
        self._call_metadata = call_metadata
        self._max_channels = max_channels
        self._evict_grace_s = evict_grace_s
        self._channels: dict[str, grpc.aio.Channel] = {}  # least recently used first
        self._closing: set[asyncio.Future[None]] = set()

    def get(self, address: str) -> grpc.aio.Channel:
        """The channel to `address` (host:port); created now if there is none."""
        channel = self._channels.pop(address, None)
        if channel is None:
            if self._max_channels is not None and len(self._channels) >= self._max_channels:
                oldest = next(iter(self._channels))
                self._close_later(self._channels.pop(oldest))
            channel = make_channel(address, self._tls, self._call_metadata)
        self._channels[address] = channel  # most recently used last
        return channel

    def __contains__(self, address: str) -> bool:
        return address in self._channels

    def __len__(self) -> int:
        return len(self._channels)

    async def forget(self, address: str) -> None:
        """Close the channel to a peer that left (no-op when there is none)."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        """Close every channel (calls still running on them are cancelled)."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        self._closing.clear()

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        closing = asyncio.ensure_future(channel.close(grace=self._evict_grace_s))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
