"""Client channels to other pdserve services: large-message options and trace propagation."""

from __future__ import annotations

import grpc

from shared.server import CHANNEL_OPTIONS
from shared.tracing import client_interceptors


def make_channel(address: str) -> grpc.aio.Channel:
    """An insecure grpc.aio channel to `address` (host:port) that propagates the trace context."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=client_interceptors())
