"""Client channels to other pdserve services: large-message options and trace propagation."""

from __future__ import annotations

import grpc

from shared.server import CHANNEL_OPTIONS
from shared.tls import TlsConfig
from shared.tracing import client_interceptors

_default_tls: TlsConfig | None = None


def set_default_tls(tls: TlsConfig | None) -> None:
    """The process's client TLS (from its settings, once at start-up; like the tracer provider)."""
    global _default_tls
    _default_tls = tls


def make_channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` (host:port) that propagates the trace context; TLS when
    `tls` (or the process default) is set (see shared.tls), plaintext otherwise."""
    tls = tls or _default_tls
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=client_interceptors())
    return grpc.aio.secure_channel(
        address,
        tls.channel_credentials(),
        options=[*CHANNEL_OPTIONS, *tls.channel_options()],
        interceptors=client_interceptors(),
    )
